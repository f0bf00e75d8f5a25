"""The control plane's core: admits sequences onto worker links, turns sampled tokens into text and
fans them out, cancels, recovers from lost workers, and forgets generations after the resume window.

Everything here runs on the event loop thread; each worker link calls `_on_step` synchronously.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from control_plane.chat import ChatTemplate
from control_plane.config import Settings
from control_plane.detokenize import IncrementalText
from control_plane.errors import ApiError, exhausted, invalid, not_found, unavailable
from control_plane.generation import Generation, View
from control_plane.observer import Observer
from control_plane.routing import choose_worker
from control_plane.scheduler import QueueFull, TooLarge
from control_plane.sequence import SeqEvent, Sequence
from control_plane.step_plan import StepPlan
from control_plane.validation import Limits
from control_plane.worker_link import WorkerLink
from protos.coalesce.v1 import inference_pb2, worker_pb2

log = logging.getLogger(__name__)

MISS = inference_pb2.DEDUP_OUTCOME_MISS
FINISH = {"stop": inference_pb2.FINISH_REASON_STOP, "length": inference_pb2.FINISH_REASON_LENGTH}


@dataclass(slots=True)
class GenerationSpec:
    """A validated, tokenized request, ready to schedule."""

    request_id: str
    tenant: str
    prompt_ids: list[int]
    max_tokens: int
    pool: str
    sampling: worker_pb2.WorkerSampling
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    traceparent: str = ""


@dataclass(slots=True)
class Active:
    """A sequence being computed for a generation."""

    spec: GenerationSpec
    seq: Sequence
    gen: Generation
    text: IncrementalText
    link: WorkerLink


class Dispatcher:
    def __init__(
        self,
        settings: Settings,
        addresses: list[str],
        clock: Callable[[], float] = time.monotonic,
        observer: Observer | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.links = [WorkerLink(a, settings, self._on_step, self._on_lost, clock) for a in addresses]
        self.observer = observer or Observer()
        # Every request's view, by request id: what Resume and Cancel find (kept for the resume window).
        self.views: dict[str, View] = {}
        self.tokenizer: Tokenizer | None = None
        self.limits: Limits | None = None
        self.eos_ids: frozenset[int] = frozenset()
        self._active: dict[int, Active] = {}
        self._by_request: dict[str, Active] = {}
        self._next_seq = 1
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle ---------------------------------------------------------------------------------------
    async def start(self, timeout: float = 120.0) -> None:
        """Connect to every worker and learn the model from the first one."""
        self._tasks = [asyncio.create_task(link.run(), name=f"link {link.address}") for link in self.links]
        self._tasks.append(asyncio.create_task(self._sweeper(), name="sweeper"))
        waits = [asyncio.create_task(link.connected.wait()) for link in self.links]
        done, pending = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        if not done:
            raise RuntimeError(f"no worker answered within {timeout:.0f} s: {[link.address for link in self.links]}")
        info = next(link.info for link in self.links if link.info is not None)
        assert info is not None
        self.tokenizer = Tokenizer.from_str(info.tokenizer_json.decode())
        self.eos_ids = frozenset(info.eos_token_ids)
        self.limits = Limits(
            model_name=info.model_name,
            vocab_size=info.vocab_size,
            max_context=info.max_context,
            default_max_tokens=self.settings.default_max_tokens,
            max_stop_strings=self.settings.max_stop_strings,
            chat=ChatTemplate.for_model(info.chat_template, info.special_tokens, self.tokenizer, info.eos_token_ids),
        )

    async def stop(self) -> None:
        for link in self.links:
            link.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    @property
    def info(self) -> worker_pb2.InfoResponse:
        return next(link.info for link in self.links if link.info is not None)

    # -- requests ----------------------------------------------------------------------------------------
    def submit(self, spec: GenerationSpec, gen: Generation | None = None, outcome: int = MISS) -> View:
        """Compute a generation; its first view has the spec's request id.

        With `gen`, continue it: its logged tokens are re-prefilled (a takeover), then it goes on.
        """
        assert self.tokenizer is not None, "submit before start()"
        if gen is None:
            gen = Generation(spec.request_id, spec.tenant, prompt_tokens=len(spec.prompt_ids))
        seq = self._sequence(spec, list(gen.token_ids))
        link = self._route(seq)
        self._enqueue(link, seq, spec.pool)
        text = IncrementalText(self.tokenizer, spec.stop)
        for token in gen.token_ids:  # a continued generation: its text so far is already logged
            text.push(token)
        active = Active(spec, seq, gen, text, link)
        self._active[seq.seq_id] = active
        self._by_request[gen.request_id] = active
        self.observer.on_request(gen, spec, self.clock())
        return self.add_view(View(spec.request_id, gen, outcome))

    def add_view(self, view: View) -> View:
        """Register a request's view (a new one, a duplicate's, or one mirrored from another replica)."""
        self.views[view.request_id] = view
        return view

    def join(self, leader: View, request_id: str, outcome: int) -> View:
        """A duplicate reads the leader's computation from offset 0 under its own request id."""
        leader.gen.interest += 1
        return self.add_view(View(request_id, leader.gen, outcome))

    def running(self, request_id: str) -> View | None:
        view = self.views.get(request_id)
        return view if view is not None and not view.done else None

    def _sequence(self, spec: GenerationSpec, output_ids: list[int]) -> Sequence:
        seq = Sequence(
            seq_id=self._next_seq,
            request_id=spec.request_id,
            tenant=spec.tenant,
            pool=spec.pool,
            prompt_ids=list(spec.prompt_ids),
            max_tokens=spec.max_tokens,
            sampling=spec.sampling,
            eos_ids=self.eos_ids,
            stop_token_ids=frozenset(spec.stop_token_ids),
            ignore_eos=spec.ignore_eos,
            traceparent=spec.traceparent,
            output_ids=output_ids,
        )
        self._next_seq += 1
        return seq

    @staticmethod
    def _enqueue(link: WorkerLink, seq: Sequence, pool: str) -> None:
        try:
            link.submit(seq)
        except QueueFull as full:
            raise exhausted(f"the {pool} pool's queue is full", full.retry_after_s) from None
        except TooLarge as err:
            raise invalid("sampling.max_tokens", f"the request cannot fit the KV cache: {err}") from None

    def get(self, request_id: str, tenant: str) -> View:
        view = self.views.get(request_id)
        if view is None or view.tenant != tenant:  # never reveal another tenant's request
            raise not_found(f"request {request_id!r} is unknown or expired")
        return view

    def cancel(self, request_id: str, tenant: str) -> bool:
        """End one request; its computation stops when no other request reads it (DESIGN §4.3)."""
        view = self.get(request_id, tenant)
        if view.done:
            return False
        view.cancelled = True
        gen = view.gen
        gen.interest -= 1
        gen.wake()
        if gen.interest <= 0:
            self.abort(gen, inference_pb2.FINISH_REASON_CANCELLED)
        return True

    def abort(self, gen: Generation, reason: int, error: ApiError | None = None) -> None:
        """Stop computing `gen` for everyone."""
        active = self._by_request.get(gen.request_id)
        if active is not None and active.gen is gen:
            active.link.abort(active.seq.seq_id)
            self._end(active, reason, self.clock(), error)
        else:
            gen.finish(reason, self.clock(), error)
            self.observer.on_finish(gen, self.clock())

    def attach(self, gen: Generation) -> None:
        gen.subscribers += 1
        gen.detached_at = None

    def detach(self, gen: Generation) -> None:
        gen.subscribers -= 1
        if gen.subscribers == 0:
            gen.detached_at = self.clock()

    # -- step results ------------------------------------------------------------------------------------
    def _on_step(
        self, link: WorkerLink, plan: StepPlan, events: list[SeqEvent], resp: worker_pb2.StepResponse, loop_s: float
    ) -> None:
        now = self.clock()
        for seq in plan.admitted:
            active = self._active.get(seq.seq_id)
            if active is not None and not active.gen.token_ids:
                active.gen.queue_ms = (seq.dwell or 0.0) * 1000
                active.gen.cached_tokens = seq.cached_prompt_tokens
                self.observer.on_admitted(seq, active.gen, now)
        logprobs = {t.seq_id: t.token for t in resp.tokens if t.token.top or t.token.logprob}
        for event in events:
            active = self._active.get(event.seq.seq_id)
            if active is None:
                continue
            gen, seq = active.gen, active.seq
            gen.append(event.token, active.text.push(event.token), logprobs.get(seq.seq_id))
            self.observer.on_tokens(gen, 1, now)
            reason = event.finish_reason
            if reason is None and active.text.stopped:
                link.finish(seq.seq_id, "stop")
                reason = "stop"
            if reason is not None:
                gen.add_text(active.text.flush())
                self._end(active, FINISH[reason], now)
        self.observer.on_step(link, plan, events, resp, loop_s)

    def _end(self, active: Active, reason: int, now: float, error: ApiError | None = None) -> None:
        active.gen.finish(reason, now, error)
        self._forget(active)
        self.observer.on_finish(active.gen, now)

    def _on_lost(self, link: WorkerLink, requeued: int, everything: bool) -> None:
        """A worker was lost (its sequences are requeued there for recompute): move them to live workers.

        With `everything`, the link's scheduler was replaced (the worker came back with another cache),
        so all its sequences are rebuilt, onto itself if need be.
        """
        self.observer.on_worker_lost(link, requeued)
        live = [other for other in self.links if other is not link and other.connected.is_set()]
        if everything:
            live.append(link)
        if not live:
            return  # they wait in this link's queues for the worker to return
        for active in [a for a in self._active.values() if a.link is link]:
            link.abort(active.seq.seq_id)
            self._forget(active)
            seq = self._sequence(active.spec, list(active.seq.output_ids))
            target = self._route(seq, live)
            try:
                self._enqueue(target, seq, active.spec.pool)
            except ApiError as err:
                self._end(active, inference_pb2.FINISH_REASON_ERROR, self.clock(), err)
                continue
            active.seq, active.link = seq, target
            self._active[seq.seq_id] = active
            self._by_request[active.spec.request_id] = active

    def _route(self, seq: Sequence, links: list[WorkerLink] | None = None) -> WorkerLink:
        candidates = [link for link in (links or self.links) if link.scheduler is not None]
        connected = [link for link in candidates if link.connected.is_set()] or candidates
        if not connected:
            raise unavailable("no worker is connected")
        index = choose_worker(
            [link.scheduler for link in connected],  # type: ignore[misc]
            seq.tokens(),
            seq.tenant,
            self.settings.scheduler.merge_weight,
        )
        return connected[index]

    def _forget(self, active: Active) -> None:
        self._active.pop(active.seq.seq_id, None)
        if self._by_request.get(active.gen.request_id) is active:
            del self._by_request[active.gen.request_id]

    # -- housekeeping ------------------------------------------------------------------------------------
    def sweep(self, now: float) -> None:
        """Abort computations nobody has read for the grace period; forget views of ones ended since."""
        grace = self.settings.resume_grace_s
        for gen in {id(v.gen): v.gen for v in self.views.values()}.values():
            if not gen.done and gen.detached_at is not None and now - gen.detached_at >= grace and not gen.detached_ok:
                log.info("request %s abandoned for %.0f s: cancelled", gen.request_id, grace)
                self.abort(gen, inference_pb2.FINISH_REASON_CANCELLED)
        for request_id, view in list(self.views.items()):
            gen = view.gen
            if gen.done and gen.finished_at is not None and now - gen.finished_at >= grace and gen.subscribers == 0:
                del self.views[request_id]

    async def _sweeper(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, max(0.05, self.settings.resume_grace_s / 4)))
            self.sweep(self.clock())
