"""The peers a report compares `coalesce serve` against, on the same weights, dtype and requests:

- `transformers` continuous batching: its `ContinuousBatchingManager` (the engine behind `generate_batch`,
  with its paged cache), fed each request at its Poisson arrival time in real time, as a server would be;
  per-token timestamps come from `record_timestamps`. One manager is kept for the whole report: its first
  step pays for allocating the paged cache (seconds), which the warm-up absorbs.
- `transformers` static batching: `bench/serve_load.py`'s `run_static` (padded `generate`, virtual clock);
- one request at a time: the same with batches of one.

Greedy, `ignore_eos` (the peers get `eos_token_id=-1`), so every request generates exactly its max_tokens.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from bench.serve_load import Request, Row, Timing, run_static


class ContinuousPeer:
    """A running transformers ContinuousBatchingManager; `run(work)` replays a Poisson trace through it."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.runs = 0

    def run(self, work: list[Request], name: str = "transformers continuous batching") -> Row:
        self.runs += 1
        ids = [f"run{self.runs}-{i}" for i in range(len(work))]
        t0 = time.perf_counter()

        def feed() -> None:  # each request at its arrival time, whatever is still running
            for rid, req in zip(ids, work, strict=True):
                time.sleep(max(0.0, req.arrival - (time.perf_counter() - t0)))
                self.manager.add_request(
                    req.prompt, request_id=rid, max_new_tokens=req.max_tokens, record_timestamps=True, eos_token_id=-1
                )

        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        done: dict[str, Any] = {}
        while len(done) < len(work):
            result = self.manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"transformers continuous batching failed: {result.error}")
                done[result.request_id] = result
            elif result is None and not self.manager.is_running():
                raise RuntimeError("transformers continuous batching stopped")
        feeder.join()
        timings = []
        for rid, req in zip(ids, work, strict=True):
            out = done[rid]
            stamps = [t - t0 for t in out.timestamps]
            gaps = [b - a for a, b in itertools.pairwise(stamps)]
            tokens = list(out.generated_tokens)
            timings.append(Timing(req.arrival, stamps[0], stamps[-1], 0.0, len(tokens), gaps, tokens))
        span = max(t.finish for t in timings) - min(t.sent for t in timings)
        return Row(name, timings, span, False)


@contextmanager
def continuous_peer(model: torch.nn.Module, warmup: list[Request], work: list[Request]) -> Iterator[ContinuousPeer]:
    """Start the manager, run `warmup` through it (untimed), yield it; stop it on exit. Its paged cache holds
    all of `work` at once: left to size itself, it takes 90 % of free memory (on a CPU, of the machine's RAM: a
    SmolLM2 bfloat16 run took 12.9 GB and was killed for it)."""
    config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=16)
    page = ContinuousBatchingConfig.page_size
    blocks = sum(-(-(len(r.prompt) + r.max_tokens) // page) for r in work)
    with model.continuous_batching_context_manager(  # type: ignore[operator]
        generation_config=config, block=True, timeout=10, warmup=False,
        continuous_batching_config=ContinuousBatchingConfig(num_blocks=blocks),
    ) as manager:  # fmt: skip
        peer = ContinuousPeer(manager)
        peer.run([Request(r.prompt, r.max_tokens, 0.0) for r in warmup])
        yield peer


def static(model: torch.nn.Module, work: list[Request], size: int) -> Row:
    row = run_static(model, work, size)
    if size == 1:
        row.name = "transformers one at a time, Poisson"
    return row


def reschedule_single(row: Row, work: list[Request]) -> Row:
    """One-at-a-time `row` (from `static(model, other_work, 1)`) replayed for `work`'s arrivals: the same
    requests in the same order, each generate taking what it took, started when it arrives or when the one
    before it finished (the virtual clock of serve_load.run_static with batches of one)."""
    timings, free_at, prev_finish = [], 0.0, -math.inf
    for old, req in zip(row.timings, work, strict=True):
        start_old = max(old.sent, prev_finish)  # when it started in the original replay
        prev_finish = old.finish
        start = max(req.arrival, free_at)
        free_at = start + (old.finish - start_old)
        timings.append(Timing(req.arrival, start + (old.first - start_old), free_at, 0.0, old.tokens, old.itl, old.ids))
    out = Row(row.name, timings, free_at - work[0].arrival, False)
    out.busy_tok_s = row.busy_tok_s
    return out


def agreement(ours: list[Timing], theirs: list[Timing]) -> tuple[int, int, int]:
    """(requests whose greedy outputs are identical, tokens that agree, tokens compared)."""
    same = sum(a.ids == b.ids for a, b in zip(ours, theirs, strict=True))
    agree = total = 0
    for a, b in zip(ours, theirs, strict=True):
        total += max(len(a.ids), len(b.ids))
        agree += sum(x == y for x, y in zip(a.ids, b.ids, strict=False))
    return same, agree, total
