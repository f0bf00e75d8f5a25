"""The dispatcher: runs computations on worker links and hands their tokens to the generation records.

It owns three things, and nothing else edits them: the requests of this replica by id (what Resume and
Cancel find, kept for the resume window), the shareable computations in flight by content (what an identical
request attaches to), and which worker link runs each generation. Tokens come back one way: link ->
scheduler `complete` (every stop condition decided there) -> here, into the generation and its readers, then
one touch of the journal (the shared token log) per step. Everything runs on the event loop thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Protocol

from tokenizers import Tokenizer

from control_plane.cancel import cancel_all
from control_plane.config import Settings
from control_plane.detokenize import IncrementalText
from control_plane.errors import ApiError, exhausted, invalid, not_found, step_failed, unavailable
from control_plane.generation import Generation, View
from control_plane.observer import Observer
from control_plane.request import Request
from control_plane.routing import choose_worker
from control_plane.scheduler import QueueFull, TooLarge
from control_plane.sequence import SeqEvent, Sequence
from control_plane.step_plan import StepPlan
from control_plane.worker_link import WorkerLink
from protos.coalesce.v1 import inference_pb2, worker_pb2

log = logging.getLogger(__name__)

MISS = inference_pb2.DEDUP_OUTCOME_MISS
CANCELLED, ERROR = inference_pb2.FINISH_REASON_CANCELLED, inference_pb2.FINISH_REASON_ERROR
FINISH = {"stop": inference_pb2.FINISH_REASON_STOP, "length": inference_pb2.FINISH_REASON_LENGTH}


def draining() -> ApiError:
    return unavailable("the server is shutting down; send the request again", "DRAINING")


class Journal(Protocol):
    """The shared side of generations (control_plane.replication.Replicator): told once per step that
    generations changed, so it writes their new tokens and finishes to the store."""

    def touch(self) -> None: ...


class _NoJournal:
    def touch(self) -> None:
        pass


class Dispatcher:
    def __init__(
        self,
        settings: Settings,
        addresses: list[str],
        clock: Callable[[], float] = time.monotonic,
        observer: Observer | None = None,
        journal: Journal | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.observer = observer or Observer()
        self.journal = journal or _NoJournal()
        self.links: list[WorkerLink] = []  # the workers this replica drives (control_plane/fleet.py may change them)
        self._link_tasks: dict[WorkerLink, asyncio.Task[None]] = {}
        self._model: worker_pb2.InfoResponse | None = None
        self.tokenizer: Tokenizer | None = None
        self.eos_ids: frozenset[int] = frozenset()
        self.views: dict[tuple[str, str], View] = {}  # every request here, by (tenant, request id)
        self.leaders: dict[tuple[str, str], View] = {}  # shareable computations, by (tenant, fingerprint)
        self.running: dict[Generation, tuple[WorkerLink, Sequence]] = {}  # computed here, and where
        self.per_tenant: Counter[tuple[str, str]] = Counter()  # (tenant, pool) -> generations in `running`
        self._next_seq = 1
        self.draining = False
        self._addresses = list(addresses)
        self._sweeping: asyncio.Task[None] | None = None

    # -- lifecycle ---------------------------------------------------------------------------------------
    async def start(self, timeout: float = 120.0) -> None:
        """Connect to the workers given at construction (more may be added), and learn the model from the
        first one that answers."""
        self._sweeping = asyncio.create_task(self._sweeper(), name="sweeper")
        for address in self._addresses:
            self.add_link(address)
        deadline = self.clock() + timeout
        while self._model is None:
            self._model = next((link.info for link in self.links if link.info is not None), None)
            if self._model is None:
                if self.clock() > deadline:
                    raise RuntimeError(f"no worker answered within {timeout:.0f} s: {self._addresses or 'none yet'}")
                await asyncio.sleep(0.05)
        self.tokenizer = Tokenizer.from_str(self._model.tokenizer_json.decode())
        self.eos_ids = frozenset(self._model.eos_token_ids)

    async def stop(self) -> None:
        for link in self.links:
            link.stop()
        await cancel_all([*self._link_tasks.values(), *([self._sweeping] if self._sweeping else [])])

    @property
    def info(self) -> worker_pb2.InfoResponse:
        """The served model (the first worker's; every worker of a deployment serves the same one)."""
        assert self._model is not None, "info before start()"
        return self._model

    # -- the workers -------------------------------------------------------------------------------------
    def add_link(self, address: str) -> WorkerLink:
        """Drive the worker at `address` (a new one found, or one this replica came to own)."""
        link = WorkerLink(address, self.settings, self._on_step, self._on_lost, self._on_failed, self.clock)
        self.links.append(link)
        self._link_tasks[link] = asyncio.create_task(link.run(), name=f"link {address}")
        return link

    async def retire_link(self, address: str) -> None:
        """Stop driving a worker (gone from discovery, or handed to another replica): its sequences move to
        the other workers here (recomputed), or end UNAVAILABLE (retryable) when there is none."""
        link = next((link for link in self.links if link.address == address), None)
        if link is None:
            return
        self.links.remove(link)
        link.stop()
        await cancel_all([self._link_tasks.pop(link)])
        self._move_all(link, [other for other in self.links if other.scheduler is not None])

    # -- the registry ------------------------------------------------------------------------------------
    def find(self, tenant: str, request_id: str) -> View | None:
        """A request of `tenant` (request ids are each tenant's own: another tenant's are never seen)."""
        return self.views.get((tenant, request_id))

    def leader(self, request: Request) -> View | None:
        """A computation identical to `request` in flight here (shareable requests only)."""
        view = self.leaders.get((request.tenant, request.fingerprint)) if request.shareable else None
        return view if view is not None and not view.gen.done else None

    def get(self, request_id: str, tenant: str) -> View:
        view = self.views.get((tenant, request_id))
        if view is None:
            raise not_found(f"request {request_id!r} is unknown or expired")
        return view

    def register(self, view: View) -> View:
        """Make a request findable by id (a new one, or one mirrored from another replica)."""
        self.views[(view.tenant, view.request_id)] = view
        gen = view.gen
        if gen.subscribers == 0 and gen.detached_at is None:  # until a reader attaches, nobody reads it
            gen.detached_at = self.clock()
        return view

    def join(self, target: View, request_id: str, outcome: int, resumable: bool = False) -> View:
        """Another request reads `target`'s computation from offset 0; the computation goes on while any
        of its readers has not cancelled. Under a new request id it is findable by that id too."""
        target.gen.interest += 1
        view = View(request_id, target.gen, outcome, resumable)
        return view if request_id == target.request_id else self.register(view)

    def forget(self, tenant: str, request_id: str) -> None:
        self.views.pop((tenant, request_id), None)

    # -- computations ------------------------------------------------------------------------------------
    def submit(self, request: Request, gen: Generation, outcome: int = MISS) -> View:
        """Compute `gen` for `request`, continuing from the tokens it holds (a takeover re-prefills them)."""
        assert self.tokenizer is not None, "submit before start()"
        if self.draining:
            raise draining()
        text = IncrementalText(self.tokenizer, request.stop)
        for token in gen.token_ids:  # a continued generation: its text so far is already logged
            text.push(token)
        seq = Sequence(
            seq_id=self._new_seq_id(),
            request_id=request.request_id,
            tenant=request.tenant,
            pool=request.pool,
            prompt_ids=list(request.prompt_ids),
            max_tokens=request.max_tokens,
            sampling=request.sampling,
            eos_ids=self.eos_ids,
            stop_token_ids=frozenset(request.stop_token_ids),
            ignore_eos=request.ignore_eos,
            traceparent=request.traceparent,
            output_ids=list(gen.token_ids),
            text=text,
            gen=gen,
        )
        limit = getattr(self.settings.pools, request.pool).max_per_tenant
        if self.per_tenant[(request.tenant, request.pool)] >= limit:
            raise exhausted(
                f"this tenant already has {limit} requests in the {request.pool} pool", 1.0, reason="TENANT_LIMIT"
            )
        link = self._route(seq)
        self._enqueue(link, seq)
        self.running[gen] = (link, seq)
        self.per_tenant[(request.tenant, request.pool)] += 1
        gen.max_tokens = request.max_tokens
        view = self.register(View(request.request_id, gen, outcome, request.resumable))
        if request.shareable:
            self.leaders[(request.tenant, request.fingerprint)] = view
        self.observer.on_request(gen, request, self.clock())
        return view

    def cancel(self, request_id: str, tenant: str) -> bool:
        """End one request; its computation stops when no other request reads it."""
        return self.cancel_view(self.get(request_id, tenant))

    def cancel_view(self, view: View) -> bool:
        """End the request `view` stands for, at the tokens it has; False when it had already ended."""
        if view.done:
            return False
        view.cancel()
        gen = view.gen
        gen.interest -= 1
        gen.wake()
        if gen.interest <= 0:
            self.abort(gen, CANCELLED)
        return True

    def abort(self, gen: Generation, reason: int, error: ApiError | None = None) -> None:
        """Stop computing `gen` for everyone."""
        self._end(gen, reason, self.clock(), error)

    def drain(self) -> int:
        """Shutting down: refuse what is submitted from now on, and end every generation still queued (never
        admitted) with UNAVAILABLE and a retry hint, so its caller retries elsewhere at once. Returns how many."""
        self.draining = True
        queued = [gen for gen in self.running if not gen.admitted and not gen.token_ids]
        for gen in queued:
            self.abort(gen, ERROR, draining())
        return len(queued)

    def release(self, gen: Generation) -> None:
        """Stop computing `gen` here without finishing it (another replica computes it now, or it ended)."""
        placed = self.running.pop(gen, None)
        if placed is None:
            return
        link, seq = placed
        link.abort(seq.seq_id)  # a no-op for a sequence its scheduler ended already
        count = (seq.tenant, seq.pool)
        self.per_tenant[count] -= 1
        if not self.per_tenant[count]:
            del self.per_tenant[count]

    def attach(self, gen: Generation) -> None:
        gen.subscribers += 1
        gen.detached_at = None

    def detach(self, gen: Generation) -> None:
        gen.subscribers -= 1
        if gen.subscribers == 0:
            gen.detached_at = self.clock()

    def _new_seq_id(self) -> int:
        self._next_seq += 1
        return self._next_seq - 1

    def _route(self, seq: Sequence, links: list[WorkerLink] | None = None) -> WorkerLink:
        candidates = [link for link in (self.links if links is None else links) if link.scheduler is not None]
        connected = [link for link in candidates if link.connected.is_set()] or candidates
        if not connected:
            raise unavailable("no worker is connected", "NO_WORKER_CONNECTED")
        index = choose_worker(
            [link.scheduler for link in connected],  # type: ignore[misc]
            seq.tokens(),
            seq.tenant,
            self.settings.scheduler.merge_weight,
        )
        return connected[index]

    @staticmethod
    def _enqueue(link: WorkerLink, seq: Sequence) -> None:
        try:
            link.submit(seq)
        except QueueFull as full:
            raise exhausted(f"the {seq.pool} pool's queue is full", full.retry_after_s) from None
        except TooLarge as err:
            problem = f"the request cannot fit the KV cache: {err}"
            raise invalid("sampling.max_tokens", problem, "KV_CACHE_TOO_SMALL") from None

    def _end(self, gen: Generation, reason: int, now: float, error: ApiError | None = None) -> None:
        gen.finish(reason, now, error)
        self.release(gen)
        self.observer.on_finish(gen, now)
        self.journal.touch()

    # -- from the worker links ---------------------------------------------------------------------------
    def _on_step(
        self, link: WorkerLink, plan: StepPlan, events: list[SeqEvent], resp: worker_pb2.StepResponse, loop_s: float
    ) -> None:
        now = self.clock()
        for seq in plan.admitted:
            gen = seq.gen
            if gen is not None and not gen.token_ids:
                gen.admitted = True
                gen.queue_ms = (seq.dwell or 0.0) * 1000
                gen.cached_tokens = seq.cached_prompt_tokens
                self.observer.on_admitted(seq, gen, now)
        logprobs = {t.seq_id: t.token for t in resp.tokens if t.token.top or t.token.logprob}
        for event in events:
            gen = event.seq.gen
            if gen is None or self.running.get(gen, (None, None))[1] is not event.seq:
                continue  # no longer computed by this sequence (aborted, moved)
            asked = event.seq.sampling.logprobs > 0  # the worker always sends the token's; 0 means none
            gen.append(event.token, event.text, logprobs.get(event.seq.seq_id) if asked else None)
            self.observer.on_tokens(gen, 1, now)
            if event.finish_reason is not None:
                self._end(gen, FINISH[event.finish_reason], now)
        self.observer.on_step(link, plan, events, resp, loop_s)
        if events or plan.admitted:
            self.journal.touch()

    def _on_failed(self, link: WorkerLink, seqs: list[Sequence], detail: str) -> None:
        """A step raised on the worker, or a worker was lost again and again with these sequences in flight:
        recomputed, they would fail again (and hold every request batched with them), so their generations end
        with INTERNAL; the link recomputes the others."""
        now = self.clock()
        for seq in seqs:
            gen = seq.gen
            if gen is not None and self.running.get(gen, (None, None))[1] is seq:
                log.error("request %s failed on worker %s, not retried: %s", gen.request_id, link.address, detail)
                self._end(gen, ERROR, now, step_failed())

    def _on_lost(self, link: WorkerLink, requeued: int, cause: str) -> None:
        """A worker was lost, or is still down (its sequences wait there for recompute): move them to live
        workers. When it came back with another cache ("replaced"), all its sequences are rebuilt, onto
        itself if need be."""
        if cause == "lost":
            self.observer.on_worker_lost(link, requeued)
        live = [other for other in self.links if other is not link and other.connected.is_set()]
        if cause == "replaced":
            live.append(link)
        if live:  # else they wait in this link's queues for the worker to return
            self._move_all(link, live)

    def _move_all(self, source: WorkerLink, live: list[WorkerLink]) -> None:
        for gen, (where, seq) in list(self.running.items()):
            if where is source:
                self._move(gen, seq, live, source)

    def _move(self, gen: Generation, seq: Sequence, live: list[WorkerLink], source: WorkerLink) -> None:
        """Recompute `gen` on one of `live` from its outputs so far (a new sequence id)."""
        source.abort(seq.seq_id)
        moved = seq.moved(self._new_seq_id())
        try:
            target = self._route(moved, live)
            self._enqueue(target, moved)
        except ApiError as err:
            self._end(gen, ERROR, self.clock(), err)
            return
        self.running[gen] = (target, moved)

    # -- housekeeping ------------------------------------------------------------------------------------
    def sweep(self, now: float) -> None:
        """Abort computations nobody has read for the grace period; forget requests ended since."""
        grace = self.settings.resume_grace_s
        for gen in {id(v.gen): v.gen for v in self.views.values()}.values():
            if not gen.done and gen.detached_at is not None and now - gen.detached_at >= grace and not gen.detached_ok:
                log.info("request %s abandoned for %.0f s: cancelled", gen.request_id, grace)
                self.abort(gen, CANCELLED)
        for name, view in list(self.views.items()):
            gen = view.gen
            if gen.done and gen.finished_at is not None and now - gen.finished_at >= grace and gen.subscribers == 0:
                del self.views[name]
        for content, view in list(self.leaders.items()):
            if view.gen.done:
                del self.leaders[content]

    async def _sweeper(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, max(0.05, self.settings.resume_grace_s / 4)))
            self.sweep(self.clock())
