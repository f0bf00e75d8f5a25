"""Weights quality: perplexity on text documents with dense, int8 and int4 weights (`--weights`,
worker/quant_linear.py), against dense weights in `--dtype` (bfloat16 by default).

Each document is fed through the worker's ModelRunner in `--chunk`-token prefill chunks (the serving forward
pass and paged cache, as bench/kv_quality.py does for the KV cache); the NLL of every next token. The default
chunk, QUANT_MAX_TOKENS, keeps every step of a quantized mode on its quantized kernel, whose activations are
int8 as in decode steps (`auto` would run such steps dense, so it is not a row: its small steps are the int4
row's). Goals (docs/architecture.md, worker): int8 within 1 %, int4
within 3 % of dense.

    .venv/bin/python bench/perplexity.py [--model smollm2] [--docs 'GLOB'] [--dtype bfloat16] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script, the repo root is not on the path
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from bench.kv_quality import BLOCK_SIZE, DEFAULT_DOCS, load_docs, perplexity  # noqa: E402
from worker.device import DTYPES  # noqa: E402
from worker.loading import load_model  # noqa: E402
from worker.quant_linear import QUANT_MAX_TOKENS  # noqa: E402
from worker.runner import ModelRunner  # noqa: E402

GOALS = {"int8": 0.01, "int4": 0.03}


def measure(model: str, dtype: torch.dtype, weights: str, docs: list[list[int]], chunk: int) -> tuple[float, float]:
    """(perplexity, seconds) for one weights mode."""
    cpu = torch.device("cpu")
    loaded = load_model(model, cpu, dtype, weights=weights)  # type: ignore[arg-type]
    blocks = max(-(-len(d) // BLOCK_SIZE) for d in docs)
    t0 = time.perf_counter()
    ppl = perplexity(ModelRunner(loaded, blocks, BLOCK_SIZE, cpu, dtype), docs, chunk)
    return ppl, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2 (default), builtin, a .gguf file or a dir")
    parser.add_argument("--docs", default=DEFAULT_DOCS, help="glob of UTF-8 text files (default: ../shared/seeds)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="dtype of every row")
    parser.add_argument("--chunk", type=int, default=QUANT_MAX_TOKENS, help="prefill chunk (tokens)")
    parser.add_argument("--limit", type=int, default=0, help="tokens per document (0: all)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 128 tokens per document")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    probe = load_model(args.model, torch.device("cpu"), dtype)
    tokenizer = Tokenizer.from_str(probe.tokenizer_json.decode())
    docs = [d for d in load_docs(args.docs, tokenizer, 128 if args.quick else args.limit or None) if len(d) > 1]
    if not docs:
        sys.exit(f"perplexity: the documents matching {args.docs} have no tokens to score")
    del probe

    rows = [(w, *measure(args.model, dtype, w, docs, args.chunk)) for w in ("dense", "int8", "int4")]
    base = rows[0][1]
    tokens = sum(len(d) - 1 for d in docs)
    print(
        f"\nPerplexity, model {probe_name(args.model)}, {args.dtype}, {len(docs)} documents ({tokens} scored tokens), "
        f"{args.chunk}-token chunks, {torch.get_num_threads()} threads\n"
    )
    print("| weights | perplexity | vs dense | goal | seconds |")
    print("|---|---:|---:|---|---:|")
    for weights, ppl, secs in rows:
        delta = ppl / base - 1
        goal = GOALS.get(weights)
        verdict = "–" if goal is None else f"within {goal:.0%}: {'met' if abs(delta) <= goal else 'MISSED'}"
        print(f"| {weights} | {ppl:.4f} | {delta:+.2%} | {verdict} | {secs:.1f} |")


def probe_name(model: str) -> str:
    return Path(model).name if "/" in model else model


if __name__ == "__main__":
    main()
