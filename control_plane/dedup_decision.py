"""The dedup decision: for one request, replay a stored result, attach to a computation running here,
follow another replica's, or lead (compute it). See docs/architecture.md, "The dedup decision".

`Decider.decide` asks the store what it must (claims are the decision: a CLAIMED key is ours) and this
replica's registry what runs here; it changes nothing else. Acting on the answer is control_plane.dedup's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from control_plane.errors import ApiError, id_in_use, key_reused, stored_error
from control_plane.generation import View
from control_plane.request import Request
from dedup_service import ClaimResult, ContentClaim, Outcome, Record, Store, StoreUnavailable, batch_key
from protos.coalesce.v1 import inference_pb2

COALESCED, REPLAYED = inference_pb2.DEDUP_OUTCOME_COALESCED, inference_pb2.DEDUP_OUTCOME_REPLAYED
Report = tuple[str, str] | None  # (kind, outcome) for telemetry: kind idempotency|content


@dataclass(frozen=True, slots=True)
class Replay:
    """The key succeeded before: replay its stored result."""

    record: Record
    report: Report = ("idempotency", "replayed")


@dataclass(frozen=True, slots=True)
class Attach:
    """Read a computation that runs here, as `view_id`. With `ride_epoch`, the request's own idempotency
    record (claimed at that epoch) is finished with that computation's result."""

    target: View
    view_id: str
    outcome: int
    report: Report
    ride_epoch: int = 0


@dataclass(frozen=True, slots=True)
class Follow:
    """Read another replica's computation from its token log `log_id`, as `view_id`. With `key`, take it over
    when the key's lease expires; with `content`, a content follower takes over as itself."""

    log_id: str
    view_id: str
    report: Report
    key: str = ""
    content: bool = False


@dataclass(frozen=True, slots=True)
class Lead:
    """Compute it here. `key`/`epoch`: the idempotency record we hold; `content`: the content lease we hold;
    `log`: write the token log (resumable on any replica); `takeover`: continue a dead owner's record."""

    report: Report = None
    epoch: int = 1
    key: str = ""
    content: str = ""
    log: bool = False
    takeover: Record | None = None

    @property
    def shared(self) -> bool:
        """Whether the journal keeps anything for it."""
        return bool(self.key or self.content or self.log)


@dataclass(frozen=True, slots=True)
class Refuse:
    error: ApiError
    report: Report = None


Decision = Replay | Attach | Follow | Lead | Refuse

CONTENT_COALESCED: Report = ("content", "coalesced")


class Registry(Protocol):
    """What runs on this replica (control_plane.dispatcher.Dispatcher)."""

    def find(self, tenant: str, request_id: str) -> View | None: ...

    def leader(self, request: Request) -> View | None: ...


class Decider:
    def __init__(self, store: Store, registry: Registry, owner: str, lease_s: float) -> None:
        self.store = store
        self.registry = registry
        self.owner = owner
        self.lease_s = lease_s

    async def decide(self, request: Request) -> Decision:
        """Raises StoreUnavailable when the store cannot answer a keyed request."""
        return await (self._keyed(request) if request.key else self._unkeyed(request))

    async def _unkeyed(self, request: Request) -> Decision:
        if self.registry.find(request.tenant, request.request_id) is not None:  # keyed ones leave this to the store
            return Refuse(id_in_use(request.request_id))
        leader = self.registry.leader(request)
        if leader is not None:
            return Attach(leader, request.request_id, COALESCED, CONTENT_COALESCED)
        content = ""
        if self.store.shared and request.shareable:  # an identical request may run on another replica
            try:  # lead the content key, or learn who does
                claim: ContentClaim | None = await self.store.claim_content(
                    request.tenant, request.fingerprint, request.request_id, self.owner, self.lease_s
                )
            except StoreUnavailable:
                claim = None  # the request runs alone
            if claim is not None and not claim.leader:
                here = self.registry.find(request.tenant, claim.request_id)
                if here is not None and not here.done:  # it raced us here: read it directly
                    return Attach(here, request.request_id, COALESCED, CONTENT_COALESCED)
                return Follow(claim.request_id, request.request_id, CONTENT_COALESCED, content=True)
            content = request.fingerprint if claim is not None else ""
        indexed = False
        if self.store.shared:  # so that any replica can resume it
            try:
                started = await self.store.start_request(
                    request.tenant, request.request_id, self.owner, payload=request.payload
                )
                if not started:
                    return Refuse(id_in_use(request.request_id))
                indexed = True
            except StoreUnavailable:
                pass  # it runs unindexed: no duplicate can follow from that, only no cross-replica resume
        return Lead(("content", "miss"), content=content, log=indexed)

    async def _keyed(self, request: Request) -> Decision:
        res = await self.store.claim(
            request.tenant,
            request.key,
            self.owner,
            request.fingerprint,
            request.request_id,
            self.lease_s,
            payload=request.payload,
        )
        if res.outcome is Outcome.CLAIMED:
            epoch = res.record.epoch if res.record else 1
            leader = None if self.store.shared else self.registry.leader(request)
            if leader is not None:  # an identical computation runs here: ride on it, keep our record
                return Attach(leader, request.request_id, COALESCED, CONTENT_COALESCED, ride_epoch=epoch)
            return Lead(("idempotency", "miss"), epoch=epoch, key=request.key, log=self.store.shared)
        return self._held(res, f"idempotency key {request.key!r}", request.request_id)

    def _held(self, res: ClaimResult, what: str, request_id: str) -> Decision:
        """Any other claim outcome: the key is held by a run, a result, or another payload."""
        record = res.record
        if record is None or res.outcome is Outcome.REQUEST_ID_IN_USE:
            return Refuse(id_in_use(request_id))
        match res.outcome:
            case Outcome.ATTACH:
                here = self.registry.find(record.tenant, record.request_id)
                if here is None:
                    return Follow(record.request_id, record.request_id, ("idempotency", "coalesced"), key=record.key)
                # Finished here a moment ago, its SUCCESS not yet written: a replay from memory.
                done = here.gen.done
                report = ("idempotency", "replayed" if done else "coalesced")
                return Attach(here, record.request_id, REPLAYED if done else COALESCED, report)
            case Outcome.TAKEOVER:
                return Lead(("idempotency", "takeover"), epoch=record.epoch, key=record.key, takeover=record)
            case Outcome.REPLAY:
                return Replay(record)
            case Outcome.REPLAY_ERROR:
                return Refuse(stored_error(record.error), ("idempotency", "replayed"))
            case _:
                return Refuse(key_reused(what))

    async def decide_item(self, request: Request, batch_id: str, seq_id: str) -> Decision | None:
        """A batch item: run it unless it succeeded or runs already (None). An item that failed by its own
        request's fault runs again: its record is purged and claimed anew."""
        for _ in range(2):
            res = await self.store.claim_item(
                request.tenant,
                batch_id,
                seq_id,
                self.owner,
                request.fingerprint,
                request.request_id,
                self.lease_s,
                payload=request.payload,
            )
            if res.outcome is Outcome.REPLAY_ERROR:
                await self.store.purge(request.tenant, batch_key(batch_id, seq_id))
                continue
            if res.outcome is Outcome.CLAIMED and res.record is not None:
                return Lead(epoch=res.record.epoch, key=res.record.key, log=self.store.shared)
            if res.outcome in (Outcome.TAKEOVER, Outcome.KEY_REUSED):
                return self._held(res, f"batch {batch_id!r} item {seq_id!r}", request.request_id)
            return None  # SUCCESS or running
        return None
