"""gRPC errors with google.rpc details: BadRequest field violations, ErrorInfo, RetryInfo. docs/api.md has the
table of codes and reasons; a reason names the cause, never repeats the code."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "coalesce.v1"
log = logging.getLogger(__name__)


@dataclass
class ApiError(Exception):
    """An error to return to the caller as a gRPC status; raised anywhere in the request path."""

    code: grpc.StatusCode
    message: str
    reason: str = ""
    # (field path, description) pairs for BadRequest.
    violations: list[tuple[str, str]] = field(default_factory=list)
    retry_after_s: float | None = None

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"

    def details(self) -> list[any_pb2.Any]:
        """The google.rpc details, as a unary status carries them and a SessionError repeats them."""
        details: list[any_pb2.Any] = []
        if self.violations:
            bad = error_details_pb2.BadRequest(
                field_violations=[
                    error_details_pb2.BadRequest.FieldViolation(field=f, description=d) for f, d in self.violations
                ]
            )
            details.append(_pack(bad))
        if self.reason:
            details.append(_pack(error_details_pb2.ErrorInfo(reason=self.reason, domain=DOMAIN)))
        if self.retry_after_s is not None:
            delay = duration_pb2.Duration()
            delay.FromMilliseconds(max(1, round(self.retry_after_s * 1000)))
            details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
        return details

    def to_status(self) -> grpc.Status:
        proto = status_pb2.Status(code=self.code.value[0], message=self.message, details=self.details())
        return rpc_status.to_status(proto)

    async def abort(self, context: grpc.aio.ServicerContext) -> None:
        status = self.to_status()
        await context.abort(status.code, status.details, status.trailing_metadata)


def _pack(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def invalid(field_path: str, description: str, reason: str = "INVALID_FIELD") -> ApiError:
    """INVALID_ARGUMENT for one field; the message names the field."""
    return invalid_fields([(field_path, description)], reason)


def invalid_fields(violations: list[tuple[str, str]], reason: str = "INVALID_FIELD") -> ApiError:
    message = "; ".join(f"{f}: {d}" for f, d in violations)
    return ApiError(grpc.StatusCode.INVALID_ARGUMENT, message, reason, violations)


def unauthenticated(message: str) -> ApiError:
    return ApiError(grpc.StatusCode.UNAUTHENTICATED, message, "UNAUTHENTICATED")


def too_long(field_path: str, description: str) -> ApiError:
    """INVALID_ARGUMENT: the prompt (with max_tokens) does not fit the model's context."""
    return invalid(field_path, description, "CONTEXT_LENGTH_EXCEEDED")


def out_of_range(field_path: str, description: str) -> ApiError:
    """OUT_OF_RANGE: an offset past the tokens there are (or can be)."""
    return ApiError(
        grpc.StatusCode.OUT_OF_RANGE, f"{field_path}: {description}", "OFFSET_OUT_OF_RANGE", [(field_path, description)]
    )


def not_found(what: str, reason: str = "REQUEST_NOT_FOUND") -> ApiError:
    return ApiError(grpc.StatusCode.NOT_FOUND, what, reason)


def exhausted(message: str, retry_after_s: float, reason: str = "QUEUE_FULL") -> ApiError:
    return ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED, message, reason, retry_after_s=retry_after_s)


def unavailable(message: str, reason: str, retry_after_s: float | None = 1.0) -> ApiError:
    return ApiError(grpc.StatusCode.UNAVAILABLE, message, reason, retry_after_s=retry_after_s)


def store_down(exc: Exception) -> ApiError:
    """UNAVAILABLE for a dedup store that cannot be reached: retry later, never a silent duplicate. What went
    wrong is logged here, not told to the caller (it would name our infrastructure)."""
    log.warning("dedup store unavailable: %s", exc)
    return unavailable("the dedup store is unavailable", "STORE_UNAVAILABLE")


def step_failed() -> ApiError:
    """INTERNAL for a request whose step raised on the worker, or that was in flight whenever its worker crashed
    (the cause is logged, not told to the caller)."""
    return ApiError(
        grpc.StatusCode.INTERNAL,
        "the worker failed while computing this request (logged on the server); it was not retried, as it would "
        "fail again",
        "WORKER_STEP_FAILED",
    )


def id_in_use(request_id: str) -> ApiError:
    return ApiError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {request_id!r} is already in use", "REQUEST_ID_IN_USE")


def key_reused(what: str) -> ApiError:
    """FAILED_PRECONDITION: an idempotency key (or batch item) seen before with another request payload."""
    return ApiError(
        grpc.StatusCode.FAILED_PRECONDITION, f"{what} was used for another request payload", "IDEMPOTENCY_KEY_REUSED"
    )


def stored_error(text: str) -> ApiError:
    """An error replayed from its "CODE: message" form (a FAILED record, a finished log)."""
    name, _, message = text.partition(": ")
    code = getattr(grpc.StatusCode, name, grpc.StatusCode.UNKNOWN)
    return ApiError(code, message or text, "REPLAYED_ERROR")


def stream_id_in_use(stream_id: str, action: str) -> ApiError:
    """ALREADY_EXISTS on a Session: the message is refused, the generation running under that id goes on."""
    why = "names a generation running on this session"
    return ApiError(
        grpc.StatusCode.ALREADY_EXISTS,
        f"stream_id {stream_id!r} {why}: this {action} message was refused; the running generation continues",
        "STREAM_ID_IN_USE",
        [("stream_id", why)],
    )


def stream_not_found(stream_id: str) -> ApiError:
    return ApiError(
        grpc.StatusCode.NOT_FOUND, f"stream_id {stream_id!r} names no generation on this session", "STREAM_NOT_FOUND"
    )
