"""Admission (DESIGN §4.1): tenant from the bearer token, validation, tokenization, the sampling the
worker will run, and the completion budget. Pure functions of the request and the served model."""

from __future__ import annotations

import hashlib
import secrets
import uuid
from collections.abc import Sequence as Seq

from tokenizers import Tokenizer

from control_plane.config import Settings
from control_plane.dispatcher import GenerationSpec
from control_plane.errors import invalid
from control_plane.validation import Limits, resolve_max_tokens, validate_generate
from protos.coalesce.v1 import inference_pb2, worker_pb2

DEFAULT_TENANT = "default"
POOL_NAMES = {
    inference_pb2.POOL_UNSPECIFIED: "interactive",
    inference_pb2.POOL_INTERACTIVE: "interactive",
    inference_pb2.POOL_BATCH: "batch",
}


def tenant_of(metadata: Seq[tuple[str, str | bytes]] | None) -> str:
    """The tenant is a digest of the bearer token (never the token itself, which may end up in keys)."""
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value.lower().startswith("bearer "):
            token = value[7:].strip()
            if token:
                return "t-" + hashlib.sha256(token.encode()).hexdigest()[:24]
    return DEFAULT_TENANT


def worker_seed(seed: int | None) -> int:
    """The worker's noise seed: a fixed function of the caller's seed, or fresh randomness.

    The worker treats 0 as "unseeded", so it never gets 0; an unseeded request still gets one fixed seed
    for its whole life, so a recompute after preemption or failover continues it exactly.
    """
    if seed is None:
        return secrets.randbits(64) or 1
    return int.from_bytes(hashlib.blake2b(seed.to_bytes(8, "little"), digest_size=8).digest(), "little") or 1


def pool_of(request: inference_pb2.GenerateRequest) -> str:
    return POOL_NAMES[request.pool]


def build_spec(
    request: inference_pb2.GenerateRequest,
    tenant: str,
    tokenizer: Tokenizer,
    limits: Limits,
    settings: Settings,
    request_id: str | None = None,
    traceparent: str = "",
    prefix: str = "",
) -> GenerationSpec:
    """Validate and tokenize; raises ApiError (INVALID_ARGUMENT) naming the bad field."""
    validate_generate(request, limits, prefix)
    s = request.sampling
    end_of_turn: list[int] = []
    which = request.WhichOneof("prompt")
    if which == "text":
        prompt_ids = tokenizer.encode(request.text).ids
        if not prompt_ids:
            raise invalid(prefix + "text", "tokenizes to no tokens")
    elif which == "messages":
        assert limits.chat is not None  # validate_generate said so
        turns = [(m.role, m.content) for m in request.messages.messages]
        prompt_ids = limits.chat.prompt_ids(turns, tokenizer, prefix + "messages")
        end_of_turn = [] if s.ignore_eos else [i for i in limits.chat.end_of_turn_ids if i not in s.stop_token_ids]
    else:
        prompt_ids = list(request.token_ids.ids)
    max_tokens = resolve_max_tokens(len(prompt_ids), s.max_tokens, limits, prefix)
    sampling = worker_pb2.WorkerSampling(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=worker_seed(s.seed if s.HasField("seed") else None),
        logprobs=s.logprobs,
    )
    return GenerationSpec(
        request_id=request_id or request.request_id or uuid.uuid4().hex,
        tenant=tenant,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        pool=pool_of(request),
        sampling=sampling,
        stop=list(s.stop),
        stop_token_ids=[*s.stop_token_ids, *end_of_turn],
        ignore_eos=s.ignore_eos,
        traceparent=traceparent,
    )


def streams(request: inference_pb2.GenerateRequest, settings: Settings) -> bool:
    """Streamed when asked for and the pool streams (the batch pool answers once, for throughput)."""
    pool = getattr(settings.pools, pool_of(request))
    return request.stream and pool.stream
