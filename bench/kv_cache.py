"""What the int8 KV cache buys and costs, side by side in one run (docs/kv_cache.md):

1. Capacity: for a fixed `--kv-cache-mb`, the blocks the worker's own sizing gives each cache dtype and the
   sequences of `--capacity-context` tokens they hold, as ratios to bfloat16 and float32 caches; for the
   builtin model and for each `--shape DIR` (a checkpoint's config.json; e.g. SmolLM2's).
2. Decode speed: the worker's Engine in process (as bench/worker_step.py), a batch of `--batch` sequences with
   `--context`-token prompts, model-dtype cache against int8 cache on the same weights, each with decode
   attention in torch ops and in the C++ kernels; best of `--repeats`, alternating the four.
3. Conversion: an `auto` worker whose cache is full of running sequences; the step that converts it to int8
   (StepRequest.kv_to_int8) against the decode steps before and after it.
4. Load: `coalesce serve` twice with the same `kv_cache_mb`, float32 cache then `auto`: `--requests`
   concurrent greedy requests whose KV outgrows the float32 cache; preemptions (Prometheus
   `coalesce_preemptions_total`), the KV dtype at the end, wall time, and how many output tokens agree.

The machine is shared: times are noisy.

    .venv/bin/python bench/kv_cache.py [--quick] [--model DIR] [--shape DIR ...] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script, the repo root is not on the path
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import free_port, serve  # noqa: E402
from bench.worker_step import bench_engine, prompts  # noqa: E402
from clients.aio import AsyncCoalesceClient  # noqa: E402
from clients.retry import NO_RETRY  # noqa: E402
from protos.coalesce.v1 import worker_pb2  # noqa: E402
from worker.builtin import BUILTIN_CONFIG  # noqa: E402
from worker.config import WorkerSettings  # noqa: E402
from worker.engine import Engine  # noqa: E402
from worker.kv_cache import TAIL_BLOCKS, block_bytes, blocks_for_budget, tail_blocks  # noqa: E402
from worker.model import ModelConfig  # noqa: E402
from worker.runner import ModelRunner  # noqa: E402

BLOCK_SIZE = 16
W = worker_pb2


# -- 1. capacity -------------------------------------------------------------------------------------------
def capacity(name: str, config: ModelConfig, mb: int, context: int) -> list[str]:
    per_seq = -(-context // BLOCK_SIZE)
    rows = [
        ("bfloat16", torch.bfloat16, "model"),
        ("float32", torch.float32, "model"),
        (f"int8 (+ a {TAIL_BLOCKS}-block tail per sequence)", torch.bfloat16, "int8"),
        ("auto, bfloat16 model, before converting", torch.bfloat16, "auto"),
        ("auto, float32 model, before converting", torch.float32, "auto"),
    ]
    seqs = {}
    out = []
    for label, dtype, kv in rows:
        blocks = blocks_for_budget(config, BLOCK_SIZE, dtype, mb * 2**20, kv)  # type: ignore[arg-type]
        units = torch.empty((), dtype=dtype).element_size() if kv == "auto" else 1
        bytes_per_token = block_bytes(config, BLOCK_SIZE, dtype, kv) * units / BLOCK_SIZE  # type: ignore[arg-type]
        tail = tail_blocks("int8", BLOCK_SIZE) if kv == "int8" else 0  # auto: none until it converts
        seqs[label] = n = blocks // units // (per_seq + tail)
        bf16, fp32 = seqs.get("bfloat16", n), seqs.get("float32", n)
        out.append(
            f"| {name} | {label} | {bytes_per_token / 1024:.1f} KiB | {blocks // units:,} | {n:,} "
            f"| {n / bf16:.2f}x | {n / fp32:.2f}x |"
        )
    return out


# -- 2. decode speed ---------------------------------------------------------------------------------------
def decode_speed(model: str, dtype: str, batch: int, context: int, steps: int, repeats: int) -> dict[str, float]:
    """Best decode tok/s of four engines: {model, int8} cache x {torch ops, the C++ kernels}."""
    need = batch * (-(-(context + steps + 1) // BLOCK_SIZE) + TAIL_BLOCKS)  # int8: tails too
    engines = {}
    for kernels in (False, True):
        for kv in ("model", "int8"):
            mb = -(-need * block_bytes(model_config(model), BLOCK_SIZE, getattr(torch, dtype), kv) // 2**20) + 1
            settings = WorkerSettings.model_validate(
                {"model": model, "device": "cpu", "dtype": dtype, "kv_cache_mb": mb, "kv_cache_dtype": kv}
                | {"cpu_kernels": kernels}
            )
            engines[f"{kv} {'kernels' if kernels else 'torch'}"] = Engine(ModelRunner.from_settings(settings))
    work = prompts(batch, context, engines["model torch"].vocab_size)
    best = {name: 0.0 for name in engines}
    for e in engines.values():
        bench_engine(e, prompts(2, 32, e.vocab_size), 2)  # warm-up
    for _ in range(repeats):
        for name, e in engines.items():
            best[name] = max(best[name], bench_engine(e, work, steps)[0])
    return best


def model_config(model: str) -> ModelConfig:
    hf = BUILTIN_CONFIG if model == "builtin" else json.loads((Path(model) / "config.json").read_text())
    return ModelConfig.from_hf(hf)


# -- 3. the converting step --------------------------------------------------------------------------------
def conversion(model: str, mb: int, dtype: str, n: int) -> list[str]:
    settings = WorkerSettings(model=model, device="cpu", dtype=dtype, kv_cache_mb=mb, kv_cache_dtype="auto")  # type: ignore[arg-type]
    engine = Engine(ModelRunner.from_settings(settings))
    info = engine.info()
    u, bs = info.kv_block_units, info.block_size
    per_seq_blocks = 8  # n sequences of 8 blocks; the conversion covers the whole arena whatever they hold
    n = min(n, info.num_blocks // u // per_seq_blocks)
    length = per_seq_blocks * bs - 8  # room for the five decodes below
    rng = random.Random(0)
    for lo in range(0, n, 8):  # prefill in groups, as a scheduler would
        seqs = []
        for i in range(lo, min(lo + 8, n)):
            table = [(i * per_seq_blocks + j) * u for j in range(per_seq_blocks)]
            tokens = [rng.randrange(min(engine.vocab_size, 256)) for _ in range(length)]
            seqs.append(
                W.SequenceWork(seq_id=i, token_ids=tokens, new_blocks=table, sampling=W.WorkerSampling(), sample=True)
            )
        engine.step(W.StepRequest(step_id=lo + 1, seqs=seqs))

    def decode(pos: int, convert: bool = False) -> float:
        seqs = [W.SequenceWork(seq_id=i, start_position=pos, sample=True) for i in range(n)]
        resp = engine.step(W.StepRequest(step_id=10_000 + pos, seqs=seqs, kv_to_int8=convert))
        return float(resp.step_ms)

    before = min(decode(length), decode(length + 1))
    converting = decode(length + 2, convert=True)
    after = min(decode(length + 3), decode(length + 4))
    converted_mb = mb  # the whole arena is converted, in use or not
    return [
        f"| {engine.runner.loaded.name} {dtype} | {mb} MiB, {info.num_blocks // u:,} blocks -> {info.num_blocks:,} "
        f"| {n} x {length + 3} tokens | {before:.1f} ms | {converting:.1f} ms | {after:.1f} ms "
        f"| {converting - before:.0f} ms ({(converting - before) / converted_mb:.2f} ms/MiB) |"
    ]


# -- 4. load -----------------------------------------------------------------------------------------------
def load_test(model: str | None, requests: int, prompt_len: int, max_tokens: int) -> tuple[list[str], list[str]]:
    config = model_config(model or "builtin")
    need = requests * -(-(prompt_len + max_tokens) // BLOCK_SIZE)
    mb = max(1, math.floor(0.7 / 0.95 * need * block_bytes(config, BLOCK_SIZE, torch.float32) / 2**20))
    rng = random.Random(1)
    vocab = min(config.vocab_size, 256)
    work = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(requests)]
    rows, outputs = [], {}
    for kv in ("model", "auto"):
        metrics_port = free_port()
        env = {
            "COALESCE_WORKER__KV_CACHE_DTYPE": kv,
            "COALESCE_WORKER__KV_CACHE_MB": str(mb),
            "COALESCE_WORKER__DTYPE": "float32",
            "COALESCE_WORKER__DEVICE": "cpu",
            "COALESCE_POOLS__INTERACTIVE__KV_SHARE": "0.95",  # the pools' shares add up to at most 1
            "COALESCE_POOLS__BATCH__KV_SHARE": "0.05",
        }
        with serve(model or "builtin", requests, metrics_port, env, dtype="float32") as address:
            wall, tokens, info = asyncio.run(_burst(address, work, max_tokens))
            metrics = _metrics(metrics_port)
        outputs[kv] = tokens
        preempted = sum(v for k, v in metrics.items() if k.startswith("coalesce_preemptions_total"))
        dtypes = [k.split('dtype="')[1].split('"')[0] for k in metrics if k.startswith("coalesce_kv_cache_dtype{")]
        shape = f"{requests} x ({prompt_len} + {max_tokens})"
        rows.append(f"| {info} | {mb} MiB | {shape} | {preempted:.0f} | {', '.join(dtypes)} | {wall:.2f} s |")
    pairs = list(zip(outputs["model"], outputs["auto"], strict=True))
    agree = sum(a == b for x, y in pairs for a, b in zip(x, y, strict=True))
    same = sum(x == y for x, y in pairs)
    total = requests * max_tokens
    summary = [
        f"Outputs of auto against float32: {agree}/{total} tokens agree ({agree / total * 100:.1f} %), "
        f"{same}/{requests} continuations identical."
    ]
    return rows, summary


async def _burst(address: str, work: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]], str]:
    async with AsyncCoalesceClient(address, retry=NO_RETRY) as client:
        info = await client.model_info()
        gens = [client.generate(p, max_tokens=max_tokens, ignore_eos=True, dedup="off").result() for p in work]
        t0 = time.perf_counter()
        results = await asyncio.gather(*gens)
        return time.perf_counter() - t0, [r.token_ids for r in results], f"{info.model} kv {info.kv_cache_dtype}"


def _metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a fast smoke run (small sizes)")
    parser.add_argument("--model", help="a Hugging Face checkpoint directory (default: the builtin model)")
    parser.add_argument("--shape", action="append", default=[], help="a checkpoint whose capacity to tabulate too")
    parser.add_argument("--kv-cache-mb", type=int, default=1024, help="capacity: the budget compared")
    parser.add_argument("--capacity-context", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, nargs="+", default=[256, 1024, 2000], help="decode: prompt lengths")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], help="decode: model dtypes")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--convert-mb", type=int, default=256, help="the auto cache converted (256: the CPU default)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--out", help="also write the report (markdown) to this file")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.context, args.steps, args.repeats, args.convert_mb, args.requests = 4, [64], 4, 1, 8, 8
    model = args.model or "builtin"
    threads = torch.get_num_threads()
    lines = [f"KV cache: int8 against the model's dtype ({threads} CPU threads; shared machine, noisy times)", ""]

    lines += [
        f"Capacity at kv_cache_mb={args.kv_cache_mb}, sequences of {args.capacity_context} tokens "
        f"(block size {BLOCK_SIZE}; int8 adds a one-byte scale per 32 values):",
        "",
        "| model | KV cache | per token | blocks | sequences | vs bfloat16 | vs float32 |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    lines += capacity("builtin", model_config("builtin"), args.kv_cache_mb, args.capacity_context)
    for shape in ([args.model] if args.model else []) + args.shape:
        lines += capacity(Path(shape).name, model_config(shape), args.kv_cache_mb, args.capacity_context)

    print("decode speed...", file=sys.stderr, flush=True)
    lines += [
        "",
        f"Decode, batch {args.batch}, {args.steps} steps, {model} on CPU (best of {args.repeats}, alternating):",
        "",
        "Kernels: decode attention of worker/kernels/paged_attention.cpp (the default on CPU); torch: "
        "`cpu_kernels=false`, gather + SDPA.",
        "",
        "| model dtype | prompt tokens | model-dtype cache tok/s (torch / kernels) | int8 cache tok/s "
        "(torch / kernels) | int8 / model dtype, kernels | kernels / torch, int8 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for dtype in args.dtype:
        for context in args.context:
            tps = decode_speed(model, dtype, args.batch, context, args.steps, args.repeats)
            lines.append(
                f"| {dtype} | {context:,} | {tps['model torch']:,.0f} / {tps['model kernels']:,.0f} "
                f"| {tps['int8 torch']:,.0f} / {tps['int8 kernels']:,.0f} "
                f"| {tps['int8 kernels'] / tps['model kernels']:.2f}x "
                f"| {tps['int8 kernels'] / tps['int8 torch']:.2f}x |"
            )

    print("conversion...", file=sys.stderr, flush=True)
    lines += [
        "",
        "The converting step (an auto cache full of running sequences; step_ms of one decode of all of them):",
        "",
        "| model | cache | sequences | decode before | converting decode | decode after | conversion cost |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    lines += conversion(model, args.convert_mb, "float32", args.batch)
    lines += conversion(model, args.convert_mb, "bfloat16", args.batch)

    print("load...", file=sys.stderr, flush=True)
    max_tokens = 32 if args.quick else 128
    rows, summary = load_test(args.model, args.requests, 64, max_tokens)
    lines += [
        "",
        f"Load: {args.requests} concurrent greedy requests on coalesce serve, float32 cache then auto, same budget "
        "(70 % of what the float32 cache would need):",
        "",
        "| served | kv_cache_mb | requests x (prompt + new) | preemptions | KV dtype at the end | wall |",
        "|---|---:|---|---:|---|---:|",
        *rows,
        "",
        *summary,
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
