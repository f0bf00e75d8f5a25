"""What dedup saves: identical concurrent requests vs distinct ones, and the cost of replaying a finished key.

Part 1, one `coalesce serve` (builtin model, memory store, `--metrics-port`). Three bursts of `--requests`
concurrent streamed requests, all the same shape (a `--prompt-tokens`-token prompt given as token ids,
`--max-tokens` greedy tokens, `ignore_eos`, so each generates exactly max_tokens):

- distinct: every request has its own prompt (no shared prefix), so nothing can be deduplicated;
- identical, keyless: one prompt, no idempotency key, retries off (a retrying client would add a random
  key to each request): the server's content dedup (`dedup=AUTO`, greedy is deterministic) coalesces them;
- identical, one key: one prompt, and the same idempotency key on every request.

For each, the deltas of the server's counters around the burst: worker steps (`coalesce_steps_total`) and
tokens run through the model (`coalesce_step_tokens_sum`), plus the client-observed wall time from the first
send to the last token, and the dedup outcomes the first chunks reported. Ratios are identical / distinct.
The interactive pool's max batch is raised to `--requests` so that the distinct burst runs as one batch,
as the identical ones do: the comparison is then compute saved, not queueing avoided.

Part 2, one worker + one `coalesce control-plane --store redis://...` on a real `redis-server` (a free port,
nothing persisted). One keyed request runs to `SUCCESS`; then `--replays` sequential Generate calls with the
same key and payload, each timed client-side from send to the last chunk (all replayed, no worker step).
For comparison, fresh 1-token generations (distinct prompts, dedup off), whose latency includes the
interactive pool's batch-buffer wait (`max_wait_ms`, shown as its own column).

    .venv/bin/python bench/dedup.py [--quick] [--requests N] [--replays N] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script (`python bench/dedup.py`), the repo root is not on the path
    sys.path.insert(0, str(ROOT))


from bench.common import bench_token, free_port, interrupt, percentile, redis_server  # noqa: E402
from clients.aio import AsyncCoalesceClient  # noqa: E402
from clients.client import CoalesceClient  # noqa: E402
from clients.retry import NO_RETRY  # noqa: E402
from clients.types import Result  # noqa: E402

SERVING = re.compile(r"coalesce serving \S+ on (\S+):(\d+)")
CONTROL_PLANE = re.compile(r"coalesce control plane on (\S+):(\d+)")
WORKER = re.compile(r"coalesce worker listening on (\S+):(\d+)")
# The builtin model's byte tokenizer: ids 0-255 are bytes, 256/257 are BOS/EOS. Prompts stay below 256.
BYTE_IDS = 256
KV_CACHE_MB = "128"  # 64 sequences x 128 tokens is ~16 MiB of fp32 KV for the builtin model; room to spare
# The figures are about dedup, not the model: the builtin model in float32, as before `--dtype auto` chose bf16.
MODEL = ("--model", "builtin", "--dtype", "float32")


class Coalesce:
    """`coalesce COMMAND --port 0 ...` as a child process; `.address` once it printed where it listens."""

    def __init__(self, command: str, *args: str, ready: re.Pattern[str], env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "clients.cli", command, "--port", "0", *args]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        full_env.pop("COALESCE_CONFIG", None)  # a config file in the caller's environment would skew the figures
        self.name = command
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)  # fmt: skip
        self.lines: list[str] = []
        self.address = ""
        found = threading.Event()

        def read() -> None:  # keep draining stdout so the child never blocks on a full pipe
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                if (m := ready.search(line)) and not found.is_set():
                    self.address = f"{m.group(1)}:{m.group(2)}"
                    found.set()

        threading.Thread(target=read, daemon=True).start()
        try:
            if not found.wait(180):
                raise RuntimeError(f"coalesce {command} did not start:\n" + "".join(self.lines[-40:]))
        except BaseException:  # also Ctrl-C or SIGTERM while waiting: no caller holds the process yet
            self.stop()
            raise

    def stop(self) -> None:
        """Ctrl-C (SIGINT): drains in-flight requests and, for `serve`, stops its workers too."""
        interrupt(self.proc)


@contextmanager
def coalesce(command: str, *args: str, ready: re.Pattern[str], env: dict[str, str] | None = None) -> Iterator[str]:
    process = Coalesce(command, *args, ready=ready, env=env)
    try:
        yield process.address
    finally:
        process.stop()


def counters(metrics_port: int) -> tuple[float, float]:
    """(worker steps, tokens run through the model) so far, summed over label sets."""
    steps = tokens = 0.0
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as page:
        for line in page.read().decode().splitlines():
            if line.startswith("#") or not line:
                continue
            name, _, value = line.rpartition(" ")
            series = name.split("{", 1)[0]
            if series == "coalesce_steps_total":
                steps += float(value)
            elif series == "coalesce_step_tokens_sum":
                tokens += float(value)
    return steps, tokens


# --- Part 1: identical vs distinct ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Burst:
    label: str
    steps: float
    tokens: float
    wall_s: float
    outcomes: Counter[str]
    agree: bool  # every request received the same tokens (expected for the identical bursts)


async def burst(address: str, prompts: list[list[int]], max_tokens: int, key: str | None) -> tuple[float, list[Result]]:
    """Send all prompts at once; wall time from the first send to the last token, and each result."""
    # Retries off: with them on the client would add a random idempotency key to keyless requests, turning
    # content dedup into "every request has its own key".
    async with AsyncCoalesceClient(address, retry=NO_RETRY) as client:
        gens = [
            client.generate(p, max_tokens=max_tokens, ignore_eos=True, stream=True, idempotency_key=key).result()
            for p in prompts
        ]
        t0 = time.perf_counter()
        results = await asyncio.gather(*gens)
        return time.perf_counter() - t0, list(results)


def settled_counters(metrics_port: int) -> tuple[float, float]:
    """The counters once two reads 50 ms apart agree: the observer may record the last step just after the
    client received its final token."""
    last = counters(metrics_port)
    for _ in range(20):
        time.sleep(0.05)
        now = counters(metrics_port)
        if now == last:
            break
        last = now
    return last


def run_burst(label: str, address: str, metrics_port: int, prompts: list[list[int]], max_tokens: int,
              key: str | None = None) -> Burst:  # fmt: skip
    steps0, tokens0 = settled_counters(metrics_port)
    wall, results = asyncio.run(burst(address, prompts, max_tokens, key))
    steps1, tokens1 = settled_counters(metrics_port)
    if any(len(r.token_ids) != max_tokens for r in results):
        raise RuntimeError(f"{label}: a request did not generate {max_tokens} tokens")
    outcomes = Counter(r.dedup_outcome or "none" for r in results)
    agree = len({tuple(r.token_ids) for r in results}) == 1
    return Burst(label, steps1 - steps0, tokens1 - tokens0, wall, outcomes, agree)


def distinct_prompts(n: int, length: int, rng: random.Random) -> list[list[int]]:
    """n prompts that share no first token, so neither dedup nor a prefix cache can merge any two."""
    firsts = rng.sample(range(BYTE_IDS), n + 2)
    return [[first] + [rng.randrange(BYTE_IDS) for _ in range(length - 1)] for first in firsts]


def part1(
    n: int, prompt_tokens: int, max_tokens: int, model: tuple[str, ...] = MODEL, kv_mb: str = KV_CACHE_MB
) -> list[Burst]:
    """`model`: the --model/--dtype flags (bench/report.py runs it on the report's model), with the KV it needs."""
    if n + 2 > BYTE_IDS:
        raise SystemExit(f"--requests must be at most {BYTE_IDS - 2}")
    rng = random.Random(0)
    # Distinct first tokens across all bursts: the two identical prompts and the warm-up share nothing either.
    prompts = distinct_prompts(n + 2, prompt_tokens, rng)
    distinct, same_keyless, same_keyed = prompts[:n], prompts[n], prompts[n + 1]
    warmup = [[rng.randrange(BYTE_IDS) for _ in range(prompt_tokens)] for _ in range(4)]
    metrics_port = free_port()
    # One batch for every burst (see the docstring), and the batch buffer's default wait.
    env = {"COALESCE_POOLS__INTERACTIVE__MAX_BATCH": str(n)}
    args = (*model, "--kv-cache-mb", kv_mb, "--metrics-port", str(metrics_port), "--store", "memory")
    with coalesce("serve", *args, ready=SERVING, env=env) as address:
        asyncio.run(burst(address, warmup, 4, None))  # first steps pay for allocation and kernel selection
        return [
            run_burst("distinct", address, metrics_port, distinct, max_tokens),
            run_burst("identical, keyless", address, metrics_port, [same_keyless] * n, max_tokens),
            run_burst("identical, one key", address, metrics_port, [same_keyed] * n, max_tokens, key="bench-k"),
        ]


# --- Part 2: replaying a SUCCESS key through Redis -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Latencies:
    replay_ms: list[float]
    fresh_ms: list[float]
    fresh_queue_ms: list[float]
    replay_outcomes: Counter[str]
    settle_calls: int  # untimed duplicates answered before the record read as SUCCESS


def timed(client: CoalesceClient, prompt: list[int], **opts: object) -> tuple[float, Result]:
    t0 = time.perf_counter()
    result = client.generate(prompt, **opts).result()  # type: ignore[arg-type]
    return (time.perf_counter() - t0) * 1000, result


def part2(replays: int, fresh: int, prompt_tokens: int, max_tokens: int, model: tuple[str, ...] = MODEL) -> Latencies:
    rng = random.Random(1)
    prompt = [rng.randrange(BYTE_IDS) for _ in range(prompt_tokens)]
    keyed = {"max_tokens": max_tokens, "ignore_eos": True, "stream": True, "idempotency_key": "bench-replay"}
    with ExitStack() as stack:
        url = stack.enter_context(redis_server())
        worker = stack.enter_context(coalesce("worker", *model, "--kv-cache-mb", "32", ready=WORKER))
        address = stack.enter_context(coalesce("control-plane", "--worker", worker, "--store", url,
                                               ready=CONTROL_PLANE))  # fmt: skip
        # The key is explicit, so retries would add nothing but could hide a failure: off.
        client = stack.enter_context(CoalesceClient(address, retry=NO_RETRY))
        for i in range(3):  # warm the channel, the worker and the control plane's Redis connection
            client.generate([i, *prompt[1:]], max_tokens=1, dedup="off").result()
        _, first = timed(client, prompt, **keyed)
        if first.dedup_outcome != "miss":
            raise RuntimeError(f"the first keyed request was not a miss: {first.dedup_outcome}")
        # The record may turn SUCCESS just after the first client got its last token; until then a duplicate
        # is coalesced onto the finished log instead of replayed. Only replays of a SUCCESS record are timed.
        settle = 0
        while timed(client, prompt, **keyed)[1].dedup_outcome != "replayed":
            settle += 1
            if settle == 100:
                raise RuntimeError("the keyed request's record never reached SUCCESS")
        replay_ms, outcomes = [], Counter[str]()
        for _ in range(replays):
            ms, again = timed(client, prompt, **keyed)
            if again.token_ids != first.token_ids:
                raise RuntimeError("a replay returned other tokens than the original")
            replay_ms.append(ms)
            outcomes[again.dedup_outcome or "none"] += 1
        fresh_ms, fresh_queue_ms = [], []
        for i in range(fresh):
            # A new prompt each time and dedup off: nothing to replay or coalesce, a real 1-token generation.
            ms, result = timed(client, [i % BYTE_IDS, *prompt[:-1]], max_tokens=1, dedup="off", seed=i)
            fresh_ms.append(ms)
            fresh_queue_ms.append(result.queue_ms)
        return Latencies(replay_ms, fresh_ms, fresh_queue_ms, outcomes, settle)


# --- Report --------------------------------------------------------------------------------------------------


def counts(outcomes: Counter[str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()))


def ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else "n/a"


def report(args: argparse.Namespace, bursts: list[Burst], lat: Latencies) -> str:
    out: list[str] = []
    distinct = bursts[0]
    shape = f"{args.prompt_tokens}-token prompts, {args.max_tokens} max_tokens, greedy, ignore_eos"
    out.append(f"\n{args.requests} concurrent requests against one `coalesce serve` (builtin model, memory store), "
               f"{shape}\n")  # fmt: skip
    out.append("| burst | worker steps | tokens computed | wall s | steps ratio | tokens ratio | wall ratio "
               "| dedup outcomes | same tokens |")  # fmt: skip
    out.append("|---|---:|---:|---:|---:|---:|---:|---|---|")
    for b in bursts:
        outcomes = counts(b.outcomes)
        out.append(
            f"| {b.label} | {b.steps:,.0f} | {b.tokens:,.0f} | {b.wall_s:.2f} | {ratio(b.steps, distinct.steps)} "
            f"| {ratio(b.tokens, distinct.tokens)} | {ratio(b.wall_s, distinct.wall_s)} | {outcomes} "
            f"| {'yes' if b.agree else 'no'} |"
        )
    one = args.prompt_tokens + args.max_tokens - 1  # the prompt once, then one token per decode step
    out.append(f"\nRatios are identical / distinct. One inference computes {one} tokens "
               f"(prompt + max_tokens - 1); {args.requests} distinct ones {args.requests * one:,}. "
               "Wall time includes the batch buffer's wait (interactive pool, 30 ms by default).")  # fmt: skip

    out.append(
        "\nReplay of a SUCCESS key through gRPC, one control plane + one worker on redis-server, "
        f"{args.prompt_tokens}-token prompt, {args.max_tokens} tokens, sequential calls, client-side ms\n"
    )
    out.append("| call | n | p50 ms | p99 ms | batch-buffer wait p50 ms |")
    out.append("|---|---:|---:|---:|---:|")
    r, f = lat.replay_ms, lat.fresh_ms
    replay = f"replay ({counts(lat.replay_outcomes)})"
    out.append(f"| {replay} | {len(r)} | {percentile(r, 50):.2f} | {percentile(r, 99):.2f} | - |")
    fresh_wait = percentile(lat.fresh_queue_ms, 50)
    out.append(f"| fresh 1-token generation | {len(f)} | {percentile(f, 50):.2f} | {percentile(f, 99):.2f} "
               f"| {fresh_wait:.2f} |")  # fmt: skip
    out.append(f"\nUntimed duplicates answered before the record read as SUCCESS: {lat.settle_calls}.")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a fast smoke run: fewer, shorter requests")
    parser.add_argument("--requests", type=int, default=64, help="concurrent requests per burst")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--replays", type=int, default=500, help="sequential replays of the SUCCESS key")
    parser.add_argument("--out", type=Path, help="also write the tables to this markdown file")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.prompt_tokens, args.max_tokens, args.replays = 16, 32, 16, 50
    fresh = max(20, args.replays // 5)

    # A SIGTERM (e.g. a CI timeout) unwinds like Ctrl-C, so the `finally`s stop redis and the coalesce processes.
    def terminate(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    bench_token()
    bursts = part1(args.requests, args.prompt_tokens, args.max_tokens)
    lat = part2(args.replays, fresh, args.prompt_tokens, args.max_tokens)
    text = report(args, bursts, lat)
    print(text)
    if args.out:
        args.out.write_text(text.strip() + "\n")


if __name__ == "__main__":
    main()
