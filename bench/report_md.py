"""DIR/report.md and its figures, from what `bench/report.py`'s Runner measured (every number of that run)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from bench import dedup, plots
from bench.common import percentile
from bench.machine import Machine, load_average
from bench.serve_load import Row, table

if TYPE_CHECKING:
    from bench.report import Runner


def ms(xs: list[float], q: float) -> str:
    return f"{percentile(xs, q) * 1000:,.0f}"


def ratios(run: Runner) -> list[str]:
    out = ["| ratio | measured | goal | | detail |", "|---|---:|---:|---|---|"]
    for r in run.ratios:
        out.append(f"| {r.name} | {r.fmt.format(r.measured)} | {r.goal or '-'} | {r.met} | {r.note} |")
    return out


def load_sweep(run: Runner) -> list[str]:
    out = []
    for frac, rows in run.rows.items():
        rate = frac * run.capacity_req_s
        out += [f"**{frac:.0%} of capacity**: {rate:.2f} req/s, {run.offered[frac]:,.0f} tok/s offered", ""]
        out += [*table(rows), ""]
    return out


def sweep(run: Runner) -> list[str]:
    rate = run.plan.sweep_load * run.capacity_req_s
    out = [f"Same Poisson workload at {rate:.2f} req/s on a fresh server per value (interactive pool).", "",
           "| max_wait_ms | tok/s | TTFT p50 ms | TTFT p99 ms | tokens per worker step |",
           "|---:|---:|---:|---:|---:|"]  # fmt: skip
    for wait, tok_s, p50, p99, per_step in sorted(run.sweep):
        out.append(f"| {wait:g} | {tok_s:,.0f} | {p50:,.0f} | {p99:,.0f} | {per_step:.1f} |")
    return out


def bimodal(run: Runner) -> list[str]:
    n, short, long, new = run.plan.bimodal
    rate = len(run.bimodal_reqs) / run.bimodal_reqs[-1].arrival
    out = [f"{n} requests, half {short}-token and half {long}-token prompts, {new} tokens each, Poisson at "
           f"{rate:.2f} req/s; `prefill_ratio` 4 (on) vs 1e6 (off).", "",
           "| rule | tok/s | short TTFT p50 ms | short TTFT p99 ms | long TTFT p50 ms | e2e p99 ms |",
           "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for label, row in run.bimodal_rows.items():
        pairs = list(zip(row.timings, run.bimodal_reqs, strict=True))
        short_t = [t.first - t.sent for t, r in pairs if len(r.prompt) == short]
        long_t = [t.first - t.sent for t, r in pairs if len(r.prompt) == long]
        e2e = [t.finish - t.sent for t in row.timings]
        out.append(f"| {label} | {row.tok_s:,.0f} | {ms(short_t, 50)} | {ms(short_t, 99)} | {ms(long_t, 50)} "
                   f"| {ms(e2e, 99)} |")  # fmt: skip
    return out


def interference(run: Runner) -> list[str]:
    streams, long_len, longs, gap = run.plan.interference
    out = [f"{streams} streams decoding while {longs} prompts of {long_len} tokens arrive {gap:g} s apart; "
           "ITL of the running streams received while the long prompts were in flight.", "",
           "| chunked prefill | ITL p50 ms | ITL p99 ms | samples | long prompts' TTFT p50 ms |",
           "|---|---:|---:|---:|---:|"]  # fmt: skip
    for label, res in run.interference.items():
        long_ttft = ms(res.long_ttft_s, 50)
        out.append(f"| {label} | {res.p50_ms:,.1f} | {res.p99_ms:,.1f} | {len(res.itl_s)} | {long_ttft} |")
    return out


def prefix(run: Runner) -> list[str]:
    p = run.prefix
    rows = []
    for label, ts in (("cold", p.cold), ("1,024-token prefix cached", p.warm)):
        ttft = [t.first - t.sent for t in ts]
        noq = [t.first - t.sent - t.queue_s for t in ts]
        rows.append(f"| {label} | {len(ts)} | {ms(ttft, 50)} | {ms(noq, 50)} |")
    return ["Sequential 1-token requests, interactive max_wait_ms 0 (an idle server admits at once).", "",
            "| prompt | n | TTFT p50 ms | TTFT − queue p50 ms |", "|---|---:|---:|---:|", *rows]  # fmt: skip


def agreement_lines(run: Runner) -> list[str]:
    out = [f"Greedy outputs of Coalesce against each peer, same {len(run.work)} requests:", ""]
    for peer, (same, agree, total) in run.agreement.items():
        out.append(f"- {peer}: {same}/{len(run.work)} requests identical, {agree:,}/{total:,} tokens agree by position")
    return out


def figures(run: Runner, machine: Machine, out: Path) -> list[str]:
    points = [run_point for frac, rows in run.rows.items() for run_point in _points(rows, run.offered[frac])]
    made = [
        plots.throughput(points, machine.short, out / "throughput_vs_load.png"),
        plots.latency(points, machine.short, out / "latency_vs_load.png"),
        plots.max_wait([s[:4] for s in sorted(run.sweep)], machine.short, out / "max_wait_tradeoff.png"),
    ]
    if run.gauges:
        label = f"Coalesce at {max(run.plan.loads):.0%} load"
        made.append(plots.timeline(run.gauges, label, machine.short, out / "kv_and_batch_over_time.png"))
    return [f"![{p.stem}]({p.name})" for p in made]


def _points(rows: list[Row], offered: float) -> list[plots.LoadPoint]:
    return [point(r, offered) for r in rows]


def point(row: Row, offered: float) -> plots.LoadPoint:
    def ms(xs: list[float], q: float) -> float:
        return percentile(xs, q) * 1000

    ttft = [t.first - t.sent for t in row.timings]
    e2e = [t.finish - t.sent for t in row.timings]
    system = row.name.split(",")[0]
    return plots.LoadPoint(system, offered, row.tok_s, ms(ttft, 50), ms(ttft, 99), ms(e2e, 50), ms(e2e, 99))


def write(run: Runner, machine: Machine, load_before: str, wall_s: float, out: Path) -> None:
    args = run.args
    lengths = sorted(len(r.prompt) for r in run.work)
    news = sorted(r.max_tokens for r in run.work)
    n, prompt, new, _ = run.plan.dedup
    ns = argparse.Namespace(requests=n, prompt_tokens=prompt, max_tokens=new)
    dedup_text = dedup.report(ns, run.bursts, run.replay).replace("builtin model", f"model {args.model}")
    lines = [
        f"# Coalesce benchmark report: model {args.model}, {run.dtype_name}",
        "",
        f"Machine: {machine.line}. Load average before: {load_before}; after: {load_average()}. "
        f"Wall time {wall_s / 60:.1f} min{' (--quick)' if args.quick else ''}.",
        "",
        f"Workload (seed {args.seed}): {len(run.work)} requests, prompts {lengths[0]}..{lengths[-1]} tokens "
        f"(median {lengths[len(lengths) // 2]}), max_tokens {news[0]}..{news[-1]} (median {news[len(news) // 2]}), "
        f"{run.tokens} tokens, greedy, ignore_eos. Capacity (closed loop x32): {run.capacity_req_s:.2f} req/s. "
        "Times in ms, client-observed; bench/README.md says what each number means.",
        "",
        "## Ratios",
        "",
        *ratios(run),
        "",
        *agreement_lines(run),
        "",
        "## Closed loops",
        "",
        f"The workload {run.plan.closed_reps} time(s) over; x32 streamed and not streamed run twice each, alternating "
        "(the ratio is of their means; the table shows the last run of each).",
        "",
        *table(run.closed_rows),
        "",
        "## Offered load, Coalesce and the peers",
        "",
        *load_sweep(run),
        "## Interactive pool max_wait_ms",
        "",
        *sweep(run),
        "",
        "## Prefill length-ratio rule, bimodal workload",
        "",
        *bimodal(run),
        "",
        "## Shared prefix",
        "",
        *prefix(run),
        "",
        "## Chunked prefill: running streams while long prompts arrive",
        "",
        *interference(run),
        "",
        "## Dedup and replay",
        dedup_text,
        "",
        "## Tracing",
        "",
        f"Closed loop x32 on fresh servers, alternating off/on; tok/s per run: off "
        f"{', '.join(f'{x:,.0f}' for x in run.tracing_runs['off'])}; on "
        f"{', '.join(f'{x:,.0f}' for x in run.tracing_runs['on'])} ({run.spans:,} spans received).",
        "",
        "## Time per stage",
        "",
        "; ".join(f"{what} {secs:.0f} s" for what, secs in run.stage_s) + ".",
        "",
        "## Figures",
        "",
        *figures(run, machine, out),
        "",
    ]
    (out / "report.md").write_text("\n".join(lines), encoding="utf-8")
