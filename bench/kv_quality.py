"""KV-cache quality: the int8 cache against the model's dtype, on one model, from text documents.

All runs go through the worker's ModelRunner (the serving forward pass and paged cache), on the CPU in float32:

- Perplexity: each document is tokenized and fed in `--chunk`-token prefill chunks, so later chunks attend over
  the cached K/V as a long served prompt does; the NLL of every next token.
- Greedy agreement: `--prompts` windows of `--prompt-tokens` tokens taken from the documents (seeded), decoded
  together for `--new-tokens` greedy tokens (one prefill step, then one decode step per token); the share of
  positions where a cache's continuation has the model-dtype continuation's token, and how many continuations
  are identical. One early flip at a near tie changes a whole tail, so this figure is noisy: `--prompt-sets N`
  runs N sets of prompts (seeds --seed, --seed + 1, ...) and pools them.
- Teacher-forced: the model-dtype continuations fed through each cache: the share of positions whose argmax is
  the model-dtype one, and the mean KL divergence from the model-dtype distribution: the same error, seen
  without the tails.

Rows: the model-dtype cache (the reference); int8 as a worker serves it, each sequence with its full-precision
tail (worker/kv_cache.py); int8 without tails. `--variants` adds simulated alternatives that docs/kv_cache.md
compares (int8 values kept in a float cache): int8 without the rotation, and one scale per (block, KV head)
(requantized as the block fills).

    .venv/bin/python bench/kv_quality.py --model DIR [--docs 'GLOB'] [--prompt-sets N] [--quick] [--variants]
        [--out FILE.md]
"""

from __future__ import annotations

import argparse
import glob
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script, the repo root is not on the path
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from worker.batch import PackedBatch, SeqSlice  # noqa: E402
from worker.kv_cache import TAIL_BLOCKS, PlainStore  # noqa: E402
from worker.kv_quant import dequantize, quantize, rotation  # noqa: E402
from worker.loaded import LoadedModel  # noqa: E402
from worker.loading import load_model  # noqa: E402
from worker.runner import ModelRunner  # noqa: E402

DEFAULT_DOCS = str(ROOT.parent / "shared" / "seeds" / "*.txt")
BLOCK_SIZE = 16


class SimulatedStore(PlainStore):
    """A float store holding what an int8 variant would give back (for accuracy only), rotated or not."""

    def __init__(self, data: torch.Tensor, per_block: bool, rotate: bool) -> None:
        super().__init__(data, kernels=False)  # attention must go through read(), which un-rotates
        self.per_block, self.matrix = per_block, rotation(data.shape[-1]) if rotate else None

    def write(self, slots: torch.Tensor, x: torch.Tensor, tail_rows: torch.Tensor | None = None) -> None:
        y = x.float() if self.matrix is None else x.float() @ self.matrix
        if not self.per_block:  # one scale per (token, KV head), as the int8 cache
            super().write(slots, dequantize(*quantize(y), torch.float32).to(x.dtype))
            return
        # One scale per (block, KV head) over what the block holds so far, requantized as it fills.
        super().write(slots, y.to(x.dtype))
        blocks = (slots // self.data.shape[1]).unique()
        held = self.data[blocks].float()  # [n, block_size, kv, dim]; unwritten positions are zeros
        step = held.abs().amax(dim=(1, 3), keepdim=True).clamp_min(1e-30) / 127
        self.data[blocks] = ((held / step).round() * step).to(self.data.dtype)

    def read(self, blocks: torch.Tensor) -> torch.Tensor:
        held = super().read(blocks)
        return held if self.matrix is None else (held.float() @ self.matrix.T).to(held.dtype)


@dataclass
class Result:
    name: str
    ppl: float
    greedy: list[list[list[int]]]  # per prompt set, per prompt: the continuation
    top1: float = math.nan
    kl: float = math.nan
    seconds: float = 0.0


def load_docs(pattern: str, tokenizer: Tokenizer, limit: int | None) -> list[list[int]]:
    paths = sorted(glob.glob(pattern))
    if not paths:
        sys.exit(f"kv_quality: no documents match {pattern} (pass --docs 'GLOB')")
    docs = [tokenizer.encode(Path(p).read_text(encoding="utf-8")).ids for p in paths]
    return [d[:limit] for d in docs] if limit else docs


def perplexity(runner: ModelRunner, docs: list[list[int]], chunk: int) -> float:
    nll, count = 0.0, 0
    for ids in docs:
        table = list(range(-(-len(ids) // BLOCK_SIZE)))
        tail = tails(runner, 1)[0]
        for start in range(0, len(ids) - 1, chunk):
            end = min(start + chunk, len(ids) - 1)
            batch = PackedBatch(
                torch.tensor(ids[start:end]), torch.arange(start, end), [SeqSlice(0, table, start, end - start, tail)]
            )
            logp = runner.forward(batch, all_logits=True).log_softmax(-1)
            targets = torch.tensor(ids[start + 1 : end + 1])
            nll -= logp[torch.arange(len(targets)), targets].sum().item()
            count += len(targets)
    return math.exp(nll / count)


def tables(n: int, length: int) -> list[list[int]]:
    per = -(-length // BLOCK_SIZE)
    return [list(range(i * per, (i + 1) * per)) for i in range(n)]


def tails(runner: ModelRunner, n: int) -> list[list[int]]:
    """n sequences' full-precision tails, from the top of the cache (clear of `tables`), as the scheduler gives
    them on an int8 cache; empty ones where the runner's cache keeps none."""
    k, top = runner.cache.tail_blocks if runner.cache.int8 else 0, runner.num_blocks
    return [list(range(top - (i + 1) * k, top - i * k)) for i in range(n)]


def greedy(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    plen = len(prompts[0])
    tabs = tables(len(prompts), plen + new_tokens)
    tail = tails(runner, len(prompts))
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.arange(plen).repeat(len(prompts))
    batch = PackedBatch(ids, positions, [SeqSlice(i, t, 0, plen, tail[i]) for i, t in enumerate(tabs)])
    nxt = runner.forward(batch).argmax(-1)
    out = [nxt]
    for s in range(new_tokens - 1):
        seqs = [SeqSlice(i, t, plen + s, 1, tail[i]) for i, t in enumerate(tabs)]
        batch = PackedBatch(nxt, torch.full((len(prompts),), plen + s), seqs)
        nxt = runner.forward(batch).argmax(-1)
        out.append(nxt)
    return torch.stack(out, 1).tolist()


def teacher_forced(runner: ModelRunner, seqs: list[list[int]], plen: int, group: int = 16) -> torch.Tensor:
    """Log-probs at the continuation positions of each sequence: [n, new_tokens, vocab]."""
    out = []
    for lo in range(0, len(seqs), group):
        part = seqs[lo : lo + group]
        length = len(part[0]) - 1
        tabs = tables(len(part), length)
        tail = tails(runner, len(part))
        ids = torch.tensor([t for s in part for t in s[:-1]])
        slices = [SeqSlice(i, t, 0, length, tail[i]) for i, t in enumerate(tabs)]
        batch = PackedBatch(ids, torch.arange(length).repeat(len(part)), slices)
        logits = runner.forward(batch, all_logits=True).view(len(part), length, -1)
        out.append(logits[:, plen - 1 :].log_softmax(-1))
    return torch.cat(out)


Variant = tuple[str, tuple[bool, bool] | None, bool]
# name -> (kv_cache_dtype, simulated store: (per_block, rotate) or None for the real cache, full-precision tails)
VARIANTS: dict[str, Variant] = {
    "model dtype": ("model", None, False),
    "int8": ("int8", None, True),
    "int8 without tails": ("int8", None, False),
}
SIMULATED: dict[str, Variant] = {
    "int8, no rotation (sim.)": ("model", (False, False), False),
    "int8 per (block, KV head) (sim.)": ("model", (True, False), False),
    "int8 per (block, KV head), rotated (sim.)": ("model", (True, True), False),
}


def runner_for(loaded: LoadedModel, variant: Variant, blocks: int) -> ModelRunner:
    """A fresh (zeroed) cache of `blocks` blocks over the loaded weights."""
    kind, simulated, keep_tails = variant
    runner = ModelRunner(loaded, blocks, BLOCK_SIZE, torch.device("cpu"), torch.float32, kind)  # type: ignore[arg-type]
    if not keep_tails:
        runner.cache.tail_blocks = 0
    if simulated is not None:
        layers = runner.cache.layers
        runner.cache.layers = [
            (SimulatedStore(k.data, *simulated), SimulatedStore(v.data, *simulated)) for k, v in layers
        ]
    return runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a Hugging Face checkpoint directory, or builtin")
    parser.add_argument("--docs", default=DEFAULT_DOCS, help=f"glob of UTF-8 text documents (default {DEFAULT_DOCS})")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk for the perplexity runs")
    parser.add_argument("--seed", type=int, default=0, help="where the prompts are cut from the documents")
    parser.add_argument(
        "--prompt-sets", type=int, default=1, help="greedy runs over this many prompt sets (seeds --seed, +1, ...)"
    )
    parser.add_argument("--variants", action="store_true", help="also the simulated alternatives")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 8 prompts, 8 tokens, 600 tokens/doc")
    parser.add_argument("--out", help="also write the report (markdown) to this file")
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.new_tokens, args.prompt_tokens = 8, 8, 32
    torch.set_grad_enabled(False)

    loaded = load_model(args.model, torch.device("cpu"), torch.float32)
    tokenizer = Tokenizer.from_str(loaded.tokenizer_json.decode())
    docs = load_docs(args.docs, tokenizer, 600 if args.quick else None)
    window = args.prompt_tokens + args.new_tokens
    if any(len(d) < window + 1 for d in docs):
        sys.exit(f"kv_quality: every document needs more than {window} tokens ({args.docs})")
    if max(len(d) for d in docs) > loaded.config.max_position_embeddings:
        sys.exit(f"kv_quality: a document is longer than the model's context {loaded.config.max_position_embeddings}")
    sets = [prompt_set(docs, args.prompts, args.prompt_tokens, window, args.seed + i) for i in range(args.prompt_sets)]
    prompts = sets[0]  # also the teacher-forced runs'
    tail_room = args.prompts * TAIL_BLOCKS
    blocks = max(-(-max(len(d) for d in docs) // BLOCK_SIZE), args.prompts * -(-window // BLOCK_SIZE)) + tail_room

    runs = dict(VARIANTS) | (SIMULATED if args.variants else {})
    results: list[Result] = []
    reference: torch.Tensor | None = None
    for name, variant in runs.items():
        t0 = time.perf_counter()
        ppl = perplexity(runner_for(loaded, variant, blocks), docs, args.chunk)
        tokens = [greedy(runner_for(loaded, variant, blocks), ps, args.new_tokens) for ps in sets]
        result = Result(name, ppl, tokens)
        if reference is None:  # the model dtype's run: its continuations are what the others are fed
            seqs = [p + t for p, t in zip(prompts, tokens[0], strict=True)]
            reference = teacher_forced(runner_for(loaded, variant, blocks), seqs, args.prompt_tokens)
        else:
            logp = teacher_forced(runner_for(loaded, variant, blocks), seqs, args.prompt_tokens)
            result.top1 = (logp.argmax(-1) == reference.argmax(-1)).float().mean().item()
            result.kl = (reference.exp() * (reference - logp)).sum(-1).mean().item()
        result.seconds = time.perf_counter() - t0
        results.append(result)
        print(f"  {name}: {result.seconds:.0f} s", file=sys.stderr, flush=True)
    report(args, loaded, docs, results)


def prompt_set(docs: list[list[int]], n: int, length: int, window: int, seed: int) -> list[list[int]]:
    """n prompts of `length` tokens cut from the documents (in turn) where `window` tokens fit, seeded."""
    rng, prompts = random.Random(seed), []
    for i in range(n):
        doc = docs[i % len(docs)]
        start = rng.randrange(len(doc) - window)
        prompts.append(doc[start : start + length])
    return prompts


def agreement(r: Result, base: Result) -> tuple[list[int], list[int]]:
    """Per prompt set: tokens agreeing with `base`'s continuations, and continuations identical to them."""
    agree, same = [], []
    for mine, theirs in zip(r.greedy, base.greedy, strict=True):
        agree.append(sum(a == b for x, y in zip(mine, theirs, strict=True) for a, b in zip(x, y, strict=True)))
        same.append(sum(x == y for x, y in zip(mine, theirs, strict=True)))
    return agree, same


def report(args: argparse.Namespace, loaded: LoadedModel, docs: list[list[int]], results: list[Result]) -> None:
    base = results[0]
    per_set, sets = args.prompts * args.new_tokens, args.prompt_sets
    lines = [
        f"KV cache quality, model {loaded.name}, CPU float32: perplexity over {len(docs)} documents "
        f"({sum(len(d) for d in docs)} tokens, {args.chunk}-token chunks); greedy continuations of "
        f"{args.prompts} prompts x {args.new_tokens} tokens ({args.prompt_tokens}-token prompts from the documents)"
        f" in {sets} prompt set(s) (seeds {args.seed}..{args.seed + sets - 1}); teacher-forced on the first set",
        "",
        "| cache | perplexity | vs model dtype | greedy tokens agreeing | per prompt set | identical continuations "
        "| teacher-forced top-1 | mean KL |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    pooled = {}
    for r in results:
        agree, same = agreement(r, base)
        pooled[r.name] = sum(agree) / (per_set * sets) * 100
        each = " / ".join(f"{a / per_set * 100:.1f}" for a in agree)
        lines.append(
            f"| {r.name} | {r.ppl:.4f} | {(r.ppl / base.ppl - 1) * 100:+.2f} % | {pooled[r.name]:.1f} % | {each} "
            f"| {sum(same)}/{args.prompts * sets} | {_pct(r.top1)} | {_sci(r.kl)} |"
        )
    int8 = next(r for r in results if r.name == "int8")
    lines += [
        "",
        "| target (int8) | measured | goal | result |",
        "|---|---:|---:|---|",
        _target("perplexity vs model dtype", abs(int8.ppl / base.ppl - 1) * 100, "<= 1 %", lambda v: v <= 1, "%"),
        _target("greedy tokens agreeing", pooled["int8"], ">= 90 %", lambda v: v >= 90, "%"),
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")


def _pct(v: float) -> str:
    return "–" if math.isnan(v) else f"{v * 100:.2f} %"


def _sci(v: float) -> str:
    return "–" if math.isnan(v) else f"{v:.1e}"


def _target(name: str, value: float, goal: str, ok: Callable[[float], bool], unit: str) -> str:
    return f"| {name} | {value:.2f} {unit} | {goal} | {'met' if ok(value) else 'NOT met'} |"


if __name__ == "__main__":
    main()
