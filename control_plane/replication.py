"""The shared side of generations (DESIGN §4.7-§4.8): token logs written once per step for all requests
in one round trip, records finished with their result, leases kept alive by heartbeat, and generations
of other replicas mirrored from their logs.

Only computations this replica runs are written; `owned` says which, with their fencing (owner, epoch).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from control_plane.errors import ApiError
from control_plane.generation import Generation
from dedup_service import LogAppend, LogEntry, LogSlice, Store, StoreUnavailable
from protos.coalesce.v1 import common_pb2, inference_pb2

log = logging.getLogger(__name__)

SERVER_FAULTS = {"UNAVAILABLE", "INTERNAL", "RESOURCE_EXHAUSTED", "ABORTED", "DEADLINE_EXCEEDED"}


@dataclass(slots=True)
class Owned:
    """A request whose shared side this replica keeps, under `name` (its log and index id): usually the
    computation it runs (the generation's request id); a keyed request riding on an identical computation
    here, or a content follower that took over a lost leader's generation, under its own id."""

    name: str
    gen: Generation
    epoch: int
    key: str = ""
    content: str = ""  # fingerprint whose content lease this computation holds (cross-replica coalescing)
    write_log: bool = True  # replicated stores only: the memory store's single replica reads local views
    flushed: int = 0
    admitted: bool = False  # scheduled on a worker: the record moves INIT -> PROCESSING
    processing: bool = False
    closed: bool = False


def finish_info(gen: Generation) -> bytes:
    """The finish of a generation as a GenerateResponse (reason, usage, error text): log and record."""
    msg = inference_pb2.GenerateResponse(request_id=gen.request_id, finish_reason=gen.finish_reason)  # type: ignore[arg-type]
    msg.usage.CopyFrom(gen.usage())
    if gen.error is not None:
        msg.text = f"{gen.error.code.name}: {gen.error.message}"
    return msg.SerializeToString()


def result_of(gen: Generation, request_id: str) -> bytes:
    """The whole generation as one GenerateResponse: what a SUCCESS record replays."""
    msg = gen.chunk(0, len(gen.token_ids))
    msg.request_id = request_id
    return msg.SerializeToString()


class Replicator:
    def __init__(self, store: Store, owner: str, settings_lease_s: float, keep_s: float, retention_s: float) -> None:
        self.store = store
        self.owner = owner
        self.lease_s = settings_lease_s
        self.keep_s = keep_s
        self.retention_s = retention_s
        self.owned: dict[str, Owned] = {}  # by name
        self._dirty = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        # Called when our lease was lost to another replica's takeover: stop computing (fenced).
        self.on_fenced: Callable[[Generation], None] = lambda gen: None

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._writer()), asyncio.create_task(self._heartbeat())]

    async def stop(self) -> None:
        with contextlib.suppress(StoreUnavailable):
            await self.flush()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def own(
        self,
        gen: Generation,
        epoch: int,
        key: str,
        write_log: bool,
        name: str = "",
        content: str = "",
        flushed: int = -1,
    ) -> Owned:
        """Keep `gen`'s shared side; `flushed` is how much of it the log already has (default: all of it)."""
        name = name or gen.request_id
        done = len(gen.token_ids) if flushed < 0 else flushed
        owned = Owned(name, gen, epoch, key, content, write_log, flushed=done if write_log else 0)
        self.owned[name] = owned
        return owned

    def touch(self) -> None:
        """New tokens, an admission or a finish: the writer flushes at its next turn."""
        self._dirty.set()

    async def _writer(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await self.flush()
            except StoreUnavailable as exc:
                log.warning("token log flush failed, will retry: %s", exc)
                await asyncio.sleep(0.2)
                self._dirty.set()

    async def flush(self) -> None:
        """One append_many for every owned log with new tokens, then the records of what finished."""
        pending = [o for o in self.owned.values() if o.write_log and len(o.gen.token_ids) > o.flushed]
        if pending:
            appends = [LogAppend(o.name, self.owner, o.epoch, o.flushed, _entries(o)) for o in pending]
            ends = [len(o.gen.token_ids) for o in pending]
            for o, ok, end in zip(pending, await self.store.append_many(appends), ends, strict=True):
                if ok:
                    o.flushed = end
                else:  # another replica took over (or the log expired): we are fenced out
                    self._fence(o)
        for o in list(self.owned.values()):
            if o.key and o.admitted and not o.processing:
                o.processing = True
                await self.store.mark_processing(o.gen.tenant, o.key, self.owner, o.epoch)
            if o.gen.done and (not o.write_log or o.flushed == len(o.gen.token_ids)) and not o.closed:
                await self._close(o)

    async def _close(self, o: Owned) -> None:
        gen = o.gen
        if o.write_log:
            failed = gen.finish_reason == inference_pb2.FINISH_REASON_ERROR
            await self.store.finish(o.name, self.owner, o.epoch, finish_info(gen), self.keep_s, failed)
        if o.content:
            await self.store.release_content(gen.tenant, o.content, o.name)
        if o.key:
            if gen.finish_reason in (inference_pb2.FINISH_REASON_STOP, inference_pb2.FINISH_REASON_LENGTH):
                await self.store.succeed(
                    gen.tenant, o.key, self.owner, o.epoch, result_of(gen, o.name), self.retention_s
                )
            else:
                await self.store.fail(
                    gen.tenant,
                    o.key,
                    self.owner,
                    o.epoch,
                    _error_text(gen),
                    self.retention_s,
                    retryable=_retryable(gen.error),
                )
        o.closed = True
        del self.owned[o.name]

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            for o in [o for o in self.owned.values() if not o.gen.done]:
                with contextlib.suppress(StoreUnavailable):
                    if o.key and not await self.store.renew(o.gen.tenant, o.key, self.owner, o.epoch, self.lease_s):
                        self._fence(o)
                    elif o.content:
                        await self.store.renew_content(o.gen.tenant, o.content, o.name, self.lease_s)

    def _fence(self, o: Owned) -> None:
        log.warning("request %s: fenced out (epoch %d is stale); stopping it here", o.gen.request_id, o.epoch)
        self.owned.pop(o.name, None)
        o.closed = True
        self.on_fenced(o.gen)


def _entries(o: Owned) -> list[LogEntry]:
    gen = o.gen
    return [
        LogEntry(gen.token_ids[i], gen.texts[i], lp.SerializeToString() if (lp := gen.logprobs[i]) else b"")
        for i in range(o.flushed, len(gen.token_ids))
    ]


def _error_text(gen: Generation) -> str:
    if gen.error is not None:
        return f"{gen.error.code.name}: {gen.error.message}"
    return "CANCELLED: the generation was cancelled"


def _retryable(error: ApiError | None) -> bool:
    """A failure that is the server's fault releases the key, so a retry runs again (DESIGN §4.2)."""
    return error is None or error.code.name in SERVER_FAULTS


def apply_slice(gen: Generation, piece: LogSlice) -> None:
    """Append a log slice to a mirrored generation (and finish it when the log is closed)."""
    for entry in piece.entries:
        lp = common_pb2.TokenLogprob.FromString(entry.logprob) if entry.logprob else None
        gen.append(entry.token_id, entry.text, lp)


def parse_finish(info: bytes) -> inference_pb2.GenerateResponse:
    return inference_pb2.GenerateResponse.FromString(info)
