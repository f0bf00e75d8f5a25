"""Dedup decisions (DESIGN §4.2-§4.3, §4.9): idempotency keys through the store, identical in-flight
requests coalesced, results replayed, resumes served on any replica, takeovers of a dead owner's work.

Every decision is reported to the observer (telemetry) and, as the dedup outcome, to the caller.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable

import grpc

from control_plane.admission import build_spec
from control_plane.config import Settings
from control_plane.dispatcher import Dispatcher, GenerationSpec
from control_plane.errors import ApiError, invalid, not_found, store_down
from control_plane.generation import Generation, View
from control_plane.observer import Observer
from control_plane.replication import Replicator, apply_slice, parse_finish
from control_plane.sequence import Sequence
from dedup_service import (
    BATCH_KEY_PREFIX,
    ContentClaim,
    Outcome,
    Record,
    State,
    Store,
    StoreUnavailable,
    fingerprint,
)
from dedup_service.memory import MemoryStore
from protos.coalesce.v1 import inference_pb2

log = logging.getLogger(__name__)

MISS, COALESCED = inference_pb2.DEDUP_OUTCOME_MISS, inference_pb2.DEDUP_OUTCOME_COALESCED
REPLAYED, TAKEOVER = inference_pb2.DEDUP_OUTCOME_REPLAYED, inference_pb2.DEDUP_OUTCOME_TAKEOVER
TAIL_S = 1.0
LOG_WAIT_S = 0.02


def new_owner() -> str:
    """Unique per process: fencing tells replicas (and restarts of one) apart."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def request_fingerprint(spec: GenerationSpec, request: inference_pb2.GenerateRequest, model: str) -> str:
    """Identity of what the caller asked for: the caller's sampling (their seed, not the worker's noise seed)."""
    s = request.sampling
    sampling = {
        "temperature": float(s.temperature),
        "top_p": float(s.top_p or 1.0),
        "top_k": int(s.top_k),
        "seed": int(s.seed) if s.HasField("seed") else None,
        "max_tokens": spec.max_tokens,
        "ignore_eos": bool(s.ignore_eos),
        "logprobs": int(s.logprobs),
    }
    return fingerprint(spec.tenant, model, spec.prompt_ids, sampling, list(s.stop), list(s.stop_token_ids))


def deterministic(request: inference_pb2.GenerateRequest) -> bool:
    return request.sampling.temperature == 0 or request.sampling.HasField("seed")


class Deduper(Observer):
    """Admits requests through the store; also an Observer, to keep the shared side in step."""

    def __init__(self, dispatcher: Dispatcher, store: Store, settings: Settings, owner: str | None = None) -> None:
        self.d = dispatcher
        self.store = store
        self.settings = settings
        self.owner = owner or new_owner()
        self.replicated = not isinstance(store, MemoryStore)
        self.replicator = Replicator(
            store, self.owner, settings.lease_s, settings.resume_grace_s, settings.idempotency_retention_s
        )
        self.replicator.on_fenced = lambda gen: self.d.abort(gen, inference_pb2.FINISH_REASON_CANCELLED)
        self.leaders: dict[tuple[str, str], View] = {}  # in-flight content leaders on this replica
        self._mirrors: dict[str, View] = {}  # generations of other replicas followed from their logs
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def report(self) -> Callable[[str, str, str], None]:
        return self.d.observer.on_dedup

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> None:
        self.replicator.start()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.replicator.stop()

    # -- Generate ----------------------------------------------------------------------------------------
    async def generate(
        self, request: inference_pb2.GenerateRequest, tenant: str, key: str, traceparent: str = "", prefix: str = ""
    ) -> View:
        d = self.d
        assert d.tokenizer is not None and d.limits is not None
        spec = build_spec(request, tenant, d.tokenizer, d.limits, self.settings, traceparent=traceparent, prefix=prefix)
        try:
            if key:
                if key.startswith(BATCH_KEY_PREFIX):
                    raise invalid("idempotency_key", f"keys starting with {BATCH_KEY_PREFIX!r} are reserved")
                return await self._keyed(spec, request, key)
            return await self._unkeyed(spec, request)
        except StoreUnavailable as exc:
            if self.settings.dedup_fail_open:
                log.warning("store down, serving without dedup (fail-open): %s", exc)
                return d.submit(spec)
            raise store_down(exc) from None

    async def _unkeyed(self, spec: GenerationSpec, request: inference_pb2.GenerateRequest) -> View:
        if spec.request_id in self.d.views:  # keyed requests leave this to the store (a retry keeps its id)
            raise id_in_use(spec.request_id)
        leader = self._leader(spec, request)
        if leader is not None:
            self.report("content", "coalesced", spec.request_id)
            return self.d.join(leader, spec.request_id, COALESCED)
        content = self._content_key(spec, request)
        fp = ""
        if self.replicated and content is not None:  # an identical request may run on another replica
            claim = await self._claim_content(spec, content[1])
            if claim is not None and not claim.leader:
                return await self._follow_remote(spec, claim.request_id, content[1])
            fp = content[1] if claim is not None else ""
        indexed = self.replicated and await self._index(spec)
        view = self.d.submit(spec)
        if indexed or fp:  # nothing shared to keep otherwise: stay off the per-step flush
            self.replicator.own(view.gen, 1, "", indexed, content=fp)
        self._lead(spec, request, view)
        self.report("content", "miss", spec.request_id)
        return view

    async def _claim_content(self, spec: GenerationSpec, fp: str) -> ContentClaim | None:
        """Lead the content key, or learn who does; None with the store down (the request runs alone)."""
        try:
            return await self.store.claim_content(spec.tenant, fp, spec.request_id, self.owner, self.settings.lease_s)
        except StoreUnavailable as exc:
            log.warning("request %s runs without content dedup, the store is down: %s", spec.request_id, exc)
            return None

    async def _follow_remote(self, spec: GenerationSpec, leader_id: str, fp: str) -> View:
        """Read an identical request that another replica computes, from its log, under our own request id."""
        local = self.d.views.get(leader_id)
        if local is not None and not local.done:  # it raced us here: read it directly, not through the store
            self.report("content", "coalesced", spec.request_id)
            return self.d.join(local, spec.request_id, COALESCED)
        mirror = await self._mirror(leader_id, spec.tenant, "", fallback=(spec, fp))
        mirror.gen.interest += 1
        self.report("content", "coalesced", spec.request_id)
        return self.d.add_view(View(spec.request_id, mirror.gen, COALESCED))

    def _content_key(self, spec: GenerationSpec, request: inference_pb2.GenerateRequest) -> tuple[str, str] | None:
        """Identical in-flight requests share a computation when their sampling is deterministic."""
        if request.dedup == inference_pb2.DEDUP_POLICY_OFF or not deterministic(request):
            return None
        return spec.tenant, request_fingerprint(spec, request, self.d.info.model_name)

    def _leader(self, spec: GenerationSpec, request: inference_pb2.GenerateRequest) -> View | None:
        key = self._content_key(spec, request)
        leader = self.leaders.get(key) if key else None
        return leader if leader is not None and not leader.gen.done else None

    def _lead(self, spec: GenerationSpec, request: inference_pb2.GenerateRequest, view: View) -> None:
        key = self._content_key(spec, request)
        if key is not None:
            self.leaders[key] = view

    async def _index(self, spec: GenerationSpec) -> bool:
        """Register a keyless request so any replica can resume it. With the store down it still runs (no
        duplicate can follow from that), only without cross-replica resume."""
        try:
            taken = not await self.store.start_request(spec.tenant, spec.request_id, self.owner)
        except StoreUnavailable as exc:
            log.warning("request %s runs unindexed, the store is down: %s", spec.request_id, exc)
            return False
        if taken:
            raise id_in_use(spec.request_id)
        return True

    async def _keyed(self, spec: GenerationSpec, request: inference_pb2.GenerateRequest, key: str) -> View:
        fp = request_fingerprint(spec, request, self.d.info.model_name)
        claimed = inference_pb2.GenerateRequest()
        claimed.CopyFrom(request)
        claimed.request_id = spec.request_id
        res = await self.store.claim(
            spec.tenant,
            key,
            self.owner,
            fp,
            spec.request_id,
            self.settings.lease_s,
            payload=claimed.SerializeToString(),
        )
        record = res.record
        match res.outcome:
            case Outcome.CLAIMED:
                epoch = record.epoch if record else 1
                leader = self._leader(spec, request) if not self.replicated else None
                if leader is not None:  # an identical computation runs here: ride on it, keep our record
                    self.replicator.own(leader.gen, epoch, key, False, name=spec.request_id)
                    self.report("content", "coalesced", spec.request_id)
                    return self.d.join(leader, spec.request_id, COALESCED)
                view = self.d.submit(spec)
                self.replicator.own(view.gen, epoch, key, self.replicated)
                self._lead(spec, request, view)
                self.report("idempotency", "miss", spec.request_id)
                return view
            case Outcome.ATTACH:
                assert record is not None
                return await self._attach(record, spec.tenant)
            case Outcome.TAKEOVER:
                assert record is not None
                self.report("idempotency", "takeover", record.request_id)
                return await self._take_over(record)
            case Outcome.REPLAY:
                assert record is not None
                self.report("idempotency", "replayed", record.request_id)
                return replay_view(record, spec.tenant)
            case Outcome.REPLAY_ERROR:
                assert record is not None
                self.report("idempotency", "replayed", record.request_id)
                raise stored_error(record.error)
            case Outcome.KEY_REUSED:
                raise ApiError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"idempotency key {key!r} was used for another request payload",
                    "IDEMPOTENCY_KEY_REUSED",
                )
            case _:
                raise id_in_use(spec.request_id)

    async def _attach(self, record: Record, tenant: str) -> View:
        """Read the running request from offset 0: locally when it runs here, else from its log."""
        local = self.d.views.get(record.request_id)
        if local is not None:
            local.gen.interest += 1
            # Finished here a moment ago, its SUCCESS not yet written: a replay from memory.
            replayed = local.gen.done
            self.report("idempotency", "replayed" if replayed else "coalesced", record.request_id)
            return View(record.request_id, local.gen, REPLAYED if replayed else COALESCED)
        self.report("idempotency", "coalesced", record.request_id)
        mirror = await self._mirror(record.request_id, tenant, record.key)
        mirror.gen.interest += 1
        return View(record.request_id, mirror.gen, COALESCED)

    async def _take_over(self, record: Record) -> View:
        """Our claim holds a new epoch: continue the generation from its logged tokens (re-prefill)."""
        request = inference_pb2.GenerateRequest.FromString(record.payload)
        d = self.d
        assert d.tokenizer is not None and d.limits is not None
        spec = build_spec(request, record.tenant, d.tokenizer, d.limits, self.settings, request_id=record.request_id)
        gen = self._mirrors.pop(record.request_id).gen if record.request_id in self._mirrors else None
        if gen is None:
            gen = Generation(record.request_id, record.tenant, prompt_tokens=len(spec.prompt_ids))
        await self._catch_up(gen)
        d.views.pop(record.request_id, None)
        view = d.submit(spec, gen, TAKEOVER)
        self.replicator.own(gen, record.epoch, record.key, self.replicated)
        return view

    async def _catch_up(self, gen: Generation, source: str = "") -> None:
        """Read what the log (`source`, default the generation's own) has beyond the tokens `gen` holds."""
        while True:
            piece = await self.store.read(source or gen.request_id, len(gen.token_ids))
            if piece is None or not piece.entries:
                return
            apply_slice(gen, piece)

    # -- Resume ------------------------------------------------------------------------------------------
    async def resume(self, request_id: str, offset: int, tenant: str) -> View:
        if not request_id:
            raise invalid("request_id", "must not be empty")
        view = self.d.views.get(request_id)
        if view is None and self.replicated:
            view = await self._remote(request_id, tenant)
        if view is None or view.tenant != tenant:
            raise not_found(f"request {request_id!r} is unknown or expired")
        if offset > len(view.gen.token_ids) and view.gen.done:
            raise invalid("offset", f"{offset} is beyond the {len(view.gen.token_ids)} tokens generated")
        return view

    async def _remote(self, request_id: str, tenant: str) -> View | None:
        try:
            info = await self.store.lookup_request(tenant, request_id)
            if info is None:
                return None
            if info.key:
                record = await self.store.get(tenant, info.key)
                if record is not None and record.state == State.SUCCESS:
                    return replay_view(record, tenant)
            return await self._mirror(request_id, tenant, info.key)
        except StoreUnavailable as exc:
            raise store_down(exc) from None

    async def _mirror(
        self, request_id: str, tenant: str, key: str, fallback: tuple[GenerationSpec, str] | None = None
    ) -> View:
        """A local view of another replica's generation, fed from its token log. It is taken over when the
        owner's lease expires (its control plane died): a keyed one from its record's payload, a content
        follower's from its own identical, deterministic request (`fallback`: spec and fingerprint)."""
        existing = self._mirrors.get(request_id)
        if existing is not None:
            return existing
        gen = Generation(request_id, tenant, prompt_tokens=0, interest=0)
        view = self.d.add_view(View(request_id, gen, COALESCED))
        self._mirrors[request_id] = view
        task = asyncio.create_task(self._follow_log(view, key, fallback))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return view

    async def _follow_log(self, view: View, key: str, fallback: tuple[GenerationSpec, str] | None) -> None:
        gen = view.gen
        source = gen.request_id  # the log we read; a content follower moves on when the leader changes
        quiet_since = time.monotonic()
        while not gen.done:
            try:
                piece = await self.store.tail(source, len(gen.token_ids), TAIL_S)
            except StoreUnavailable:
                await asyncio.sleep(TAIL_S)
                continue
            if piece is None:
                if time.monotonic() - quiet_since < self.settings.lease_s and not gen.token_ids:
                    await asyncio.sleep(LOG_WAIT_S)  # its owner claimed it a moment ago and opens the log now
                    continue
                gen.finish(inference_pb2.FINISH_REASON_ERROR, self.d.clock(), not_found("the request's log expired"))
                break
            if piece.entries:
                apply_slice(gen, piece)
                quiet_since = time.monotonic()
            if piece.finished:
                done = parse_finish(piece.finish_info)
                gen.prompt_tokens = done.usage.prompt_tokens
                gen.cached_tokens = done.usage.cached_prompt_tokens
                error = stored_error(done.text) if done.finish_reason == inference_pb2.FINISH_REASON_ERROR else None
                gen.finish(done.finish_reason, self.d.clock(), error)
            elif time.monotonic() - quiet_since >= TAIL_S:  # is the owner still there?
                try:
                    if key and await self._owner_dead(gen, key):
                        return  # taken over: the computation now runs here on the same Generation
                    if fallback is not None:
                        leader = await self._content_leader(gen, source, fallback)
                        if leader is None:
                            return  # taken over, as above
                        source = leader
                except StoreUnavailable:
                    continue  # ask again after the next tail
                except ApiError as err:
                    gen.finish(inference_pb2.FINISH_REASON_ERROR, self.d.clock(), err)
        self._mirrors.pop(gen.request_id, None)

    async def _content_leader(self, gen: Generation, source: str, fallback: tuple[GenerationSpec, str]) -> str | None:
        """Whose log a content follower reads now; None when the leader's replica was lost and we took over.

        The request is deterministic, so any identical request continues the same tokens: our own carries
        on from what was logged, logged under our request id, where the content lease then points (followers
        elsewhere move to that log at the offset they reached).
        """
        spec, fp = fallback
        claim = await self.store.claim_content(spec.tenant, fp, spec.request_id, self.owner, self.settings.lease_s)
        if not claim.leader:
            return claim.request_id
        await self._catch_up(gen, source)
        if not await self._index(spec):
            return gen.request_id
        self._mirrors.pop(gen.request_id, None)
        self.report("content", "takeover", spec.request_id)
        self.d.submit(spec, gen, TAKEOVER)
        self.replicator.own(gen, 1, "", True, name=spec.request_id, content=fp, flushed=0)
        return None

    async def _owner_dead(self, gen: Generation, key: str) -> bool:
        record = await self.store.get(gen.tenant, key)
        if record is None or record.state not in (State.INIT, State.PROCESSING):
            return False
        if record.lease_until > self.store.clock():
            return False
        res = await self.store.claim(
            gen.tenant, key, self.owner, record.fingerprint, record.request_id, self.settings.lease_s
        )
        if res.outcome is not Outcome.TAKEOVER or res.record is None:
            return False
        self.report("idempotency", "takeover", gen.request_id)
        await self._take_over(res.record)
        return True

    # -- Observer: keep the shared side in step ------------------------------------------------------------
    def on_admitted(self, seq: Sequence, gen: Generation, now: float) -> None:
        owned = self.replicator.owned.get(gen.request_id)
        if owned is not None:
            owned.admitted = True
            self.replicator.touch()

    def on_tokens(self, gen: Generation, count: int, now: float) -> None:
        self.replicator.touch()

    def on_finish(self, gen: Generation, now: float) -> None:
        for k, leader in list(self.leaders.items()):
            if leader.gen is gen:
                del self.leaders[k]
        self.replicator.touch()


def replay_view(record: Record, tenant: str) -> View:
    """A finished generation rebuilt from a SUCCESS record's stored result."""
    result = inference_pb2.GenerateResponse.FromString(record.result)
    gen = Generation(
        record.request_id,
        tenant,
        prompt_tokens=result.usage.prompt_tokens,
        cached_tokens=result.usage.cached_prompt_tokens,
    )
    if result.token_ids:
        gen.append(result.token_ids[0], result.text)
        for token in result.token_ids[1:]:
            gen.append(token, "")
    if result.logprobs:
        gen.logprobs = list(result.logprobs)
    gen.finish(result.finish_reason, time.monotonic())
    return View(record.request_id, gen, REPLAYED)


def stored_error(text: str) -> ApiError:
    """An error replayed from its "CODE: message" form."""
    name, _, message = text.partition(": ")
    code = getattr(grpc.StatusCode, name, grpc.StatusCode.UNKNOWN)
    return ApiError(code, message or text, "REPLAYED_ERROR")


def id_in_use(request_id: str) -> ApiError:
    return ApiError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is already in use", "REQUEST_ID_IN_USE")
