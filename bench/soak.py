"""A bounded soak: real processes under load while things break on a schedule; every completed request is
checked token for token, and the servers must hold no KV block once the load has drained.

The setup (no helm, no docker): a redis-server on a free port and two replicas, each a `coalesce control-plane`
(with /metrics) driving its own `coalesce worker` (`--model builtin --dtype float32` by default), sharing the
store. Two tenants, through COALESCE_AUTH__TOKENS: a good one and a hostile one. Leases are 2 s, so a dead
replica's requests move within seconds.

The load: `--clients` tasks of the good tenant send keyed, greedy, streamed requests from a fixed pool of
prompts whose outputs were computed once at the start (on each replica: they must agree). They use the Python
client (retries, Resume) and move to the other replica on UNAVAILABLE, like a load balancer
(bench/soak_load.py). The chaos: one event every `--interval` s, cycling through worker kill, Redis restart from
its AOF, control-plane kill, disconnect storm, Redis restart empty, hostile tenant (bench/soak_chaos.py).

At the end the load drains and the summary says: requests served by tenant, errors by gRPC code (expected
for the hostile tenant vs unexpected), lost and duplicated tokens, leaked KV blocks (the
`coalesce_kv_blocks_used` gauge of each control plane), the peak RSS of each process, and every event. The
exit status is 1 when tokens were lost or duplicated, blocks leaked, an unexpected error occurred or a check
failed.

    .venv/bin/python bench/soak.py [--quick | --seconds N] [--model builtin|smollm2] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script (`python bench/soak.py`), the repo root is not on the path
    sys.path.insert(0, str(ROOT))

from bench.soak_chaos import KINDS, Chaos, Sizes  # noqa: E402
from bench.soak_cluster import Child, Redis, Replica, RssPeaks, kill_leftovers  # noqa: E402
from bench.soak_load import Load, good_client, prompt_pool, references  # noqa: E402

DRAIN_S = 240.0  # the load's last requests, then the servers' dropped streams, must end within this


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=600, help="how long the load and the chaos run")
    parser.add_argument("--quick", action="store_true", help="60 s, and every kind of event at least once")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between the starts of two events")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"events to cycle through (of {', '.join(KINDS)})")
    parser.add_argument("--clients", type=int, default=6, help="the good tenant's concurrent client tasks")
    parser.add_argument("--model", default="builtin", help="builtin (default) or smollm2")
    parser.add_argument("--dtype", default="float32", help="float32 (default): greedy outputs must not depend on "
                        "the batch's shape")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, help="longest output of the prompt pool (default: builtin 96 "
                        "with --quick, else 160; other models 32)")  # fmt: skip
    parser.add_argument("--kv-cache-mb", type=int, help="each worker's KV cache (default: builtin 32, else 512)")
    parser.add_argument(
        "--storm-dedup",
        choices=["auto", "off"],
        default="auto",
        help="dedup policy of the disconnect storm's keyless streams (auto: identical ones coalesce)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the summary to this JSON file")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds = 60.0
        args.interval = min(args.interval, 3.0)
    builtin = args.model == "builtin"
    args.max_tokens = args.max_tokens or (32 if not builtin else 96 if args.seconds <= 90 else 160)
    args.kv_cache_mb = args.kv_cache_mb or (32 if builtin else 512)
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = sorted(set(args.kinds) - set(KINDS))
    if unknown:
        parser.error(f"--kinds: unknown {', '.join(unknown)} (known: {', '.join(KINDS)})")
    return args


def environment(tokens: dict[str, str], max_per_tenant: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COALESCE_CONFIG", "COALESCE_TOKEN")}
    env.update({
        "PYTHONUNBUFFERED": "1",
        "COALESCE_AUTH__TOKENS": json.dumps({hashlib.sha256(t.encode()).hexdigest(): n for n, t in tokens.items()}),
        "COALESCE_LEASE_S": "2",  # a lost replica's keyed requests are taken over within seconds
        "COALESCE_POOLS__INTERACTIVE__MAX_WAIT_MS": "5",
        "COALESCE_POOLS__INTERACTIVE__MAX_PER_TENANT": str(max_per_tenant),
    })  # fmt: skip
    return env


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


async def drain(load: Load, tasks: list[asyncio.Task[None]], replicas: list[Replica], t0: float) -> dict[str, Any]:
    """Stop sending; let every request end; then wait for the KV gauges to reach 0 (dropped streams nobody
    resumed run to their end on their own). Returns what was still held."""
    loop = asyncio.get_running_loop()
    load.stopping.set()
    deadline = loop.time() + DRAIN_S
    _, pending = await asyncio.wait(tasks, timeout=DRAIN_S) if tasks else (set(), set())
    for task in pending:
        task.cancel()
        load.tally.unexpected["good stalled (no end within the drain)"] += 1
    used: dict[str, float | None] = {}
    while True:
        used = {r.name: await asyncio.to_thread(r.kv_blocks_used) for r in replicas}
        if all(v == 0 for v in used.values()) or loop.time() > deadline:
            break
        await asyncio.sleep(0.5)
    return {"kv_blocks_used": used, "drained_at_s": loop.time() - t0}


async def soak(args: argparse.Namespace, say: Any) -> dict[str, Any]:
    rng = random.Random(args.seed)
    tokens = {"good": secrets.token_hex(16), "hostile": secrets.token_hex(16)}
    short = args.seconds <= 90
    storm = 16 if short else 32
    # The hostile tenant's limit sits above what the good tenant ever runs on one replica (its clients and a
    # whole storm); its flood goes well past it.
    max_per_tenant = args.clients + storm + 8
    sizes = Sizes(storm, resumes=2000 if short else 5000, flood=max_per_tenant + 16, hold_s=3 if short else 5,
                  storm_dedup=args.storm_dedup)  # fmt: skip
    env = environment(tokens, max_per_tenant)
    worker_args = ["--model", args.model, "--dtype", args.dtype, "--kv-cache-mb", str(args.kv_cache_mb)]
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with tempfile.TemporaryDirectory(prefix="coalesce-soak-") as tmp:
        redis = Redis(Path(tmp))
        replicas = [Replica(name, redis.url, env, worker_args) for name in ("a", "b")]
        children: list[Child] = [redis.child] + [c for r in replicas for c in r.children()]
        peaks = RssPeaks()
        sampler = asyncio.create_task(peaks.run(children))
        tasks: list[asyncio.Task[None]] = []
        load = Load(prompt_pool(12, rng, max(1, args.max_tokens // 4), args.max_tokens), tokens,
                    lambda: [r.address for r in replicas if r.up], run=secrets.token_hex(4))  # fmt: skip
        try:
            await redis.start(persistent=True, keep_data=True)
            await asyncio.gather(*(r.start_worker() for r in replicas))
            await asyncio.gather(*(r.start_control_plane() for r in replicas))
            say(f"{loop.time() - t0:7.1f} s  started: redis {redis.url}, "
                + ", ".join(f"{r.name} {r.address} (worker :{r.worker_port}, /metrics :{r.metrics_port})"
                            for r in replicas))  # fmt: skip
            load.prompts = await references(load, [r.address for r in replicas])
            say(f"{loop.time() - t0:7.1f} s  references of {len(load.prompts)} prompts agree on both replicas")
            chaos = Chaos(redis, replicas, load, sizes, args.seed)
            tasks = [asyncio.create_task(good_client(load, i, args.seed * 1000 + i)) for i in range(args.clients)]
            started = loop.time()
            await chaos.run(args.kinds, started + args.seconds, args.interval, args.quick, t0, say)
            load_s = loop.time() - started
            say(f"{loop.time() - t0:7.1f} s  chaos over after {load_s:.0f} s of load; draining")
            drained = await drain(load, tasks, replicas, t0)
            peaks.sample(children)
        finally:
            for task in tasks:
                task.cancel()
            sampler.cancel()
            await load.clients.close()
            stuck = [role for r in replicas for role in await r.stop()]
            await redis.stop()
    if stuck:
        load.tally.checks_failed.append(f"did not stop within 30 s of SIGINT: {', '.join(stuck)}")
    logs = sum((r.cp.seen for r in replicas), Counter())
    return summary(args, load, chaos, drained, peaks, load_s, max_per_tenant, logs)


def summary(args: argparse.Namespace, load: Load, chaos: Chaos, drained: dict[str, Any], peaks: RssPeaks,
            load_s: float, max_per_tenant: int, logs: Counter[str]) -> dict[str, Any]:  # fmt: skip
    t = load.tally
    used = drained["kv_blocks_used"]
    leaked = sum(v for v in used.values() if v is not None)
    t.checks_failed += [f"{name}: /metrics did not answer after the drain" for name, v in used.items() if v is None]
    failed = bool(t.lost_tokens or t.duplicated_tokens or t.mismatched or t.gaps or leaked or t.unexpected
                  or t.checks_failed)  # fmt: skip
    return {
        "seconds": round(load_s, 1),
        "model": f"{args.model} {args.dtype}",
        "clients": args.clients,
        "max_per_tenant": max_per_tenant,
        "served": dict(t.served),
        "tokens": dict(t.tokens),
        "outcomes": dict(t.outcomes),
        "failovers": t.failovers,
        "control_plane_log": dict(logs),
        "resends": t.resends,
        "errors_expected": dict(t.expected),
        "errors_unexpected": dict(t.unexpected),
        "lost_tokens": t.lost_tokens,
        "duplicated_tokens": t.duplicated_tokens,
        "mismatched_requests": t.mismatched,
        "offset_gaps": t.gaps,
        "leaked_kv_blocks": leaked,
        "kv_blocks_used_after_drain": used,
        "drained_at_s": round(drained["drained_at_s"], 1),
        "peak_rss_mib": {role: round(kib / 1024) for role, kib in sorted(peaks.peak_kib.items())},
        "events": [asdict(e) for e in chaos.events],
        "event_counts": {k: sum(e.kind == k for e in chaos.events) for k in KINDS},
        "checks_failed": t.checks_failed,
        "problems": t.problems,
        "load_average": loadavg(),
        "passed": not failed,
    }


def render(s: dict[str, Any]) -> str:
    def counts(d: dict[str, Any]) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "none"

    out = [
        "",
        f"Soak: {s['seconds']} s of load, {s['model']}, 2 replicas (control plane + worker each) on one "
        f"redis-server, {s['clients']} good clients; load average at the end {s['load_average']}",
        "",
        "Events (start s, kind, took s, what it did):",
        *(f"  {e['at_s']:7.1f}  {e['kind']:<16} {e['took_s']:5.1f}  {e['did']}" for e in s["events"]),
        f"  per kind: {counts(s['event_counts'])}",
        "",
        f"Requests served:            {counts(s['served'])} (tokens: {counts(s['tokens'])})",
        f"Dedup outcomes (load):      {counts(s['outcomes'])}",
        f"Failovers to the other replica: {s['failovers']}; keyed re-sends after NOT_FOUND: {s['resends']}",
        f"Control planes' log:        {counts(s['control_plane_log'])}",
        f"Errors, expected (hostile tenant, limit {s['max_per_tenant']}): {counts(s['errors_expected'])}",
        f"Errors, unexpected:         {counts(s['errors_unexpected'])}",
        f"Lost tokens:                {s['lost_tokens']}",
        f"Duplicated tokens:          {s['duplicated_tokens']}",
        f"Requests not equal to their reference: {s['mismatched_requests']}; offset gaps: {s['offset_gaps']}",
        f"Leaked KV blocks:           {s['leaked_kv_blocks']:g} ({counts(s['kv_blocks_used_after_drain'])}; "
        f"drained at {s['drained_at_s']} s)",
        f"Peak RSS (MiB):             {counts(s['peak_rss_mib'])}",
        f"Checks failed:              {'; '.join(s['checks_failed']) or 'none'}",
    ]
    if s["problems"]:
        out += ["Problems (first 20):", *(f"  {p}" for p in s["problems"])]
    out.append(f"RESULT: {'PASS' if s['passed'] else 'FAIL'}")
    return "\n".join(out)


async def interruptible(args: argparse.Namespace) -> dict[str, Any]:
    """The soak, cancelled by Ctrl-C or SIGTERM (e.g. a CI timeout): its `finally`s then stop every process."""
    task = asyncio.current_task()
    assert task is not None
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, task.cancel)
    return await soak(args, lambda line: print(line, flush=True))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split()
    start = time.time()
    print(f"soak: {args.seconds:.0f} s, events {', '.join(args.kinds)} every {args.interval:g} s; "
          f"{' '.join(version[:3])}; load average {loadavg()}", flush=True)  # fmt: skip
    try:
        result = asyncio.run(interruptible(args))
    except asyncio.CancelledError:
        print("soak: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    finally:
        if left := kill_leftovers():
            print(f"soak: {left} process(es) did not stop and were killed", file=sys.stderr)
    result["wall_s"] = round(time.time() - start, 1)
    print(render(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    raise SystemExit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
