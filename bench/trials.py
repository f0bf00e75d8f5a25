"""The Coalesce-side experiments of `bench/report.py`, each against a running `coalesce serve` (its address,
and its metrics port where the experiment reads counters). Loads and timings reuse `bench/serve_load.py`
(`Request`, `Timing`, `stream_one`, `run_closed`, `run_poisson`); what is new here:

- `run_closed_unary`: the closed loop with `stream=False` (one final message per request);
- `Gauges`: a thread scraping /metrics every `period_s` (KV blocks in use, running sequences) for the plots;
- `prefix_ttft`: TTFT of a prompt whose 1,024-token prefix is already cached, against the same prompt cold;
- `bimodal`: a workload of short and long prompts, for the prefill length-ratio rule;
- `interference`: streams decoding while long prompts arrive, with per-token receive times, for the ITL
  of running streams under chunked prefill on and off.
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
import urllib.request
from collections import deque
from dataclasses import dataclass, field

from bench.common import COUNTERS, percentile
from bench.serve_load import PROMPT_IDS, Request, Timing, stream_one
from clients.aio import AsyncCoalesceClient
from clients.retry import NO_RETRY

# --- non-streamed closed loop -----------------------------------------------------------------------------


async def unary_one(client: AsyncCoalesceClient, req: Request, t0: float) -> Timing:
    timing = Timing(sent=time.perf_counter() - t0)
    result = await client.generate(
        req.prompt, max_tokens=req.max_tokens, ignore_eos=True, dedup="off", stream=False
    ).result()
    timing.first = timing.finish = time.perf_counter() - t0
    timing.queue_s, timing.tokens, timing.ids = result.queue_ms / 1000, len(result.token_ids), result.token_ids
    return timing


async def run_closed_unary(address: str, work: list[Request], concurrency: int) -> list[Timing]:
    """As serve_load.run_closed, but each request answered once (stream=False)."""
    async with AsyncCoalesceClient(address, retry=NO_RETRY) as client:
        t0, todo, out = time.perf_counter(), deque(enumerate(work)), [Timing(0.0)] * len(work)

        async def loop() -> None:
            while todo:
                i, req = todo.popleft()
                out[i] = await unary_one(client, req, t0)

        await asyncio.gather(*(loop() for _ in range(concurrency)))
        return out


def tok_s(timings: list[Timing]) -> float:
    span = max(t.finish for t in timings) - min(t.sent for t in timings)
    return sum(t.tokens for t in timings) / span


# --- /metrics ---------------------------------------------------------------------------------------------


def scrape_all(port: int) -> dict[str, float]:
    """Every series of /metrics summed over its label sets ({} when the endpoint does not answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            name = key.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
    return out


def steps_and_tokens(port: int) -> tuple[float, float]:
    m = scrape_all(port)
    return m.get(COUNTERS[0], math.nan), m.get("coalesce_step_tokens_sum", math.nan)


@dataclass
class Gauges:
    """Samples (seconds since start, KV blocks in use, running sequences) while a `with` block runs."""

    port: int
    period_s: float = 0.1
    samples: list[tuple[float, float, float]] = field(default_factory=list)

    def __enter__(self) -> Gauges:
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            m = scrape_all(self.port)
            if m:
                t = time.perf_counter() - self._t0
                self.samples.append((t, m.get("coalesce_kv_blocks_used", 0.0), m.get("coalesce_running_sequences", 0)))

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# --- shared prefix ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PrefixResult:
    cold: list[Timing]
    warm: list[Timing]

    def ratio(self, minus_queue: bool = False) -> float:
        def ttft(ts: list[Timing]) -> float:
            return percentile([t.first - t.sent - (t.queue_s if minus_queue else 0.0) for t in ts], 50)

        return ttft(self.warm) / ttft(self.cold)


async def prefix_ttft(address: str, prefix_len: int, n: int, seed: int = 7) -> PrefixResult:
    """For each of n distinct prefixes (distinct first tokens, so nothing is cached across them): the prefix +
    a 16-token suffix sent cold, then the prefix + another suffix (a prefix-cache hit); 1 token each, in turn."""
    rng = random.Random(seed)
    firsts = rng.sample(range(PROMPT_IDS), n)
    cold, warm = [], []
    async with AsyncCoalesceClient(address, retry=NO_RETRY) as client:
        t0 = time.perf_counter()
        for first in firsts:
            prefix = [first] + [rng.randrange(PROMPT_IDS) for _ in range(prefix_len - 1)]
            a, b = ([rng.randrange(PROMPT_IDS) for _ in range(16)] for _ in range(2))
            cold.append(await stream_one(client, Request(prefix + a, 1, 0.0), t0))
            warm.append(await stream_one(client, Request(prefix + b, 1, 0.0), t0))
    return PrefixResult(cold, warm)


# --- bimodal workload -------------------------------------------------------------------------------------


def bimodal(n: int, rate: float, short: int, long: int, max_tokens: int, seed: int = 3) -> list[Request]:
    """Half short prompts (`short` tokens), half long (`long`), shuffled; `max_tokens` each; Poisson at `rate`."""
    rng = random.Random(seed)
    lengths = [short] * (n // 2) + [long] * (n - n // 2)
    rng.shuffle(lengths)
    out, clock = [], 0.0
    for length in lengths:
        clock += rng.expovariate(rate)
        out.append(Request([rng.randrange(PROMPT_IDS) for _ in range(length)], max_tokens, clock))
    return out


# --- decodes while long prompts arrive ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Interference:
    itl_s: list[float]  # gaps between tokens of the running streams, received while long prompts were in flight
    long_ttft_s: list[float]

    @property
    def p99_ms(self) -> float:
        return percentile(self.itl_s, 99) * 1000

    @property
    def p50_ms(self) -> float:
        return percentile(self.itl_s, 50) * 1000


async def interference(address: str, streams: int, long_len: int, longs: int, gap_s: float) -> Interference:
    """`streams` clients stream short requests back to back; once all of them receive tokens, `longs` prompts
    of `long_len` tokens (1 token each) arrive `gap_s` apart. The ITL samples kept are those received between
    the first long send and the last long's first token."""
    rng = random.Random(11)
    stop = asyncio.Event()
    stamps: list[tuple[float, float]] = []  # (receive time, gap / tokens in the chunk)
    started = [asyncio.Event() for _ in range(streams)]

    async with AsyncCoalesceClient(address, retry=NO_RETRY) as client:

        async def decoder(i: int) -> None:
            while not stop.is_set():
                prompt = [rng.randrange(PROMPT_IDS) for _ in range(16)]
                last = None
                async for chunk in client.generate(prompt, max_tokens=64, ignore_eos=True, dedup="off"):
                    now = time.perf_counter()
                    if chunk.token_ids:
                        started[i].set()
                        if last is not None:
                            stamps.append((now, (now - last) / len(chunk.token_ids)))
                        last = now

        async def long_one(delay: float) -> float:
            await asyncio.sleep(delay)
            prompt = [rng.randrange(PROMPT_IDS) for _ in range(long_len)]
            sent = time.perf_counter()
            async for chunk in client.generate(prompt, max_tokens=1, ignore_eos=True, dedup="off"):
                if chunk.token_ids:
                    return time.perf_counter() - sent
            return math.nan

        tasks = [asyncio.create_task(decoder(i)) for i in range(streams)]
        await asyncio.gather(*(e.wait() for e in started))
        window_start = time.perf_counter()
        ttfts = await asyncio.gather(*(long_one(k * gap_s) for k in range(longs)))
        window_end = time.perf_counter()
        stop.set()
        await asyncio.gather(*tasks)
    kept = [g for t, g in stamps if window_start <= t <= window_end]
    return Interference(kept, list(ttfts))
