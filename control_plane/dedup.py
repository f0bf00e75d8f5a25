"""Dedup: where a request meets the store. One decision per request (control_plane.dedup_decision), then
one action: replay, attach, follow another replica's log, or lead: submit to the dispatcher and hand the
shared side to the journal. Also Resume on any replica, batch items, and taking over the work of a replica
that died (docs/architecture.md, "The dedup decision" and "Fencing").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Coroutine
from typing import Any

from control_plane import mirror
from control_plane.admission import Admission
from control_plane.cancel import cancel_all
from control_plane.config import Settings
from control_plane.dedup_decision import Attach, Decider, Decision, Follow, Lead, Refuse, Replay
from control_plane.dispatcher import Dispatcher
from control_plane.errors import ApiError, id_in_use, invalid, not_found, out_of_range, store_down, unavailable
from control_plane.generation import Generation, View
from control_plane.observer import Observer
from control_plane.replication import Owned, Replicator
from control_plane.request import Request
from dedup_service import Outcome, Record, State, Store, StoreUnavailable
from protos.coalesce.v1 import inference_pb2

log = logging.getLogger(__name__)

COALESCED, TAKEOVER = inference_pb2.DEDUP_OUTCOME_COALESCED, inference_pb2.DEDUP_OUTCOME_TAKEOVER
ERROR = inference_pb2.FINISH_REASON_ERROR


def new_owner() -> str:
    """Unique per process: fencing tells replicas (and restarts of one) apart."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class Dedup:
    def __init__(
        self,
        dispatcher: Dispatcher,
        store: Store,
        journal: Replicator,
        admission: Admission,
        settings: Settings,
        observer: Observer | None = None,
    ) -> None:
        self.dispatcher = dispatcher
        self.store = store
        self.journal = journal
        self.admission = admission
        self.settings = settings
        self.observer = observer or Observer()
        self.decider = Decider(store, dispatcher, journal.owner, settings.lease_s)
        # Other replicas' generations followed from their logs, by (tenant, request id).
        self._mirrors: dict[tuple[str, str], View] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    # -- lifecycle ---------------------------------------------------------------------------------------
    def start(self) -> None:
        self._spawn(self._write())
        self._spawn(self._heartbeat())

    async def stop(self) -> None:
        await cancel_all(self._tasks)  # they call the store, where a cancellation can be lost (cancel.py)
        with contextlib.suppress(StoreUnavailable):
            self._fenced(await self.journal.flush())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- Generate, batch items ---------------------------------------------------------------------------
    async def open(self, request: Request) -> View:
        """The caller's view of `request`: replayed, attached, followed or computed here."""
        try:
            decision = await self.decider.decide(request)
        except StoreUnavailable as exc:
            if not self.settings.dedup_fail_open:
                raise store_down(exc) from None
            log.warning("store down, serving without dedup (fail-open): %s", exc)
            decision = Lead()
        return await self._act(request, decision)

    async def run_item(self, request: Request, batch_id: str, seq_id: str) -> bool:
        """Run a batch item with nobody reading, unless it succeeded or runs already; True when queued."""
        decision = await self.decider.decide_item(request, batch_id, seq_id)
        if decision is None:
            return False
        view = await self._act(request, decision)
        view.gen.detached_ok = True
        view.gen.interest = 1
        return True

    async def _act(self, request: Request, decision: Decision) -> View:
        match decision:
            case Replay(record=record):
                view = mirror.replay_view(record, request.tenant)
            case Refuse(error=error):
                self._report(decision, request.request_id)
                raise error
            case Attach(target=target, view_id=view_id, outcome=outcome, ride_epoch=epoch):
                if epoch:
                    self.journal.own(target.gen, name=request.request_id, epoch=epoch, key=request.key, log=False,
                                     fingerprint=request.fingerprint, payload=request.payload)  # fmt: skip
                view = self.dispatcher.join(target, view_id, outcome, request.resumable)
                await self._index(request, view.gen)
            case Follow(log_id=log_id, view_id=view_id, key=key, content=content):
                followed = self._mirror(log_id, request.tenant, key, request if content else None)
                view = self.dispatcher.join(followed, view_id, COALESCED, request.resumable)
                await self._index(request, view.gen)
            case Lead(takeover=None) as lead:
                gen = Generation(request.request_id, request.tenant, prompt_tokens=len(request.prompt_ids))
                view = self.dispatcher.submit(request, gen)
                if lead.shared:
                    self.journal.own(gen, epoch=lead.epoch, key=lead.key, content=lead.content, log=lead.log,
                                     fingerprint=request.fingerprint, payload=request.payload)  # fmt: skip
            case Lead(takeover=record):
                assert record is not None
                view = await self._take_over(record)
        self._report(decision, view.request_id)
        return view

    async def _index(self, request: Request, gen: Generation) -> None:
        """A keyless request reading another's computation is indexed and logged under its own id too, so
        that any replica can resume it by that id (docs/api.md, "Resume"). The store down: it runs without.
        A keyed one is found through its key's record."""
        if request.key or not self.store.shared:
            return
        try:
            if await self.store.start_request(request.tenant, request.request_id, self.journal.owner,
                                              payload=request.payload):  # fmt: skip
                self.journal.own(gen, name=request.request_id, flushed=0, payload=request.payload)
        except StoreUnavailable as exc:
            log.warning("request %s is not resumable elsewhere, the store is down: %s", request.request_id, exc)

    def _report(self, decision: Decision, request_id: str) -> None:
        if decision.report is not None:
            self.observer.on_dedup(*decision.report, request_id)

    # -- Resume ------------------------------------------------------------------------------------------
    async def resume(self, request_id: str, offset: int, tenant: str, prefix: str = "") -> View:
        """The request's view, for reading from `offset`: an offset it can never reach is refused at once."""
        if not request_id:
            raise invalid(prefix + "request_id", "must not be empty")
        view = self.dispatcher.find(tenant, request_id)
        if view is None and self.store.shared:
            view = await self._remote(request_id, tenant)
        if view is None or view.tenant != tenant:
            raise not_found(f"request {request_id!r} is unknown or expired")
        end = view.final_length
        if end is not None and offset > end:
            raise out_of_range(prefix + "offset", f"{offset} is beyond the {end} tokens of this finished generation")
        if end is None and view.gen.max_tokens and offset > view.gen.max_tokens:
            raise out_of_range(prefix + "offset", f"{offset} is beyond the max_tokens of {view.gen.max_tokens} of "
                               "this generation")  # fmt: skip
        if end is None and offset > (context := self.admission.limits.max_context):
            raise out_of_range(prefix + "offset", f"{offset} is beyond the model's context of {context} tokens")
        return view

    async def _remote(self, request_id: str, tenant: str) -> View | None:
        try:
            info = await self.store.lookup_request(tenant, request_id)
            if info is None:
                return None
            if info.key:
                record = await self.store.get(tenant, info.key)
                if record is not None and record.state == State.SUCCESS:
                    return mirror.replay_view(record, tenant)
            return self._mirror(request_id, tenant, info.key)
        except StoreUnavailable as exc:
            raise store_down(exc) from None

    # -- other replicas' generations ---------------------------------------------------------------------
    def _mirror(self, request_id: str, tenant: str, key: str, fallback: Request | None = None) -> View:
        """A local view of another replica's generation, fed from its token log (once per request id)."""
        existing = self._mirrors.get((tenant, request_id))
        if existing is not None:
            return existing
        gen = Generation(request_id, tenant, prompt_tokens=0, interest=0)
        # Another replica computes it: a deadline passing here is no reason to stop it.
        view = self.dispatcher.register(View(request_id, gen, COALESCED, resumable=True))
        self._mirrors[(tenant, request_id)] = view
        self._spawn(self._follow(gen, key, fallback))
        return view

    async def _follow(self, gen: Generation, key: str, fallback: Request | None, source: str = "") -> None:
        """Follow the log while its owner lives. When the owner's replica died, continue the generation
        here: a keyed one from its record's payload, a keyless one from its request index's payload, a
        content follower as its own identical request."""
        source = source or gen.request_id  # a content follower moves on when the leader changes
        clock = self.dispatcher.clock
        try:
            while not await mirror.follow(self.store, gen, source, self.settings.lease_s, clock, self.journal.touch):
                try:
                    if key:
                        if await self._owner_lost(gen, key):
                            return
                    elif fallback is not None:
                        leader = await self._content_leader(gen, source, fallback)
                        if leader is None:
                            return
                        source = leader
                    elif await self._replica_lost(gen, source):
                        return
                except StoreUnavailable:
                    continue  # ask again after the next quiet spell
                except ApiError as err:
                    gen.finish(ERROR, clock(), err)
        finally:
            self.journal.touch()  # what it ended with reaches the logs kept under other ids
            name = (gen.tenant, gen.request_id)
            if (followed := self._mirrors.get(name)) is not None and followed.gen is gen:
                del self._mirrors[name]

    async def _replica_lost(self, gen: Generation, name: str) -> bool:
        """True when the replica computing this keyless request is gone and we continue it here."""
        info = await self.store.lookup_request(gen.tenant, name)
        if info is None or info.finished or info.key or await self.store.alive(info.owner):
            return False
        epoch = await self.store.take_request(gen.tenant, name, self.journal.owner, info.epoch)
        if epoch is None:
            return False  # another replica took it first: its tokens arrive in the same log
        if not info.payload:
            gen.finish(ERROR, self.dispatcher.clock(), unavailable(
                f"the replica computing request {name!r} was lost and left nothing to continue it from; "
                "send the request again", "REPLICA_LOST"))  # fmt: skip
            return True
        request = self.admission.admit(inference_pb2.GenerateRequest.FromString(info.payload), gen.tenant,
                                       request_id=name)  # fmt: skip
        await mirror.catch_up(self.store, gen, name)
        self._mirrors.pop((gen.tenant, gen.request_id), None)
        self.dispatcher.forget(gen.tenant, name)
        self.dispatcher.submit(request, gen, TAKEOVER)
        self.journal.own(gen, name=name, epoch=epoch, payload=info.payload)
        log.warning("request %s: its replica %s was lost; continued here at epoch %d", name, info.owner, epoch)
        return True

    async def _owner_lost(self, gen: Generation, key: str) -> bool:
        """True when the key's owner let its lease expire and we took the request over."""
        record = await self.store.get(gen.tenant, key)
        if record is None or record.state not in (State.INIT, State.PROCESSING):
            return False
        if record.lease_until > self.store.clock():
            return False
        res = await self.store.claim(gen.tenant, key, self.journal.owner, record.fingerprint, record.request_id,
                                     self.settings.lease_s)  # fmt: skip
        if res.outcome is not Outcome.TAKEOVER or res.record is None:
            return False
        self.observer.on_dedup("idempotency", "takeover", gen.request_id)
        await self._take_over(res.record)
        return True

    async def _content_leader(self, gen: Generation, source: str, request: Request) -> str | None:
        """Whose log a content follower reads now; None when the leader's replica was lost and we took over.

        The request is deterministic, so any identical request continues the same tokens: ours carries on
        from what was logged, logged under our request id, where the content lease then points (followers
        elsewhere move to that log at the offset they reached).
        """
        claim = await self.store.claim_content(
            request.tenant, request.fingerprint, request.request_id, self.journal.owner, self.settings.lease_s
        )
        if not claim.leader:
            return claim.request_id
        await mirror.catch_up(self.store, gen, source)
        held = self.journal.held(request.tenant, request.request_id)  # indexed when it began to follow
        if held is None and not await self.store.start_request(request.tenant, request.request_id, self.journal.owner):
            raise id_in_use(request.request_id)
        self._mirrors.pop((gen.tenant, gen.request_id), None)
        self.observer.on_dedup("content", "takeover", request.request_id)
        self.dispatcher.submit(request, gen, TAKEOVER)
        self.journal.own(gen, name=request.request_id, content=request.fingerprint, payload=request.payload,
                         epoch=held.epoch if held else 1, flushed=held.flushed if held else 0)  # fmt: skip
        return None

    async def _take_over(self, record: Record) -> View:
        """Our claim holds a new epoch: continue the generation from its logged tokens (a re-prefill), as
        the request it was claimed with."""
        request = self.admission.admit(
            inference_pb2.GenerateRequest.FromString(record.payload),
            record.tenant,
            key=record.key,
            request_id=record.request_id,
        )
        followed = self._mirrors.pop((record.tenant, record.request_id), None)
        gen = followed.gen if followed else Generation(record.request_id, record.tenant, len(request.prompt_ids))
        await mirror.catch_up(self.store, gen)
        self.dispatcher.forget(record.tenant, record.request_id)
        view = self.dispatcher.submit(request, gen, TAKEOVER)
        self.journal.own(gen, epoch=record.epoch, key=record.key, log=self.store.shared,
                         fingerprint=record.fingerprint, payload=record.payload)  # fmt: skip
        return view

    # -- the journal's loops -----------------------------------------------------------------------------
    async def _write(self) -> None:
        while True:
            await self.journal.changed()
            try:
                self._fenced(await self.journal.flush())
            except StoreUnavailable as exc:
                log.warning("token log flush failed, will retry: %s", exc)
                await asyncio.sleep(0.2)
                self.journal.touch()

    async def _heartbeat(self) -> None:
        while True:  # beat first: until a replica's first beat, others would take it for dead
            self._fenced(await self.journal.renew())
            await asyncio.sleep(self.settings.lease_s / 3)

    def _fenced(self, fenced: list[Owned]) -> None:
        """Another replica owns these now (our epoch is stale): stop computing them here, and let their
        readers here follow the new owner's log."""
        for o in fenced:
            gen = o.gen
            log.warning("request %s: another replica owns it now; following its log here", o.name)
            self.dispatcher.release(gen)
            if gen.done:
                continue
            view = self.dispatcher.find(gen.tenant, gen.request_id)
            self._mirrors[(gen.tenant, gen.request_id)] = view or self.dispatcher.register(
                View(gen.request_id, gen, COALESCED)
            )
            self._spawn(self._follow(gen, o.key, None, source=o.name))
