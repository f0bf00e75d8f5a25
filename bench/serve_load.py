"""Load test of `coalesce serve`: Poisson arrivals of a mixed-length workload, against static batching.

One seeded workload (long-tailed prompt lengths and max_tokens, `ignore_eos` so every request generates
exactly its max_tokens) runs through four set-ups:

- Coalesce, Poisson arrivals at `--rate` req/s (open loop), streamed through the asyncio client;
- Coalesce, closed loop: `--concurrency` clients each sending the next request as soon as theirs ends;
- Coalesce, one at a time: the same server, one request in flight (concurrency 1);
- `transformers` static batching on the same weights and the same Poisson arrivals: batches of
  `--concurrency` left-padded prompts, greedy `generate` for the batch's largest max_tokens.

Definitions (all client-observed, milliseconds):
- TTFT: from sending the request to receiving its first token. "minus queue" subtracts the first chunk's
  `queue_ms`, the server's batch-buffer dwell, leaving prefill + RPC time.
- ITL: each gap between consecutive chunks divided by the tokens in the later chunk, one sample per token
  (so a chunk that coalesces several tokens weighs as many tokens, at their average spacing).
- e2e: from sending to receiving the last token. tokens/s: generated tokens / (last finish - first send).

Static-batching policy (one `generate` at a time, replayed on a virtual clock, see `run_static`): an idle
engine starts a batch when `--concurrency` requests are waiting, or at once when it has just finished a
batch and requests are waiting (a backlog), or when the trace has no more arrivals to wait for. A batch takes
at most `--concurrency` waiting requests in arrival order. Each request's e2e is its batch's finish minus its
arrival; its tokens count only up to its own max_tokens (padding and the batch's extra steps are waste).

Control-plane overhead: the server's Prometheus counters are scraped around each Coalesce run;
overhead = 1 - d(coalesce_step_forward_seconds_total) / d(coalesce_step_loop_seconds_total).

Tracing cost: the closed loop runs again on fresh servers with tracing off and on (OTLP export to a local
receiver that counts spans), alternating off/on three times so drift hits both alike.

    .venv/bin/python bench/serve_load.py [--quick] [--requests N] [--rate R] [--model builtin|smollm2|FILE.gguf|DIR]
        [--dtype auto|float32|bfloat16] [--weights dense|int8|int4|auto] [--out FILE.md]

`--llama-server` (a GGUF model) runs only the closed loop: `coalesce serve` against llama.cpp's `llama-server`
(`--concurrency` slots, continuous batching, the same thread count; built by bench/llama_cpp.py), each
request through its OpenAI-compatible /v1/completions as token ids, greedy, ignore_eos, non-streamed.

Both sides run the same weights in the same dtype (`auto` resolves as the worker does: bfloat16 on CPUs with
native bfloat16 matmuls, else float32); a GGUF model is loaded by transformers' own GGUF loader.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import os
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script (`python bench/serve_load.py`), the repo root is not on the path
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from bench.common import free_port, overhead, percentile, scrape, serve  # noqa: E402
from bench.hf_reference import load_reference  # noqa: E402
from bench.tracing_sink import otlp_sink  # noqa: E402
from clients.aio import AsyncCoalesceClient  # noqa: E402
from clients.retry import NO_RETRY  # noqa: E402
from worker.builtin import BUILTIN_CONFIG, random_state  # noqa: E402
from worker.device import resolve_dtype  # noqa: E402
from worker.model import ModelConfig  # noqa: E402

# Measured on 2 CPU cores with the builtin model: the closed loop at 32 does 22-27 req/s of this workload
# (1,000-1,300 tok/s), so 16 req/s (~750 tok/s offered) keeps the server busy without an ever-growing queue.
DEFAULT_RATE = 16.0
PROMPT_IDS = 256  # prompts are random ids below this: valid in every model's vocabulary


@dataclass(frozen=True, slots=True)
class Request:
    prompt: list[int]
    max_tokens: int
    arrival: float  # seconds after the start of the Poisson trace


@dataclass(slots=True)
class Timing:
    """One request's client-observed times, in seconds on one clock."""

    sent: float
    first: float = math.nan
    finish: float = math.nan
    queue_s: float = 0.0
    tokens: int = 0
    itl: list[float] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # the tokens received (greedy agreement with peers)


@dataclass(slots=True)
class Row:
    name: str
    timings: list[Timing]
    span_s: float  # first send to last finish
    has_queue: bool  # whether TTFT minus queue is known
    overhead: str = "n/a"
    busy_tok_s: float | None = None  # static batching only: tokens per second of generate time

    @property
    def tok_s(self) -> float:
        return sum(t.tokens for t in self.timings) / self.span_s


def make_workload(n: int, rate: float, seed: int, quick: bool) -> list[Request]:
    """Log-normal prompt lengths (median 64, clipped to 16..512) and max_tokens (median 40, 16..128):
    most requests are short, a few are long, as in chat traffic. Poisson arrivals at `rate`."""
    rng = random.Random(seed)
    hi_prompt, lo_new, hi_new = (128, 8, 32) if quick else (512, 16, 128)
    out, clock = [], 0.0
    for _ in range(n):
        clock += rng.expovariate(rate)
        length = min(hi_prompt, max(16, round(rng.lognormvariate(math.log(64), 0.9))))
        new = min(hi_new, max(lo_new, round(rng.lognormvariate(math.log(40), 0.7))))
        out.append(Request([rng.randrange(PROMPT_IDS) for _ in range(length)], new, clock))
    return out


# --- Coalesce runs ------------------------------------------------------------------------------------


async def stream_one(client: AsyncCoalesceClient, req: Request, t0: float) -> Timing:
    timing = Timing(sent=time.perf_counter() - t0)
    last = timing.sent
    gen = client.generate(req.prompt, max_tokens=req.max_tokens, ignore_eos=True, dedup="off")
    async for chunk in gen:
        now = time.perf_counter() - t0
        if not chunk.token_ids:
            continue
        if timing.tokens == 0:
            timing.first, timing.queue_s = now, chunk.queue_ms / 1000
        else:
            n = len(chunk.token_ids)
            timing.itl += [(now - last) / n] * n
        timing.tokens += len(chunk.token_ids)
        timing.ids += chunk.token_ids
        last = now
    timing.finish = last
    if timing.tokens != req.max_tokens:
        raise RuntimeError(f"asked for {req.max_tokens} tokens with ignore_eos, got {timing.tokens}")
    return timing


async def run_poisson(address: str, work: list[Request]) -> list[Timing]:
    """Open loop: each request is sent at its arrival time, whatever is still running."""
    async with AsyncCoalesceClient(address, retry=NO_RETRY) as client:
        t0 = time.perf_counter()

        async def at_arrival(req: Request) -> Timing:
            await asyncio.sleep(max(0.0, req.arrival - (time.perf_counter() - t0)))
            return await stream_one(client, req, t0)

        return list(await asyncio.gather(*(at_arrival(r) for r in work)))


async def run_closed(address: str, work: list[Request], concurrency: int) -> list[Timing]:
    """Closed loop: `concurrency` clients, each sends the next request of the workload when its own ends."""
    async with AsyncCoalesceClient(address, retry=NO_RETRY) as client:
        t0, todo, out = time.perf_counter(), deque(enumerate(work)), [Timing(0.0)] * len(work)

        async def loop() -> None:
            while todo:
                i, req = todo.popleft()
                out[i] = await stream_one(client, req, t0)

        await asyncio.gather(*(loop() for _ in range(concurrency)))
        return out


def coalesce_row(name: str, timings: list[Timing], port: int, before: dict[str, float] | None) -> Row:
    frac = overhead(before, scrape(port))
    span = max(t.finish for t in timings) - min(t.sent for t in timings)
    return Row(name, timings, span, True, "n/a" if frac is None else f"{frac:.1%}")


def run_coalesce(args: argparse.Namespace, work: list[Request]) -> tuple[list[Row], bool]:
    """The three Coalesce set-ups on one server; also whether the metrics endpoint answered."""
    port = free_port()
    env = {"COALESCE_WORKER__WEIGHTS": args.weights}
    with serve(args.model, args.concurrency, port, env, args.dtype) as address:
        # Warm-up: the first steps pay for allocations and lazy init in the worker.
        asyncio.run(run_closed(address, work[: min(8, len(work))], 8))
        rows = []
        for name, run in (
            (f"Coalesce, Poisson {args.rate:g} req/s", lambda: run_poisson(address, work)),
            (f"Coalesce, closed loop x{args.concurrency}", lambda: run_closed(address, work, args.concurrency)),
            ("Coalesce, one at a time", lambda: run_closed(address, work, 1)),
        ):
            before = scrape(port)
            rows.append(coalesce_row(name, asyncio.run(run()), port, before))
            print(f"  {name}: {rows[-1].tok_s:,.0f} tok/s", file=sys.stderr)
        return rows, scrape(port) is not None


def run_vs_llama_server(args: argparse.Namespace, work: list[Request]) -> list[str]:
    """Closed-loop tok/s of `coalesce serve` and of `llama-server` on the same workload and GGUF file."""
    from bench.llama_cpp import closed_loop, llama_server
    from bench.worker_step import gguf_file

    env = {"COALESCE_WORKER__WEIGHTS": args.weights}
    with serve(args.model, args.concurrency, free_port(), env, args.dtype) as address:
        asyncio.run(run_closed(address, work[: min(8, len(work))], 8))  # warm-up
        timings = asyncio.run(run_closed(address, work, args.concurrency))
    ours = coalesce_row("coalesce serve", timings, 0, None)
    print(f"  coalesce serve: {ours.tok_s:,.0f} tok/s", file=sys.stderr)
    slot_ctx = max(len(r.prompt) + r.max_tokens for r in work) + 16
    pairs = [(r.prompt, r.max_tokens) for r in work]
    with llama_server(gguf_file(args.model), args.concurrency, slot_ctx, torch.get_num_threads(), free_port()) as url:
        closed_loop(url, pairs[: min(8, len(pairs))], 8)  # warm-up
        span, tokens, e2e = closed_loop(url, pairs, args.concurrency)
    print(f"  llama-server: {tokens / span:,.0f} tok/s", file=sys.stderr)
    ours_e2e = [t.finish - t.sent for t in timings]
    return [
        f"| closed loop x{args.concurrency}, {len(work)} requests | tok/s | e2e p50 | e2e p99 |",
        "|---|---:|---:|---:|",
        f"| coalesce serve (--weights {args.weights}) | {ours.tok_s:,.0f} | {ms(percentile(ours_e2e, 50))} "
        f"| {ms(percentile(ours_e2e, 99))} |",
        f"| llama-server ({args.concurrency} slots) | {tokens / span:,.0f} | {ms(percentile(e2e, 50))} "
        f"| {ms(percentile(e2e, 99))} |",
        f"| coalesce / llama-server | {ours.tok_s / (tokens / span):.2f}x | | |",
    ]


def tracing_runs(args: argparse.Namespace, work: list[Request]) -> tuple[dict[str, list[float]], int]:
    """Closed-loop tok/s of each run with tracing off and on (exported over OTLP to a local receiver), and the
    spans received."""
    with otlp_sink() as (endpoint, sink):
        tracing_on = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "500"}
        results: dict[str, list[float]] = {"off": [], "on": []}
        for label in ("off", "on") * (1 if args.quick else 3):
            env = tracing_on if label == "on" else {}
            with serve(args.model, args.concurrency, free_port(), env, args.dtype) as address:
                asyncio.run(run_closed(address, work[: min(8, len(work))], 8))  # warm-up
                timings = asyncio.run(run_closed(address, work, args.concurrency))
                span = max(t.finish for t in timings) - min(t.sent for t in timings)
                results[label].append(sum(t.tokens for t in timings) / span)
            print(f"  tracing {label}: {results[label][-1]:,.0f} tok/s", file=sys.stderr)
    return results, sink.spans


def run_tracing(args: argparse.Namespace, work: list[Request]) -> list[str]:
    """Closed-loop tok/s with tracing off vs on, as a table."""
    results, spans = tracing_runs(args, work)
    off, on = (sum(results[k]) / len(results[k]) for k in ("off", "on"))
    runs = ", ".join(f"{x:,.0f}" for x in results["off"]), ", ".join(f"{x:,.0f}" for x in results["on"])
    return [
        f"| tracing (closed loop x{args.concurrency}) | tok/s (runs) | mean tok/s |",
        "|---|---:|---:|",
        f"| off | {runs[0]} | {off:,.0f} |",
        f"| on, OTLP export ({spans:,} spans received) | {runs[1]} | {on:,.0f} |",
        f"| on / off | | {on / off:.3f}x |",
    ]


# --- transformers static batching ---------------------------------------------------------------------


def hf_from_builtin() -> torch.nn.Module:
    """A transformers LlamaForCausalLM holding the builtin model's weights (seed 0, as `coalesce serve` builds
    them): our fused q/k/v and gate/up tensors split back into Hugging Face names."""
    config = ModelConfig.from_hf(BUILTIN_CONFIG)
    ours = random_state(config, seed=0)
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hf = {"model.embed_tokens.weight": ours["embed.weight"], "model.norm.weight": ours["norm.weight"]}
    for i in range(config.num_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        hf[dst + "input_layernorm.weight"] = ours[src + "attn_norm.weight"]
        hf[dst + "post_attention_layernorm.weight"] = ours[src + "mlp_norm.weight"]
        for part, tensor in zip("qkv", ours[src + "attn.qkv.weight"].split([q, kv, kv]), strict=True):
            hf[dst + f"self_attn.{part}_proj.weight"] = tensor
        hf[dst + "self_attn.o_proj.weight"] = ours[src + "attn.o.weight"]
        gate, up = ours[src + "mlp.gate_up.weight"].chunk(2)
        hf[dst + "mlp.gate_proj.weight"], hf[dst + "mlp.up_proj.weight"] = gate, up
        hf[dst + "mlp.down_proj.weight"] = ours[src + "mlp.down.weight"]
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in BUILTIN_CONFIG.items() if k != "architectures"}))
    model.load_state_dict(hf, strict=False)  # lm_head is tied to the embedding
    return model


class TokenClock(BaseStreamer):
    """Timestamps each step of `generate`: put() gets the prompt first, then each new token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@torch.inference_mode()
def generate_batch(model: torch.nn.Module, batch: list[Request]) -> tuple[float, list[float], list[list[int]]]:
    """Run one padded batch; its duration, each new token's time after the start, and each row's new tokens."""
    width, new = max(len(r.prompt) for r in batch), max(r.max_tokens for r in batch)
    ids = torch.tensor([[0] * (width - len(r.prompt)) + r.prompt for r in batch])  # left padding
    mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch])
    clock = TokenClock()
    start = time.perf_counter()
    out = model.generate(  # type: ignore[operator]
        ids, attention_mask=mask, do_sample=False, max_new_tokens=new, min_new_tokens=new,
        pad_token_id=0, eos_token_id=None, streamer=clock,
    )  # fmt: skip
    return time.perf_counter() - start, [t - start for t in clock.times[1:]], out[:, width:].tolist()


def run_static(model: torch.nn.Module, work: list[Request], size: int) -> Row:
    """Replay the Poisson trace on a virtual clock: batches run for real, one at a time, and each starts at
    the time the policy (module docstring) says. Waiting is computed rather than slept, so the idle gaps cost
    no wall time; the engine is never slowed by anything else, which only flatters this baseline."""
    pending, free_at, busy, timings = deque(work), 0.0, 0.0, list[Timing]()
    while pending:
        if pending[0].arrival <= free_at and timings:  # a backlog when the previous batch finished
            start = free_at
        else:  # idle: wait for a full batch, or for the last arrival if fewer remain
            start = max(free_at, pending[min(size, len(pending)) - 1].arrival)
        batch: list[Request] = []
        while pending and pending[0].arrival <= start and len(batch) < size:
            batch.append(pending.popleft())
        took, token_times, ids = generate_batch(model, batch)
        busy, free_at = busy + took, start + took
        for req, row_ids in zip(batch, ids, strict=True):
            own = token_times[: req.max_tokens]
            gaps = [b - a for a, b in itertools.pairwise(own)]
            timings.append(
                Timing(req.arrival, start + own[0], free_at, 0.0, req.max_tokens, gaps, row_ids[: req.max_tokens])
            )
    row = Row(f"transformers static x{size}, Poisson", timings, free_at - work[0].arrival, False)
    row.busy_tok_s = sum(r.max_tokens for r in work) / busy
    return row


def load_hf(model: str, dtype: torch.dtype) -> torch.nn.Module:
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    if model == "builtin":
        return hf_from_builtin().to(dtype).eval()
    return load_reference(model, dtype)


# --- report -------------------------------------------------------------------------------------------


def ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1000:,.0f}"


def table(rows: list[Row]) -> list[str]:
    out = [
        "| system | tok/s | TTFT p50 | TTFT p99 | TTFT−queue p50 | TTFT−queue p99 | ITL p50 | ITL p99 "
        "| e2e p50 | e2e p99 | overhead |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        ts = row.timings
        ttft = [t.first - t.sent for t in ts]
        noq = [t.first - t.sent - t.queue_s for t in ts] if row.has_queue else []
        itl = [g for t in ts for g in t.itl]
        e2e = [t.finish - t.sent for t in ts]
        tok = f"{row.tok_s:,.0f}" + (f" ({row.busy_tok_s:,.0f} busy)" if row.busy_tok_s else "")
        cells = [ms(percentile(xs, q)) for xs in (ttft, noq, itl, e2e) for q in (50, 99)]
        out.append(f"| {row.name} | {tok} | " + " | ".join(cells) + f" | {row.overhead} |")
    return out


def targets(poisson: Row, closed: Row, single: Row, static: Row) -> list[str]:
    def check(ok: bool) -> str:
        return "PASS" if ok else "MISS"

    vs_single = closed.tok_s / single.tok_s
    assert static.busy_tok_s is not None
    vs_static = closed.tok_s / static.busy_tok_s
    p99 = percentile([t.finish - t.sent for t in poisson.timings], 99)
    p99_ratio = p99 / percentile([t.finish - t.sent for t in static.timings], 99)
    out = [
        "| target | measured | goal | result |",
        "|---|---:|---:|---|",
        f"| tok/s, {closed.name} / one at a time | {vs_single:.1f}x | >= 8x | {check(vs_single >= 8)} |",
        f"| tok/s, {closed.name} / transformers static (busy) | {vs_static:.2f}x | >= 2x | {check(vs_static >= 2)} |",
        f"| p99 e2e, Coalesce / transformers static (same Poisson arrivals) | {p99_ratio:.2f}x | <= 0.5x "
        f"| {check(p99_ratio <= 0.5)} |",
    ]
    if poisson.overhead == "n/a":
        out.append("| control-plane overhead (Poisson run) | n/a | <= 5% | n/a |")
    else:
        frac = float(poisson.overhead.rstrip("%")) / 100
        out.append(f"| control-plane overhead (Poisson run) | {poisson.overhead} | <= 5% | {check(frac <= 0.05)} |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=128, help="requests in the workload (default 128)")
    parser.add_argument("--rate", type=float, default=DEFAULT_RATE, help=f"Poisson req/s (default {DEFAULT_RATE})")
    parser.add_argument("--concurrency", type=int, default=32, help="closed-loop clients, max batch, static batch")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--quick", action="store_true", help="a small smoke run (< 60 s)")
    parser.add_argument(
        "--model", default="builtin", help="builtin (default), smollm2, a .gguf file or a checkpoint dir"
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="both sides' dtype")
    parser.add_argument("--weights", default="dense", choices=["auto", "dense", "int8", "int4"], help="Coalesce's")
    parser.add_argument("--llama-server", action="store_true", help="only the closed loop, against llama-server")
    parser.add_argument("--out", help="also write the report (markdown) to this file")
    args = parser.parse_args()
    if args.quick:
        args.requests = min(args.requests, 16)
    if args.llama_server:
        load_before = os.getloadavg()[0]
        dtype = resolve_dtype(args.dtype, torch.device("cpu"))
        lines = run_vs_llama_server(args, make_workload(args.requests, args.rate, args.seed, args.quick))
        head = f"# model {args.model}, {str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} CPU threads"
        load = f"1-minute load average {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
        text = "\n".join([head, "", *lines, "", load])
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
        return

    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    work = make_workload(args.requests, args.rate, args.seed, args.quick)
    tokens = sum(r.max_tokens for r in work)
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    print(f"workload: {len(work)} requests, {tokens} tokens to generate; running Coalesce...", file=sys.stderr)
    rows, metrics_up = run_coalesce(args, work)
    print("comparing tracing off and on...", file=sys.stderr)
    tracing = run_tracing(args, work)
    print("running transformers static batching...", file=sys.stderr)
    rows.append(run_static(load_hf(args.model, dtype), work, args.concurrency))

    lengths = sorted(len(r.prompt) for r in work)
    news = sorted(r.max_tokens for r in work)
    report = [
        f"# coalesce serve under load: model {args.model}, {str(dtype).removeprefix('torch.')}, "
        f"{torch.get_num_threads()} CPU threads",
        "",
        f"Workload (seed {args.seed}): {len(work)} requests, prompts {lengths[0]}..{lengths[-1]} tokens "
        f"(median {lengths[len(lengths) // 2]}), max_tokens {news[0]}..{news[-1]} (median {news[len(news) // 2]}), "
        f"{tokens} tokens to generate, ignore_eos; Poisson arrivals at {args.rate:g} req/s.",
        "Times in ms. TTFT−queue subtracts the server-reported batch-buffer dwell. ITL: chunk gap / tokens in "
        "chunk, per token. Static batching's tok/s in brackets: per second of generate time (its capacity).",
        "",
        *table(rows),
        "",
        *targets(*rows),
        "",
        *tracing,
        "",
    ]
    if not metrics_up:
        report += ["overhead: n/a (metrics endpoint not available)", ""]
    offered, static = tokens / work[-1].arrival, rows[-1].busy_tok_s or math.inf
    if offered > static:  # then its queue, and so its p99, grows with --requests: say so next to the ratio
        report += [
            f"Note: the Poisson trace offers {offered:,.0f} tok/s, more than static batching's capacity "
            f"({static:,.0f} tok/s): its queue grows through the run. A lower --rate compares both unsaturated.",
            "",
        ]
    # Other processes on the machine skew every figure (2 torch threads stall when one core is taken away).
    load = f"{load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    report.append(f"Total bench time {time.perf_counter() - started:.0f} s; 1-minute load average {load}.")
    text = "\n".join(report)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
