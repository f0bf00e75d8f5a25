"""Quantized weights (`--weights auto`, worker/quant_linear.py) through a real control plane and a real SmolLM2
worker: a chat question gets its real answer, concurrent requests decode through the one-call decode step
(worker/quant_decode.py), every request completes and no block is left held."""

from __future__ import annotations

import asyncio
from pathlib import Path

from test_step_failure import control_plane

from clients.aio import AsyncCoalesceClient
from clients.types import chat_messages
from tests.worker.test_decode_step import Counting
from worker.config import WorkerSettings
from worker.engine import Engine
from worker.runner import ModelRunner
from worker.server import serve_worker


async def test_smollm2_with_auto_weights_answers_and_decodes_in_one_call(smollm2_cache: Path) -> None:
    settings = WorkerSettings(
        model="smollm2", device="cpu", dtype="float32", weights="auto", host="127.0.0.1", port=0,
        kv_cache_mb=64, cache_dir=str(smollm2_cache),
    )  # fmt: skip
    runner = await asyncio.to_thread(ModelRunner.from_settings, settings)
    assert runner.decode_step is not None
    count = Counting(runner.decode_step)
    runner.decode_step = count  # type: ignore[assignment]
    stop = asyncio.Event()
    port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    worker = asyncio.create_task(serve_worker(settings, port.set_result, stop, engine=Engine(runner)))
    up, cp_stop, control = await control_plane(f"127.0.0.1:{await port}")
    try:
        async with AsyncCoalesceClient(up.address, timeout=120) as client:
            question = chat_messages([("user", "What is the capital of Japan?")])
            answer = await client.generate(question, max_tokens=16).result()
            assert "Tokyo" in answer.text
            calls = [client.generate(f"Count to ten, take {i}:", max_tokens=24, ignore_eos=True) for i in range(8)]
            results = await asyncio.gather(*(c.result() for c in calls))
        assert all(len(r.token_ids) == 24 for r in results)
        assert count.calls >= 24  # decode steps ran in one call each
        scheduler = up.dispatcher.links[0].scheduler
        assert scheduler is not None and not scheduler.seqs and scheduler.bm.num_used == 0
    finally:
        cp_stop.set()
        stop.set()
        await asyncio.gather(control, worker)
