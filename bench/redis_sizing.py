"""What the shared store holds per request, measured on a real redis-server: bytes per idempotency record,
request index entry, token log and content lease, how long each is kept, and the AOF bytes each request
appends. docs/deploy.md sizes Redis from these figures.

One worker (builtin model, CPU) and one `coalesce control-plane --store redis://...` on a redis-server started
here (a free port, AOF on with fsync every second, as the chart's bundled Redis). For each shape (prompt
characters, output tokens), `--requests` concurrent requests with distinct prompts, greedy, `ignore_eos` (so
each generates exactly max_tokens), twice: every request with its own idempotency key, then none with a key.
After each run (the database flushed before it) every key is measured with `MEMORY USAGE key SAMPLES 0`
(exact, allocator overhead included) and `PTTL`, grouped by kind (the key layout is in
dedup_service/redis_store.py). `used_memory` and the AOF size are read before and after each run.

The builtin model's tokenizer is one byte per token, so a prompt of N characters is N tokens and each output
token carries at most one character of text; a real model's token carries ~4 characters, a few more bytes per
token in the log and in the stored result.

    .venv/bin/python bench/redis_sizing.py [--quick] [--requests N] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script (`python bench/redis_sizing.py`), the repo root is not on the path
    sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from bench.common import bench_token, free_port  # noqa: E402
from bench.dedup import CONTROL_PLANE, WORKER, coalesce  # noqa: E402
from clients.aio import AsyncCoalesceClient  # noqa: E402
from clients.retry import NO_RETRY  # noqa: E402

# Key kinds by their prefix after `coalesce:` (dedup_service/redis_store.py).
KINDS = ("idem", "req", "logm", "log", "content", "batch")
FILLER = "The quick brown fox jumps over the lazy dog. "


@dataclass(frozen=True, slots=True)
class Shape:
    prompt_chars: int
    max_tokens: int


@dataclass(slots=True)
class Run:
    shape: Shape
    keyed: bool
    requests: int
    bytes_by_kind: dict[str, float]  # mean MEMORY USAGE per request (kind's total / requests)
    ttl_by_kind: dict[str, float]  # mean PTTL in seconds, -1 when the keys have none
    used_memory: float  # used_memory delta per request
    aof: float  # AOF bytes appended per request


@contextmanager
def redis_with_aof() -> Iterator[tuple[str, Path]]:
    """redis-server on a free port with the chart's persistence settings; yields (URL, its data directory)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed (the README's test command installs it)")
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", tmp]
        args += ["--appendonly", "yes", "--appendfsync", "everysec", "--maxmemory-policy", "noeviction"]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            client = redis.Redis(port=port)
            deadline = time.monotonic() + 10
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"redis-server did not start on port {port}") from None
                    time.sleep(0.02)
            client.close()
            yield f"redis://127.0.0.1:{port}/0", Path(tmp)
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def aof_bytes(data_dir: Path) -> int:
    return sum(p.stat().st_size for p in data_dir.rglob("*.aof"))


def prompt(i: int, chars: int) -> str:
    head = f"request {i:06d}: "
    body = (FILLER * (chars // len(FILLER) + 1))[: chars - len(head)]
    return head + body


async def send(address: str, shape: Shape, n: int, keyed: bool, tag: str) -> None:
    async with AsyncCoalesceClient(address, retry=NO_RETRY) as client:
        gens = [
            client.generate(
                prompt(i, shape.prompt_chars),
                max_tokens=shape.max_tokens,
                ignore_eos=True,
                stream=True,
                idempotency_key=f"{tag}-{i}" if keyed else None,
            ).result()
            for i in range(n)
        ]
        results = await asyncio.gather(*gens)
    got = {len(r.token_ids) for r in results}
    if got != {shape.max_tokens}:
        raise RuntimeError(f"expected {shape.max_tokens} tokens per request, got {got}")


def settle(client: redis.Redis, data_dir: Path) -> None:
    """Wait until the store stops changing: the control plane writes the last records just after the client
    received its final token. (Redis writes the AOF before it replies; only the fsync waits a second.)"""
    last = (-1, -1)
    while True:
        time.sleep(0.5)
        now = (int(client.dbsize()), aof_bytes(data_dir))
        if now == last:
            return
        last = now


def measure(client: redis.Redis, data_dir: Path, address: str, shape: Shape, n: int, keyed: bool) -> Run:
    client.flushall()
    settle(client, data_dir)
    mem0, aof0 = int(client.info("memory")["used_memory"]), aof_bytes(data_dir)
    asyncio.run(send(address, shape, n, keyed, tag=f"{shape.prompt_chars}-{shape.max_tokens}"))
    settle(client, data_dir)
    mem1, aof1 = int(client.info("memory")["used_memory"]), aof_bytes(data_dir)
    sizes: dict[str, list[int]] = defaultdict(list)
    ttls: dict[str, list[int]] = defaultdict(list)
    for raw in client.scan_iter(match="coalesce:*", count=1000):
        key = raw.decode()
        kind = key.split(":", 2)[1]
        sizes[kind].append(int(client.memory_usage(key, samples=0) or 0))
        ttls[kind].append(int(client.pttl(key)))
    return Run(
        shape,
        keyed,
        n,
        {k: sum(v) / n for k, v in sizes.items()},
        {k: (sum(v) / len(v) / 1000 if min(v) >= 0 else -1.0) for k, v in ttls.items()},
        (mem1 - mem0) / n,
        (aof1 - aof0) / n,
    )


def report(runs: list[Run], n: int) -> str:
    kinds = [k for k in KINDS if any(k in r.bytes_by_kind for r in runs)]
    lines = [
        f"Redis store per request ({n} concurrent requests per row; builtin model: 1 prompt char = 1 token)",
        "",
        "| prompt chars | output tokens | idempotency key | "
        + " | ".join(f"{k} B" for k in kinds)
        + " | keys total B | used_memory Δ B | AOF B |",
        "|" + "---|" * (len(kinds) + 6),
    ]
    for r in runs:
        cells = [f"{r.bytes_by_kind.get(k, 0):.0f}" for k in kinds]
        total = sum(r.bytes_by_kind.values())
        lines.append(
            f"| {r.shape.prompt_chars} | {r.shape.max_tokens} | {'yes' if r.keyed else 'no'} | "
            + " | ".join(cells)
            + f" | {total:.0f} | {r.used_memory:.0f} | {r.aof:.0f} |"
        )
    lines += ["", "Time to live of each kind right after the requests finished (s; -1: none)", ""]
    lines += ["| idempotency key | " + " | ".join(kinds) + " |", "|" + "---|" * (len(kinds) + 1)]
    for keyed in (True, False):
        run = next(r for r in reversed(runs) if r.keyed == keyed)
        cells = [f"{run.ttl_by_kind[k]:.0f}" if k in run.ttl_by_kind else "" for k in kinds]
        lines.append(f"| {'yes' if keyed else 'no'} | " + " | ".join(cells) + " |")
    keyed_runs = [r for r in runs if r.keyed]
    a, b = keyed_runs[0], keyed_runs[-1]
    if b.shape.max_tokens > a.shape.max_tokens:
        dt = b.shape.max_tokens - a.shape.max_tokens
        log = (b.bytes_by_kind.get("log", 0) - a.bytes_by_kind.get("log", 0)) / dt
        aof = (b.aof - a.aof) / dt
        lines += ["", f"Per output token, between the two shapes (keyed): token log {log:.1f} B, AOF {aof:.0f} B"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run: few requests, small shapes")
    parser.add_argument("--requests", type=int, help="concurrent requests per row (default 32, quick 4)")
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args()
    bench_token()
    n = args.requests or (4 if args.quick else 32)
    shapes = [Shape(128, 16), Shape(512, 64)] if args.quick else [Shape(256, 32), Shape(1536, 256)]
    with ExitStack() as stack:
        url, data_dir = stack.enter_context(redis_with_aof())
        worker = stack.enter_context(
            coalesce("worker", "--model", "builtin", "--device", "cpu", "--kv-cache-mb", "128", ready=WORKER)
        )
        cp_env = {"COALESCE_POOLS__INTERACTIVE__MAX_BATCH": str(max(8, n))}
        address = stack.enter_context(
            coalesce("control-plane", "--worker", worker, "--store", url, ready=CONTROL_PLANE, env=cp_env)
        )
        client = stack.enter_context(redis.Redis.from_url(url))
        # Warm-up, not measured: the first requests load the Lua scripts and open connections.
        measure(client, data_dir, address, shapes[0], 2, keyed=True)
        runs = [measure(client, data_dir, address, s, n, keyed) for s in shapes for keyed in (True, False)]
    text = report(runs, n)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
