"""Helpers for the worker tests: a real grpc.aio worker server on its own event loop in a thread (so tests
can be plain synchronous functions with module-scoped servers), and a step-at-a-time Step session."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from protos.coalesce.v1 import worker_pb2, worker_pb2_grpc
from worker.config import WorkerSettings
from worker.runner import ModelRunner
from worker.server import GRPC_OPTIONS, serve_worker

# A small cache keeps the tests fast: the builtin model on CPU, a few MiB of blocks.
TEST_SETTINGS = WorkerSettings(model="builtin", device="cpu", dtype="float32", port=0, kv_cache_mb=8, block_size=16)


class WorkerThread:
    """`serve_worker` on 127.0.0.1 with a free port, running in a background thread until `close()`."""

    def __init__(self, settings: WorkerSettings = TEST_SETTINGS, runner: ModelRunner | None = None) -> None:
        self._settings = settings.model_copy(update={"host": "127.0.0.1", "port": 0})
        self._runner = runner
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.port = 0
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout=120) or self._error is not None:
            raise RuntimeError(f"worker did not start: {self._error!r}")
        self.address = f"127.0.0.1:{self.port}"

    def _main(self) -> None:
        async def run() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            await serve_worker(self._settings, self._on_ready, self._stop, runner=self._runner)

        try:
            asyncio.run(run())
        except BaseException as e:  # reported to the constructor, which is waiting for it
            self._error = e
            self._ready.set()

    def _on_ready(self, port: int) -> None:
        self.port = port
        self._ready.set()

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address, options=GRPC_OPTIONS)

    def close(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)


class StepSession:
    """One Step stream driven a request at a time: `send(req)` returns its response or raises grpc.RpcError."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._requests: queue.Queue[worker_pb2.StepRequest | None] = queue.Queue()
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        self._responses: Iterator[worker_pb2.StepResponse] = stub.Step(self._feed(), timeout=120)
        self._step_id = 0

    def _feed(self) -> Iterator[worker_pb2.StepRequest]:
        while (req := self._requests.get()) is not None:
            yield req

    def send(self, req: worker_pb2.StepRequest | None = None, **fields: object) -> worker_pb2.StepResponse:
        if req is None:
            self._step_id += 1
            req = worker_pb2.StepRequest(step_id=self._step_id, **fields)  # type: ignore[arg-type]
        self._requests.put(req)
        return next(self._responses)

    def close(self) -> None:
        """Half-close and wait for the server to end the stream (so its session is over when this returns)."""
        self._requests.put(None)
        try:
            for _ in self._responses:
                pass
        except grpc.RpcError:
            pass  # the session already ended with an error, which the test has seen

    def __enter__(self) -> StepSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Driver:
    """A minimal scheduler for tests: hands out fresh blocks, tracks lengths, builds StepRequests.

    `send` is Engine.step (in process) or StepSession.send (over gRPC): the same driver tests both.
    """

    def __init__(self, send: Callable[[worker_pb2.StepRequest], worker_pb2.StepResponse], block_size: int) -> None:
        self.send, self.block_size = send, block_size
        self.next_block = 0
        self.length: dict[int, int] = {}  # tokens in each sequence's cache after the steps sent so far
        self.tables: dict[int, list[int]] = {}
        self.step_id = 0

    def blocks(self, seq_id: int, end: int) -> list[int]:
        """Fresh blocks so that seq_id's table covers positions [0, end)."""
        table = self.tables.setdefault(seq_id, [])
        need = -(-end // self.block_size) - len(table)
        new = list(range(self.next_block, self.next_block + max(need, 0)))
        self.next_block += len(new)
        table += new
        return new

    def prefill(
        self, seq_id: int, tokens: list[int], sampling: worker_pb2.WorkerSampling | None = None, sample: bool = True
    ) -> worker_pb2.SequenceWork:
        start = self.length.get(seq_id, 0)
        self.length[seq_id] = start + len(tokens)
        return worker_pb2.SequenceWork(
            seq_id=seq_id,
            token_ids=tokens,
            start_position=start,
            new_blocks=self.blocks(seq_id, start + len(tokens)),
            sampling=sampling,
            sample=sample,
        )

    def decode(self, seq_id: int) -> worker_pb2.SequenceWork:
        start = self.length[seq_id]
        self.length[seq_id] = start + 1
        new = self.blocks(seq_id, start + 1)
        return worker_pb2.SequenceWork(seq_id=seq_id, start_position=start, new_blocks=new, sample=True)

    def step(self, works: list[worker_pb2.SequenceWork], **fields: Any) -> worker_pb2.StepResponse:
        self.step_id += 1
        return self.send(worker_pb2.StepRequest(step_id=self.step_id, seqs=works, **fields))

    def generate(
        self, prompts: dict[int, tuple[list[int], worker_pb2.WorkerSampling]], num_tokens: int
    ) -> dict[int, list[int]]:
        """Prefill every prompt in one step, then decode all together; the sampled tokens of each sequence."""
        out: dict[int, list[int]] = {seq_id: [] for seq_id in prompts}
        resp = self.step([self.prefill(s, tokens, sampling) for s, (tokens, sampling) in prompts.items()])
        for _ in range(num_tokens):
            for t in resp.tokens:
                out[t.seq_id].append(t.token.token_id)
            if len(next(iter(out.values()))) == num_tokens:
                break
            resp = self.step([self.decode(s) for s in prompts])
        return out
