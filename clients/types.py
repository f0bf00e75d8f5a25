"""What the sync and asyncio clients share: result types, errors, request building. No I/O here."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypedDict

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from protos.coalesce.v1 import common_pb2, inference_pb2
from rpc.limits import INTERNAL_MESSAGE_BYTES
from security.local_token import read_local_token
from security.tls import client_channel_credentials

# Batch results can be big: receive up to the internal limit, well above gRPC's 4 MiB default.
CHANNEL_OPTIONS: list[tuple[str, int]] = [("grpc.max_receive_message_length", INTERNAL_MESSAGE_BYTES)]
Metadata = tuple[tuple[str, str], ...]
# A chat turn: {"role": ..., "content": ...}, a (role, content) pair, or the proto message.
Message = Mapping[str, str] | tuple[str, str] | inference_pb2.ChatMessage


class CoalesceError(Exception):
    """A failed call: the gRPC status plus the google.rpc details the server attached (ErrorInfo's reason,
    RetryInfo's delay, BadRequest's (field, description) pairs)."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        reason: str | None = None,
        retry_after: float | None = None,
        field_violations: list[tuple[str, str]] | None = None,
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.reason = reason
        self.retry_after = retry_after
        self.field_violations = field_violations or []


def error_with_details(code: grpc.StatusCode, message: str, details: Iterable[any_pb2.Any]) -> CoalesceError:
    reason = retry_after = None
    violations: list[tuple[str, str]] = []
    for detail in details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason = info.reason or None
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            retry_after = retry.retry_delay.ToTimedelta().total_seconds()
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations += [(v.field, v.description) for v in bad.field_violations]
    return CoalesceError(code, message, reason, retry_after, violations)


def error_from_rpc(err: grpc.RpcError) -> CoalesceError:
    """Convert a raised grpc (or grpc.aio) error, reading the google.rpc details from its trailers."""
    try:
        status = rpc_status.from_call(err)
    except ValueError:  # details inconsistent with the status: ignore them, keep code and message
        status = None
    return error_with_details(err.code(), err.details() or "", status.details if status is not None else ())


def session_error(err: inference_pb2.SessionError) -> CoalesceError:
    """A SessionError: the same details as a unary call's error."""
    codes = {c.value[0]: c for c in grpc.StatusCode}
    error = error_with_details(codes.get(err.code, grpc.StatusCode.UNKNOWN), err.message, err.details)
    error.reason = error.reason or err.reason or None
    return error


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(slots=True)
class Chunk:
    """One GenerateResponse; enum values become lower-case names ("length", "replayed"), unset ones None."""

    request_id: str
    offset: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    dedup_outcome: str | None = None
    queue_ms: float = 0.0
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)


@dataclass(slots=True)
class Result:
    """A whole generation, collected from its chunks."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    usage: Usage | None
    dedup_outcome: str | None
    queue_ms: float
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)


def _enum_name(enum: object, value: int, prefix: str) -> str | None:
    return None if value == 0 else enum.Name(value).removeprefix(prefix).lower()  # type: ignore[attr-defined]


def chunk_from_proto(msg: inference_pb2.GenerateResponse) -> Chunk:
    usage = None
    if msg.HasField("usage"):
        usage = Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens, msg.usage.cached_prompt_tokens)
    return Chunk(
        request_id=msg.request_id,
        offset=msg.offset,
        token_ids=list(msg.token_ids),
        text=msg.text,
        finish_reason=_enum_name(inference_pb2.FinishReason, msg.finish_reason, "FINISH_REASON_"),
        usage=usage,
        dedup_outcome=_enum_name(inference_pb2.DedupOutcome, msg.dedup_outcome, "DEDUP_OUTCOME_"),
        queue_ms=msg.queue_ms,
        logprobs=list(msg.logprobs),
    )


def collect(chunks: Iterable[Chunk]) -> Result:
    """Fold chunks into a Result: first-chunk fields from the first, last-chunk fields from the last."""
    result = Result("", [], "", None, None, None, 0.0)
    texts: list[str] = []
    for n, chunk in enumerate(chunks):
        if n == 0:
            result.request_id, result.dedup_outcome, result.queue_ms = (
                chunk.request_id,
                chunk.dedup_outcome,
                chunk.queue_ms,
            )
        result.token_ids += chunk.token_ids
        result.logprobs += chunk.logprobs
        texts.append(chunk.text)
        result.finish_reason = chunk.finish_reason or result.finish_reason
        result.usage = chunk.usage or result.usage
    result.text = "".join(texts)
    return result


class GenerateOptions(TypedDict, total=False):
    """`build_request`'s keywords, so `generate(prompt, **options)` is type-checked everywhere."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: Sequence[str]
    stop_token_ids: Sequence[int]
    ignore_eos: bool
    logprobs: int
    model: str
    resumable: bool
    pool: str
    stream: bool
    idempotency_key: str | None
    request_id: str | None
    dedup: str


def chat_messages(messages: Iterable[Message]) -> inference_pb2.ChatMessages:
    """The `messages` prompt of a GenerateRequest."""
    turns = []
    for m in messages:
        if isinstance(m, inference_pb2.ChatMessage):
            turns.append(m)
        elif isinstance(m, tuple):
            turns.append(inference_pb2.ChatMessage(role=m[0], content=m[1]))
        else:
            turns.append(inference_pb2.ChatMessage(role=m["role"], content=m["content"]))
    return inference_pb2.ChatMessages(messages=turns)


def build_request(
    prompt: str | Sequence[int] | inference_pb2.ChatMessages,
    *,
    max_tokens: int = 0,
    temperature: float = 0,
    top_p: float = 0,
    top_k: int = 0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    logprobs: int = 0,
    model: str = "",
    resumable: bool = False,
    pool: str = "interactive",
    stream: bool = True,
    idempotency_key: str | None = None,
    request_id: str | None = None,
    dedup: str = "auto",
) -> inference_pb2.GenerateRequest:
    """A GenerateRequest from keyword arguments; pool and dedup are names ("batch", "off"). The prompt is text,
    token ids, or a conversation (`chat_messages(...)`). Validation is the server's job; this only rejects what
    cannot be encoded."""
    sampling = inference_pb2.SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        max_tokens=max_tokens,
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
        logprobs=logprobs,
    )
    req = inference_pb2.GenerateRequest(
        sampling=sampling,
        pool=inference_pb2.Pool.Value("POOL_" + pool.upper()),
        stream=stream,
        request_id=request_id or "",
        idempotency_key=idempotency_key or "",
        dedup=inference_pb2.DedupPolicy.Value("DEDUP_POLICY_" + dedup.upper()),
        model=model,
        resumable=resumable,
    )
    if isinstance(prompt, str):
        req.text = prompt
    elif isinstance(prompt, inference_pb2.ChatMessages):
        req.messages.CopyFrom(prompt)
    else:
        req.token_ids.ids.extend(prompt)
    return req


def deadline_of(timeout: float | None) -> float | None:
    """A call's timeout as a point on the monotonic clock, so every retry and resume shares it."""
    return None if timeout is None else time.monotonic() + timeout


def time_left(deadline: float | None) -> float | None:
    """The timeout to give the next call (never negative: a spent deadline fails at once)."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def with_key(req: inference_pb2.GenerateRequest, retries: bool) -> inference_pb2.GenerateRequest:
    """Give the request an idempotency key when retries may resend it, so a retry never runs twice."""
    if retries and not req.idempotency_key:
        req = inference_pb2.GenerateRequest.FromString(req.SerializeToString())
        req.idempotency_key = str(uuid.uuid4())
    return req


TOKEN_ENV = "COALESCE_TOKEN"


def default_token() -> str | None:
    """The bearer token to send when none is given: $COALESCE_TOKEN, else the local token that `coalesce
    serve` accepts on this machine (docs/security.md), else none."""
    return os.environ.get(TOKEN_ENV) or read_local_token()


@dataclass(frozen=True, slots=True)
class Tls:
    """TLS to the control plane: trust `ca_file` (default: the system's roots); present a client certificate
    when the server requires one."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""

    def credentials(self) -> grpc.ChannelCredentials:
        return client_channel_credentials(self.ca_file, self.cert_file, self.key_file)


def tls_of(args: object) -> Tls | None:
    """TLS from the CLI's --tls-ca/--tls-cert/--tls-key flags (None: plaintext)."""
    files = [getattr(args, f"tls_{name}", None) or "" for name in ("ca", "cert", "key")]
    return Tls(*files) if any(files) else None


def call_metadata(token: str | None, idempotency_key: str = "") -> Metadata:
    md: list[tuple[str, str]] = []
    if token:
        md.append(("authorization", f"Bearer {token}"))
    if idempotency_key:  # the field carries it too; the header is what proxies and other stacks look at
        md.append(("x-idempotency-key", idempotency_key))
    return tuple(md)


def batch_items(
    items: Iterable[inference_pb2.BatchItem | tuple[str, inference_pb2.GenerateRequest]],
) -> list[inference_pb2.BatchItem]:
    return [
        it if isinstance(it, inference_pb2.BatchItem) else inference_pb2.BatchItem(seq_id=it[0], request=it[1])
        for it in items
    ]
