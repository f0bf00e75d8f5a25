"""The request record: what a caller asked for, validated and tokenized once at the API edge.

Every later stage (the dedup decision, the dispatcher, telemetry, the shared store) reads it and none edits
it. See docs/architecture.md, "A request's life".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protos.coalesce.v1 import worker_pb2


@dataclass(frozen=True, slots=True)
class Request:
    request_id: str
    tenant: str
    prompt_ids: list[int]
    max_tokens: int  # resolved: the caller's, or the default capped by the context
    pool: str  # "interactive" | "batch"
    # What the worker runs: the caller's sampling, with a nonzero noise seed fixed for the request's life.
    sampling: worker_pb2.WorkerSampling
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Identity of what was asked (tenant, model, prompt ids, the caller's sampling, stops): equal
    # fingerprints give equal outputs when sampling is deterministic.
    fingerprint: str = ""
    # Identical in-flight requests may share one computation (greedy or seeded, dedup policy AUTO).
    shareable: bool = False
    key: str = ""  # idempotency key, "" when none
    # Kept running when its caller's deadline passes: it has a key or asked for it (docs/api.md, "Deadlines").
    resumable: bool = False
    # The caller's GenerateRequest (request id filled in, unknown fields dropped): a takeover re-runs it.
    payload: bytes = b""
    traceparent: str = ""  # the trace the worker links its step spans to
    caller_seed: int | None = None  # the seed the caller asked for (`sampling.seed` is the worker's, always set)
