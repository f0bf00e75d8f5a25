"""Full-precision tails (docs/kv_cache.md) through a real control plane and a real int8 worker: every sequence
the worker sees first gets kv_tail_blocks blocks of its own, under load that preempts (so tails are freed and
given again on recompute), with prefix hits; every request completes, and no block is left held. With dense
weights and with int4 ones, whose decode steps read and write the tails in one C++ call."""

from __future__ import annotations

import asyncio

import pytest
from test_step_failure import control_plane

from clients.aio import AsyncCoalesceClient
from protos.coalesce.v1 import worker_pb2
from tests.worker.test_decode_step import Counting
from worker.config import WorkerSettings
from worker.engine import Engine
from worker.runner import ModelRunner
from worker.server import serve_worker


class RecordingEngine(Engine):
    """The real engine; records each first-sight sequence's tail blocks, and the blocks it holds besides."""

    tails: list[list[int]]
    clashes: int = 0

    def step(self, req: worker_pb2.StepRequest) -> worker_pb2.StepResponse:
        resp = super().step(req)
        for work in req.seqs:
            if work.HasField("sampling"):
                self.tails.append(list(work.tail_blocks))
        held = [b for s in self.seqs.values() for b in s.block_table + s.tail]
        shared = {b for s in self.seqs.values() for b in s.block_table}  # prefix blocks may be shared ...
        self.clashes += sum(1 for s in self.seqs.values() for b in s.tail if held.count(b) > 1 or b in shared)
        return resp  # ... a tail block never is


@pytest.mark.parametrize("weights", ["dense", "int4"])  # int4: decode steps in one call (worker/quant_decode.py)
async def test_int8_tails_under_preemption_and_prefix_hits(weights: str) -> None:
    # 1 MiB of int8 KV: 124 blocks, 49 for the interactive pool; 16 requests of ~4-6 blocks + a 2-block tail.
    settings = WorkerSettings(
        model="builtin", device="cpu", dtype="float32", host="127.0.0.1", port=0, kv_cache_mb=1,
        kv_cache_dtype="int8", weights=weights,  # type: ignore[arg-type]
    )  # fmt: skip
    runner = await asyncio.to_thread(ModelRunner.from_settings, settings)
    count = None if runner.decode_step is None else Counting(runner.decode_step)
    runner.decode_step = count  # type: ignore[assignment]
    assert (count is not None) == (weights == "int4")
    engine = RecordingEngine(runner)
    engine.tails = []
    stop = asyncio.Event()
    port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    worker = asyncio.create_task(serve_worker(settings, port.set_result, stop, engine=engine))
    up, cp_stop, control = await control_plane(f"127.0.0.1:{await port}")
    try:
        shared = "a shared opening that spans more than two blocks of sixteen tokens each " * 2
        async with AsyncCoalesceClient(up.address, timeout=120) as client:
            calls = [
                client.generate(f"{shared if i % 2 else ''}request {i}", max_tokens=40, ignore_eos=True).result()
                for i in range(16)
            ]
            results = await asyncio.gather(*calls)
        assert all(len(r.token_ids) == 40 for r in results)
        scheduler = up.dispatcher.links[0].scheduler
        assert scheduler is not None and not scheduler.seqs and scheduler.bm.num_used == 0
        assert scheduler.bm.hits > 0  # the shared opening was served from the cache
        assert len(engine.tails) > 16  # preemptions: recomputed sequences were seen again, with new tails
        assert all(len(t) == 2 for t in engine.tails) and engine.clashes == 0
        assert count is None or count.calls > 0
    finally:
        cp_stop.set()
        stop.set()
        await asyncio.gather(control, worker)
