"""The hooks the request path calls for telemetry. The base class does nothing, so with telemetry off the
hot path pays one no-op method call per event. `control_plane.telemetry` implements them."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from control_plane.generation import Generation
    from control_plane.request import Request
    from control_plane.sequence import SeqEvent, Sequence
    from control_plane.step_plan import StepPlan
    from control_plane.worker_link import WorkerLink
    from protos.coalesce.v1 import worker_pb2


class Observer:
    """Times are the dispatcher's clock (time.monotonic seconds unless a test injects another)."""

    def on_request(self, gen: Generation, request: Request, now: float) -> None:
        """A generation was queued (after admission and dedup, when it will be computed)."""

    def on_dedup(self, kind: str, outcome: str, request_id: str) -> None:
        """A dedup decision: kind idempotency|content; outcome miss|coalesced|replayed|takeover."""

    def on_admitted(self, seq: Sequence, gen: Generation, now: float) -> None:
        """The sequence's first step was scheduled: its batch-buffer dwell is `seq.dwell`."""

    def on_tokens(self, gen: Generation, count: int, now: float) -> None:
        """`count` tokens were appended to `gen` in one step (the first call is the first token)."""

    def on_finish(self, gen: Generation, now: float) -> None:
        """The generation ended (any finish reason, including errors and cancels)."""

    def on_step(
        self, link: WorkerLink, plan: StepPlan, events: list[SeqEvent], resp: worker_pb2.StepResponse, loop_s: float
    ) -> None:
        """One step ran on `link`'s worker; `loop_s` is the control plane's wall time for it (send to complete)."""

    def on_worker_lost(self, link: WorkerLink, requeued: int) -> None:
        """A worker's stream broke; `requeued` sequences go back for recompute."""
