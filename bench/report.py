"""One report: every trade-off the design claims, measured in one run, against `transformers` peers on the
same weights, dtype and requests. Writes DIR/report.md and PNG figures (bench/README.md explains each number).

    coalesce bench report [--quick] [--model builtin|smollm2|FILE.gguf|DIR] [--dtype auto|float32|bfloat16] --out DIR

What runs, in order (a `rich` progress bar counts the stages):
1. `coalesce serve` with the default settings (interactive pool max batch 32, max_wait_ms 30): closed loops at
   32 and 1 concurrent, streamed and not; Poisson load at fractions of the closed-loop capacity (KV blocks and
   batch size sampled during the highest); the bimodal workload; long prompts arriving among running streams.
2. One server per other interactive `max_wait_ms` (0, 10, 100, 300): the same Poisson load; on the 0 ms
   server, TTFT of a prompt whose 1,024-token prefix is cached vs cold.
3. The bimodal workload with the prefill length-ratio rule off (`prefill_ratio` 1e6), and the long prompts
   with chunked prefill off (`max_step_tokens` above the longest step), each on its own server.
4. The peers at each offered load (bench/peers.py); greedy agreement with Coalesce on the same requests.
5. bench/dedup.py's bursts (64 identical vs 64 distinct) and its replay latency through redis-server.
6. bench/serve_load.py's tracing off vs on (OTLP export to a local receiver).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script, the repo root is not on the path
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: E402

from bench import dedup, trials  # noqa: E402
from bench.common import bench_token, free_port, percentile, serve  # noqa: E402
from bench.machine import Machine, load_average  # noqa: E402
from bench.peers import agreement, continuous_peer, reschedule_single, static  # noqa: E402
from bench.report_md import write  # noqa: E402
from bench.serve_load import Request, Row, load_hf, make_workload, run_closed, run_poisson, tracing_runs  # noqa: E402
from worker.device import resolve_dtype  # noqa: E402

SWEEP_MS = (0, 10, 30, 100, 300)
DEFAULT_WAIT = 30  # the interactive pool's default (control_plane/config.py)
BATCH = 32
# Why the steps ratio cannot reach 1/50: the distinct burst decodes as one batch too, one step per token.
STEPS_NOTE = "distinct requests decode together, one step per token: identical ones save prefill steps only"


@dataclass(frozen=True, slots=True)
class Plan:
    requests: int  # the mixed Poisson workload (bench/serve_load.py's make_workload)
    short_workload: bool  # make_workload's quick shape (prompts <= 128, max_tokens <= 32)
    loads: tuple[float, ...]  # offered loads, as fractions of the closed-loop x32 capacity (req/s)
    sweep_load: float  # the load of the max_wait_ms sweep (one of `loads`)
    sweep_ms: tuple[int, ...]
    prefix_n: int
    bimodal: tuple[int, int, int, int]  # requests, short prompt, long prompt, max_tokens
    interference: tuple[int, int, int, float]  # running streams, long prompt, long prompts, gap s
    dedup: tuple[int, int, int, int]  # requests, prompt tokens, max tokens, replays
    tracing_quick: bool  # one off/on pair instead of three
    closed_reps: int  # the closed loops run the workload this many times over


PLANS = {
    "full": Plan(requests=48, short_workload=False, loads=(0.25, 0.5, 0.75, 1.0), sweep_load=0.75, sweep_ms=SWEEP_MS,
                 prefix_n=8, bimodal=(32, 16, 768, 32), interference=(8, 1536, 4, 0.5), dedup=(64, 64, 64, 500),
                 tracing_quick=False, closed_reps=1),
    "quick": Plan(requests=64, short_workload=True, loads=(0.5, 1.0), sweep_load=1.0, sweep_ms=SWEEP_MS, prefix_n=4,
                  bimodal=(32, 16, 512, 16), interference=(4, 1024, 3, 0.3), dedup=(64, 32, 16, 100),
                  tracing_quick=False, closed_reps=3),
    # The test suite's smoke run: every section, each as small as still means something to the code.
    "tiny": Plan(requests=8, short_workload=True, loads=(1.0,), sweep_load=1.0, sweep_ms=(0, DEFAULT_WAIT),
                 prefix_n=1, bimodal=(4, 16, 128, 4), interference=(2, 256, 1, 0.1), dedup=(4, 16, 4, 5),
                 tracing_quick=True, closed_reps=1),
}  # fmt: skip


@dataclass(slots=True)
class Ratio:
    name: str
    measured: float
    goal: str  # e.g. ">= 8"
    fmt: str = "{:.2f}"
    note: str = ""

    @property
    def met(self) -> str:
        if not self.goal or math.isnan(self.measured):
            return "-"
        op, value = self.goal.split()
        return "met" if (self.measured >= float(value) if op == ">=" else self.measured <= float(value)) else "not met"


def at_rate(work: list[Request], rate: float) -> list[Request]:
    """The workload's arrivals (made at 1 req/s) scaled to `rate` req/s."""
    return [replace(r, arrival=r.arrival / rate) for r in work]


def coalesce_row(name: str, timings: list[Any]) -> Row:
    span = max(t.finish for t in timings) - min(t.sent for t in timings)
    return Row(name, timings, span, True)


class Runner:
    """Holds what the stages measure; each stage is one method, run under the progress bar."""

    def __init__(self, args: argparse.Namespace, plan: Plan) -> None:
        self.args, self.plan = args, plan
        self.dtype = resolve_dtype(args.dtype, torch.device("cpu"))
        self.dtype_name = str(self.dtype).removeprefix("torch.")
        self.work = make_workload(plan.requests, 1.0, args.seed, plan.short_workload)
        self.tokens = sum(r.max_tokens for r in self.work)
        self.ratios: list[Ratio] = []
        self.sections: list[list[str]] = []
        self.rows: dict[float, list[Row]] = {}  # offered load fraction -> rows of every system
        self.offered: dict[float, float] = {}  # fraction -> offered tok/s
        self.gauges: list[tuple[float, float, float]] = []
        self.sweep: list[tuple[float, float, float, float, float]] = []  # wait, tok/s, ttft p50, p99, tok/step
        self.capacity_req_s = 0.0
        self.bimodal_rows: dict[str, Row] = {}
        self.interference: dict[str, trials.Interference] = {}
        self.bimodal_reqs: list[Request] = []
        self.stage_s: list[tuple[str, float]] = []  # (stage, seconds it took)

    @contextmanager
    def serve(self, env: dict[str, str] | None = None) -> Iterator[str]:
        """A `coalesce serve` with `env`'s settings, warmed up (8 requests), its address yielded."""
        self.metrics_port = free_port()
        with serve(self.args.model, BATCH, self.metrics_port, env, self.dtype_name) as address:
            asyncio.run(run_closed(address, self.work[:8], 8))
            yield address

    def bimodal_work(self) -> list[Request]:
        n, short, long, new = self.plan.bimodal
        # Offered at ~the closed-loop capacity in requests (long prompts make it heavier): the rule matters
        # when prefills queue up together.
        return trials.bimodal(n, max(self.capacity_req_s, 0.5), short, long, new)

    # -- stage 1 ------------------------------------------------------------------------------------------
    def default_server(self, step: Callable[[str], None]) -> None:
        plan = self.plan
        with self.serve() as address:
            step("closed loops")
            # Repeated so that each run lasts seconds; streamed and not alternate, so drift hits both alike.
            work = self.work * plan.closed_reps
            closed, unary = [], []
            for _ in range(2):
                closed.append(asyncio.run(run_closed(address, work, BATCH)))
                unary.append(asyncio.run(trials.run_closed_unary(address, work, BATCH)))
            single = asyncio.run(run_closed(address, work, 1))
            c_tok, u_tok = (sum(map(trials.tok_s, runs)) / len(runs) for runs in (closed, unary))
            s_tok = trials.tok_s(single)
            self.capacity_req_s = c_tok / (self.tokens / len(self.work))
            self.bimodal_reqs = self.bimodal_work()
            self.ratios.append(Ratio(f"tok/s, closed loop x{BATCH} / one at a time", c_tok / s_tok, ">= 8",
                                     "{:.1f}x", f"{c_tok:,.0f} / {s_tok:,.0f} tok/s"))  # fmt: skip
            self.ratios.append(Ratio(f"tok/s, streamed / not streamed (closed loop x{BATCH})", c_tok / u_tok, ">= 0.95",
                                     "{:.3f}", f"{c_tok:,.0f} / {u_tok:,.0f} tok/s"))  # fmt: skip
            self.closed_rows = [coalesce_row(f"Coalesce, closed loop x{BATCH}", closed[-1]),
                                coalesce_row(f"Coalesce, closed loop x{BATCH}, not streamed", unary[-1]),
                                coalesce_row("Coalesce, one at a time", single)]  # fmt: skip
            for frac in plan.loads:
                step(f"Coalesce at {frac:.0%} load")
                work = at_rate(self.work, frac * self.capacity_req_s)
                self.offered[frac] = self.tokens / work[-1].arrival
                before = trials.steps_and_tokens(self.metrics_port)
                if frac == max(plan.loads):
                    with trials.Gauges(self.metrics_port) as g:
                        timings = asyncio.run(run_poisson(address, work))
                    self.gauges = g.samples
                else:
                    timings = asyncio.run(run_poisson(address, work))
                row = coalesce_row(f"Coalesce, {frac:.0%} load", timings)
                self.rows[frac] = [row]
                if frac == plan.sweep_load:
                    self.sweep_point(DEFAULT_WAIT, row, before)
            step("bimodal, ratio rule on")
            self.bimodal_rows["on"] = coalesce_row("on", asyncio.run(run_poisson(address, self.bimodal_reqs)))
            step("long prompts, chunked prefill on")
            streams, long_len, longs, gap = plan.interference
            self.interference["on"] = asyncio.run(trials.interference(address, streams, long_len, longs, gap))

    def sweep_point(self, wait: float, row: Row, before: tuple[float, float]) -> None:
        steps = trials.steps_and_tokens(self.metrics_port)[0] - before[0]
        ttft = [(t.first - t.sent) * 1000 for t in row.timings]
        tokens = sum(t.tokens for t in row.timings)
        self.sweep.append((wait, row.tok_s, percentile(ttft, 50), percentile(ttft, 99), tokens / steps))

    # -- stage 2 ------------------------------------------------------------------------------------------
    def max_wait_server(self, wait: int, step: Callable[[str], None]) -> None:
        env = {"COALESCE_POOLS__INTERACTIVE__MAX_WAIT_MS": str(wait)}
        with self.serve(env) as address:
            work = at_rate(self.work, self.plan.sweep_load * self.capacity_req_s)
            before = trials.steps_and_tokens(self.metrics_port)
            self.sweep_point(wait, coalesce_row("sweep", asyncio.run(run_poisson(address, work))), before)
            if wait == 0:
                step("shared 1,024-token prefix")
                self.prefix = asyncio.run(trials.prefix_ttft(address, 1024, self.plan.prefix_n))
                noq = self.prefix.ratio(minus_queue=True)
                self.ratios.append(Ratio("TTFT, 1,024-token prefix cached / cold (p50)", self.prefix.ratio(), "<= 0.1",
                                         "{:.3f}", f"minus queue: {noq:.3f}"))  # fmt: skip

    # -- stage 3 ------------------------------------------------------------------------------------------
    def rule_off(self) -> None:
        with self.serve({"COALESCE_SCHEDULER__PREFILL_RATIO": "1000000"}) as address:
            self.bimodal_rows["off"] = coalesce_row("off", asyncio.run(run_poisson(address, self.bimodal_reqs)))
        on, off = self.bimodal_rows["on"], self.bimodal_rows["off"]
        self.ratios.append(
            Ratio(
                "tok/s, bimodal workload, length-ratio rule on / off",
                on.tok_s / off.tok_s,
                ">= 1.2",
                "{:.2f}",
                f"{on.tok_s:,.0f} / {off.tok_s:,.0f} tok/s (seed: +20-40 %)",
            )
        )

    def chunking_off(self) -> None:
        streams, long_len, longs, gap = self.plan.interference
        big = str(4 * (long_len + BATCH))  # a long prompt always fits one step: no chunking
        with self.serve({"COALESCE_SCHEDULER__MAX_STEP_TOKENS": big}) as address:
            self.interference["off"] = asyncio.run(trials.interference(address, streams, long_len, longs, gap))
        on, off = self.interference["on"], self.interference["off"]
        self.ratios.append(
            Ratio(
                "ITL p99 of running streams, chunked prefill on / off",
                on.p99_ms / off.p99_ms,
                "",
                "{:.2f}",
                f"{on.p99_ms:,.1f} / {off.p99_ms:,.1f} ms, long prompts arriving",
            )
        )

    # -- stage 4 ------------------------------------------------------------------------------------------
    def peers(self, step: Callable[[str], None]) -> None:
        model = load_hf(self.args.model, self.dtype)
        single = None
        with continuous_peer(model, self.work[:8], self.work) as cb:
            for frac in self.plan.loads:
                step(f"peers at {frac:.0%} load")
                work = at_rate(self.work, frac * self.capacity_req_s)
                rows = self.rows[frac]
                rows.append(cb.run(work, f"transformers continuous batching, {frac:.0%} load"))
                rows.append(static(model, work, BATCH))
                # One at a time: each generate is the same whatever the arrivals, so it runs once and is
                # replayed on the virtual clock for the other loads.
                single = static(model, work, 1) if single is None else reschedule_single(single, work)
                rows.append(single)
        self.agreement = {row.name.split(",")[0]: agreement(self.rows[self.plan.loads[0]][0].timings, row.timings)
                          for row in self.rows[self.plan.loads[0]][1:]}  # fmt: skip

    # -- stage 5, 6 ---------------------------------------------------------------------------------------
    def dedup(self) -> None:
        n, prompt, new, replays = self.plan.dedup
        flags = ("--model", self.args.model, "--dtype", self.dtype_name)
        kv = dedup.KV_CACHE_MB if self.args.model == "builtin" else "768"  # 64 x 128 tokens of SmolLM2: ~380 MiB
        self.bursts = dedup.part1(n, prompt, new, flags, kv)
        self.replay = dedup.part2(replays, max(5, replays // 5), prompt, new, flags)
        distinct, same = self.bursts[0], self.bursts[1]
        replay = self.replay.replay_ms
        self.ratios.append(Ratio("replay of a finished key through Redis, p50 ms", percentile(replay, 50), "", "{:.2f}",
                                 f"p99 {percentile(replay, 99):.2f} ms, {len(replay)} sequential replays"))  # fmt: skip
        self.ratios.append(Ratio(f"worker steps, {n} identical / {n} distinct", same.steps / distinct.steps,
                                 f"<= {1 / 50:.3f}", "{:.3f}", STEPS_NOTE))  # fmt: skip
        self.ratios.append(Ratio(f"tokens computed, {n} identical / {n} distinct", same.tokens / distinct.tokens,
                                 f"<= {1 / 50:.3f}", "{:.3f}"))  # fmt: skip

    def tracing(self) -> None:
        ns = argparse.Namespace(model=self.args.model, concurrency=BATCH, dtype=self.dtype_name,
                                quick=self.plan.tracing_quick)  # fmt: skip
        self.tracing_runs, self.spans = tracing_runs(ns, self.work)
        off, on = (sum(v) / len(v) for v in (self.tracing_runs["off"], self.tracing_runs["on"]))
        self.ratios.append(Ratio(f"tok/s, tracing on / off (closed loop x{BATCH})", on / off, ">= 0.97", "{:.3f}",
                                 f"{off:,.0f} off, {on:,.0f} on; {self.spans:,} spans exported"))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller loads and fewer repeats (<= 10 min, builtin)")
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # the test suite's smoke run
    parser.add_argument("--model", default="builtin", help="builtin (default), smollm2, a .gguf file or a checkpoint")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="every side's dtype")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--out", required=True, type=Path, help="the folder for report.md and the figures")
    args = parser.parse_args()
    plan = PLANS["tiny" if args.tiny else "quick" if args.quick else "full"]
    args.out.mkdir(parents=True, exist_ok=True)
    bench_token()
    machine, load_before, started = Machine.here(), load_average(), time.perf_counter()
    run = Runner(args, plan)

    stages = 2 * len(plan.loads) + len(plan.sweep_ms) + 9  # the step() calls below
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TimeElapsedColumn())  # fmt: skip
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task("starting", total=stages)

        def step(what: str) -> None:
            now = time.perf_counter()
            if run.stage_s:
                run.stage_s[-1] = (run.stage_s[-1][0], now - run.stage_s[-1][1])
            run.stage_s.append((what, now))
            progress.update(task, advance=1, description=what)
            if not progress.console.is_terminal:  # a log file: one line per stage instead of a live bar
                print(f"[{now - started:5.0f} s] {what}", file=sys.stderr, flush=True)

        step("Coalesce, default settings")
        run.default_server(step)
        for wait in plan.sweep_ms:
            if wait != DEFAULT_WAIT:
                step(f"max_wait_ms {wait}")
                run.max_wait_server(wait, step)
        step("length-ratio rule off")
        run.rule_off()
        step("chunked prefill off")
        run.chunking_off()
        run.peers(step)
        step("dedup: identical vs distinct, replay through Redis")
        run.dedup()
        step("tracing off vs on")
        run.tracing()
        step("writing the report")
        run.stage_s.pop()

    write(run, machine, load_before, time.perf_counter() - started, args.out)
    print(f"wrote {args.out / 'report.md'} in {time.perf_counter() - started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
