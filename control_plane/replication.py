"""The journal: the shared side of the generations this replica computes (docs/architecture.md, "Fencing").

Token logs are written once per step for all of them in one round trip, records are finished with their
result, leases are renewed, and this replica's liveness is beaten into the store. Every write names (owner,
epoch). A refused write means one of two things: the store lost the request (Redis restarted without
persistence), and then it is claimed again at a new epoch and its whole log rewritten, so the computation
goes on unseen by its callers; or another replica owns it now, and it is returned as fenced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from control_plane.config import Settings
from control_plane.errors import ApiError
from control_plane.generation import Generation
from dedup_service import LogAppend, LogEntry, Outcome, Store, StoreUnavailable
from protos.coalesce.v1 import inference_pb2

log = logging.getLogger(__name__)

SERVER_FAULTS = {"UNAVAILABLE", "INTERNAL", "RESOURCE_EXHAUSTED", "ABORTED", "DEADLINE_EXCEEDED"}
SUCCEEDED = (inference_pb2.FINISH_REASON_STOP, inference_pb2.FINISH_REASON_LENGTH)


@dataclass(slots=True)
class Owned:
    """A generation whose shared side this replica keeps, under `name` (its log and index id): usually the
    computation's own request id; a keyed request riding on an identical computation here, or a content
    follower that took over a lost leader's generation, keeps it under its own id."""

    name: str
    gen: Generation
    epoch: int
    key: str  # its idempotency record, "" when none
    content: str  # fingerprint whose content lease it holds, "" when none
    log: bool  # write its token log (shared stores only: with one replica the generations are the log)
    flushed: int  # tokens the log has
    fingerprint: str = ""  # with `payload`: what claiming it again takes, should the store lose it
    payload: bytes = b""
    processing: bool = False  # its record moved INIT -> PROCESSING


def finish_info(gen: Generation) -> bytes:
    """The finish of a generation as a GenerateResponse (reason, usage, error text): log and record."""
    msg = inference_pb2.GenerateResponse(request_id=gen.request_id, finish_reason=gen.finish_reason)  # type: ignore[arg-type]
    msg.usage.CopyFrom(gen.usage())
    if gen.error is not None:
        msg.text = str(gen.error)  # "CODE: message", as errors.stored_error reads it back
    return msg.SerializeToString()


class Replicator:
    def __init__(self, store: Store, owner: str, settings: Settings) -> None:
        self.store = store
        self.owner = owner
        self.lease_s = settings.lease_s
        self.keep_s = settings.resume_grace_s
        self.retention_s = settings.idempotency_retention_s
        self.owned: dict[tuple[str, str], Owned] = {}  # by (tenant, name)
        self._dirty = asyncio.Event()
        # The flush and the renewal both reclaim what the store refused; one at a time, so the second sees
        # the epoch the first claimed (as its own), not a record of "another replica".
        self._reclaiming = asyncio.Lock()

    def own(
        self,
        gen: Generation,
        *,
        name: str = "",
        epoch: int = 1,
        key: str = "",
        content: str = "",
        log: bool = True,
        flushed: int | None = None,
        fingerprint: str = "",
        payload: bytes = b"",
    ) -> None:
        """Keep `gen`'s shared side; `flushed` is how much of it the log already has (default: all of it)."""
        name = name or gen.request_id
        done = (len(gen.token_ids) if flushed is None else flushed) if log else 0
        self.owned[(gen.tenant, name)] = Owned(name, gen, epoch, key, content, log, done, fingerprint, payload)
        self._dirty.set()

    def held(self, tenant: str, name: str) -> Owned | None:
        """What this replica keeps of `name`'s shared side, if anything."""
        return self.owned.get((tenant, name))

    def touch(self) -> None:
        """Generations changed (tokens, an admission, a finish): flush at the next turn, if any is ours."""
        if self.owned:
            self._dirty.set()

    async def changed(self) -> None:
        """Wait for a touch."""
        await self._dirty.wait()
        self._dirty.clear()

    async def flush(self) -> list[Owned]:
        """One append_many for every owned log with new tokens, then the records of what was admitted or
        finished. Returns what was fenced out (another replica owns it now)."""
        fenced: list[Owned] = []
        pending = [o for o in self.owned.values() if o.log and len(o.gen.token_ids) > o.flushed]
        if pending:
            ends = [len(o.gen.token_ids) for o in pending]
            appends = [
                LogAppend(o.gen.tenant, o.name, self.owner, o.epoch, o.flushed, _entries(o, end))
                for o, end in zip(pending, ends, strict=True)
            ]
            for o, ok, end in zip(pending, await self.store.append_many(appends), ends, strict=True):
                if ok:
                    o.flushed = end
                elif await self._reclaim(o):
                    self._dirty.set()  # its log starts again from token 0 at the next turn
                else:
                    fenced.append(self._fence(o))
        for o in list(self.owned.values()):
            if o.key and o.gen.admitted and not o.processing:
                o.processing = True
                await self.store.mark_processing(o.gen.tenant, o.key, self.owner, o.epoch)
            closing = o.gen.done and (not o.log or o.flushed == len(o.gen.token_ids))
            if closing and self.owned.get((o.gen.tenant, o.name)) is o:
                await self._close(o)
        return fenced

    async def renew(self) -> list[Owned]:
        """Say this replica is alive and extend the leases of every running generation; returns what was
        fenced out."""
        with contextlib.suppress(StoreUnavailable):
            await self.store.heartbeat(self.owner, self.lease_s)
        fenced = []
        for o in [o for o in self.owned.values() if not o.gen.done]:
            try:
                tenant = o.gen.tenant
                if o.key and not await self.store.renew(tenant, o.key, self.owner, o.epoch, self.lease_s):
                    if await self._reclaim(o):
                        self._dirty.set()
                    else:
                        fenced.append(self._fence(o))
                elif o.content and not await self.store.renew_content(tenant, o.content, o.name, self.lease_s):
                    claim = await self.store.claim_content(tenant, o.content, o.name, self.owner, self.lease_s)
                    o.content = o.content if claim.leader else ""  # another identical request leads now
            except StoreUnavailable:
                continue  # the lease may still hold; try again at the next beat
        return fenced

    async def _reclaim(self, o: Owned) -> bool:
        """The store refused a write of ours. When it lost the request altogether (a Redis restart without
        persistence), claim it again at a new epoch and rewrite its log from token 0: True. When the request is
        still ours at our epoch, the log was refused at its offset (it lost tokens, or never had all that a
        takeover took for written): rewrite it from what it holds: True. False when another replica holds it
        now (a takeover, or a caller's retry that claimed the lost key)."""
        async with self._reclaiming:
            return await self._reclaim_alone(o)

    async def _reclaim_alone(self, o: Owned) -> bool:
        tenant, store = o.gen.tenant, self.store
        if o.key:
            record = await store.get(tenant, o.key)
            if record is not None:
                return (record.owner, record.epoch) == (self.owner, o.epoch) and await self._resync(o)
            if not o.fingerprint:
                return False
            res = await store.claim(tenant, o.key, self.owner, o.fingerprint, o.name, self.lease_s, payload=o.payload)
            if res.outcome is not Outcome.CLAIMED or res.record is None:
                return False
            o.epoch, o.processing = res.record.epoch, False
        else:
            info = await store.lookup_request(tenant, o.name)
            if info is not None:
                return (info.owner, info.epoch) == (self.owner, o.epoch) and await self._resync(o)
            if not await store.start_request(tenant, o.name, self.owner, payload=o.payload):
                return False
            o.epoch = 1
        log.warning("request %s: the store had lost it; claimed again at epoch %d", o.name, o.epoch)
        o.flushed = 0
        return True

    async def _resync(self, o: Owned) -> bool:
        """Continue `o`'s log from the tokens it holds (False when it holds more than the generation)."""
        held = 0
        while (piece := await self.store.read(o.gen.tenant, o.name, held)) is not None and piece.entries:
            held = piece.next_offset
        if piece is None or held > len(o.gen.token_ids):
            return False
        log.warning("request %s: its log holds %d of %d tokens; writing it on from there", o.name, held, o.flushed)
        o.flushed = held
        return True

    async def _close(self, o: Owned) -> None:
        gen = o.gen
        if o.log:
            failed = gen.finish_reason == inference_pb2.FINISH_REASON_ERROR
            await self.store.finish(gen.tenant, o.name, self.owner, o.epoch, finish_info(gen), self.keep_s, failed)
        if o.content:
            await self.store.release_content(gen.tenant, o.content, o.name)
        if o.key:
            if gen.finish_reason in SUCCEEDED:
                result = gen.chunk(0, len(gen.token_ids))
                result.request_id = o.name
                await self.store.succeed(
                    gen.tenant, o.key, self.owner, o.epoch, result.SerializeToString(), self.retention_s
                )
            else:
                error = str(gen.error) if gen.error is not None else "CANCELLED: the generation was cancelled"
                await self.store.fail(
                    gen.tenant, o.key, self.owner, o.epoch, error, self.retention_s, _retryable(gen.error)
                )
        del self.owned[(o.gen.tenant, o.name)]

    def _fence(self, o: Owned) -> Owned:
        self.owned.pop((o.gen.tenant, o.name), None)
        return o


def _entries(o: Owned, end: int) -> list[LogEntry]:
    gen = o.gen
    return [
        LogEntry(gen.token_ids[i], gen.texts[i], lp.SerializeToString() if (lp := gen.logprobs[i]) else b"")
        for i in range(o.flushed, end)
    ]


def _retryable(error: ApiError | None) -> bool:
    """A failure that is the server's fault releases the key, so a retry runs again."""
    return error is None or error.code.name in SERVER_FAULTS
