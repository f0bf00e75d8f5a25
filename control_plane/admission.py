"""Admission: a public GenerateRequest (and its call metadata) becomes a `Request` record.

Validation, tokenization, the sampling the worker runs, the completion budget,
the fingerprint. Pure functions of the request and the served model (docs/architecture.md).
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from tokenizers import Tokenizer

from control_plane.config import Settings
from control_plane.errors import invalid
from control_plane.request import Request
from control_plane.validation import MAX_KEY_BYTES, Limits, resolve_max_tokens, validate_generate
from dedup_service import BATCH_KEY_PREFIX, MAX_PAYLOAD_BYTES, fingerprint
from protos.coalesce.v1 import inference_pb2, worker_pb2

Metadata = Seq[tuple[str, str | bytes]]

KEY_HEADER = "x-idempotency-key"
POOL_NAMES = {
    inference_pb2.POOL_UNSPECIFIED: "interactive",
    inference_pb2.POOL_INTERACTIVE: "interactive",
    inference_pb2.POOL_BATCH: "batch",
}


def idempotency_key(request: inference_pb2.GenerateRequest, metadata: Metadata | None, prefix: str = "") -> str:
    """The request's key: its field or the `x-idempotency-key` header (equal when both are set). Errors name
    where the key came from."""
    header = next((str(v) for k, v in metadata or () if k == KEY_HEADER), "")
    field = request.idempotency_key
    if field and header and field != header:
        raise invalid(prefix + "idempotency_key", f"differs from the {KEY_HEADER} header: send one key, or the same "
                      "in both", "IDEMPOTENCY_KEY_MISMATCH")  # fmt: skip
    where, key = (prefix + "idempotency_key", field) if field else (KEY_HEADER, header)
    if len(key.encode()) > MAX_KEY_BYTES:
        raise invalid(where, f"longer than {MAX_KEY_BYTES} bytes")
    if key.startswith(BATCH_KEY_PREFIX):  # batch items' keys: a caller's key must never collide with one
        raise invalid(where, f"keys starting with {BATCH_KEY_PREFIX!r} are reserved")
    return key


def longest_token_bytes(tokenizer: Tokenizer) -> int:
    """The most UTF-8 bytes any token's text has. A token covers at most as many prompt bytes as its text has
    (byte-level and SentencePiece vocabularies spell a byte with 1 to 6), so a prompt longer than the context
    times this cannot fit (docs/api.md, "Limits")."""
    return max((len(token.encode()) for token in tokenizer.get_vocab(with_added_tokens=True)), default=0)


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


def deterministic(request: inference_pb2.GenerateRequest) -> bool:
    return request.sampling.temperature == 0 or request.sampling.HasField("seed")


def streams(request: inference_pb2.GenerateRequest, settings: Settings) -> bool:
    """Streamed when asked for and the pool streams (the batch pool answers once, for throughput)."""
    return request.stream and getattr(settings.pools, pool_of(request)).stream


@dataclass(frozen=True, slots=True)
class Admission:
    """Builds Request records for the served model."""

    tokenizer: Tokenizer
    limits: Limits
    settings: Settings

    def admit(
        self,
        request: inference_pb2.GenerateRequest,
        tenant: str,
        key: str = "",
        traceparent: str = "",
        prefix: str = "",
        request_id: str | None = None,
    ) -> Request:
        """Validate and tokenize; raises ApiError (INVALID_ARGUMENT) naming the bad field."""
        validate_generate(request, self.limits, prefix)
        s = request.sampling
        stop_token_ids = list(s.stop_token_ids)
        which = request.WhichOneof("prompt")
        if which == "text":
            prompt_ids = self.tokenizer.encode(request.text).ids
            if not prompt_ids:
                raise invalid(prefix + "text", "tokenizes to no tokens")
        elif which == "messages":  # rendered through the model's chat template; stops at the end of the turn
            chat = self.limits.chat
            assert chat is not None  # validate_generate said so
            turns = [(m.role, m.content) for m in request.messages.messages]
            prompt_ids = chat.prompt_ids(turns, self.tokenizer, prefix + "messages")
            if not s.ignore_eos:
                stop_token_ids += [i for i in chat.end_of_turn_ids if i not in stop_token_ids]
        else:
            prompt_ids = list(request.token_ids.ids)
        max_tokens = resolve_max_tokens(len(prompt_ids), s.max_tokens, self.limits, prefix)
        request_id = request_id or request.request_id or uuid.uuid4().hex
        # What a takeover re-runs, kept in the store (with a key, for its retention): the request as claimed,
        # under this request id, with only the fields we understand.
        claimed = inference_pb2.GenerateRequest()
        claimed.CopyFrom(request)
        claimed.request_id = request_id
        claimed.DiscardUnknownFields()
        payload = claimed.SerializeToString()
        if len(payload) > MAX_PAYLOAD_BYTES:
            raise invalid(prefix + "prompt", f"a request is kept in the store for takeovers: at most "
                          f"{MAX_PAYLOAD_BYTES} bytes, this one is {len(payload)}")  # fmt: skip
        return Request(
            request_id=request_id,
            tenant=tenant,
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            pool=pool_of(request),
            sampling=worker_pb2.WorkerSampling(
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k,
                seed=worker_seed(s.seed if s.HasField("seed") else None),
                logprobs=s.logprobs,
            ),
            stop=list(s.stop),
            stop_token_ids=stop_token_ids,
            ignore_eos=s.ignore_eos,
            fingerprint=self._fingerprint(request, tenant, prompt_ids, max_tokens, stop_token_ids),
            shareable=request.dedup != inference_pb2.DEDUP_POLICY_OFF and deterministic(request),
            key=key,
            resumable=bool(key) or request.resumable,
            payload=payload,
            traceparent=traceparent,
            caller_seed=s.seed if s.HasField("seed") else None,
        )

    def _fingerprint(
        self,
        request: inference_pb2.GenerateRequest,
        tenant: str,
        prompt_ids: list[int],
        max_tokens: int,
        stop_token_ids: list[int],
    ) -> str:
        """What the caller asked for: the caller's sampling (their seed, not the worker's noise seed)."""
        s = request.sampling
        sampling = {
            "temperature": float(s.temperature),
            "top_p": float(s.top_p or 1.0),
            "top_k": int(s.top_k),
            "seed": int(s.seed) if s.HasField("seed") else None,
            "max_tokens": max_tokens,
            "ignore_eos": bool(s.ignore_eos),
            "logprobs": int(s.logprobs),
        }
        return fingerprint(tenant, self.limits.model_name, prompt_ids, sampling, list(s.stop), stop_token_ids)
