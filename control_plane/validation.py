"""Validation of public requests (pure): every violation is reported with its field path."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from control_plane.chat import ChatTemplate, message_violations
from control_plane.config import Settings
from control_plane.errors import invalid_fields, too_long
from protos.coalesce.v1 import inference_pb2, worker_pb2

MAX_REQUEST_ID_CHARS = 128
REQUEST_ID = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_REQUEST_ID_CHARS}}}")
MAX_STOP_BYTES = 256
MAX_KEY_BYTES = 256
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 100.0


@dataclass(frozen=True, slots=True)
class Limits:
    """What the served model and the settings allow."""

    model_name: str
    vocab_size: int
    max_context: int
    default_max_tokens: int
    max_stop_strings: int
    max_stop_token_ids: int = 64
    max_token_bytes: int = 0  # UTF-8 bytes of the longest token's text; 0: unknown (no byte check)
    chat: ChatTemplate | None = None  # None: the model has no chat template

    @classmethod
    def of(
        cls,
        info: worker_pb2.InfoResponse,
        settings: Settings,
        max_token_bytes: int = 0,
        chat: ChatTemplate | None = None,
    ) -> Limits:
        """The limits of the model a worker serves, under these settings."""
        return cls(info.model_name, info.vocab_size, info.max_context, settings.default_max_tokens,
                   settings.max_stop_strings, settings.max_stop_token_ids, max_token_bytes, chat)  # fmt: skip

    @property
    def max_prompt_bytes(self) -> int:
        """Longer text prompts cannot fit the context: refused before tokenizing; 0 means no such check."""
        return self.max_context * self.max_token_bytes


def validate_generate(req: inference_pb2.GenerateRequest, limits: Limits, prefix: str = "") -> None:
    """Raise INVALID_ARGUMENT listing every bad field of a GenerateRequest (before tokenization)."""
    which = req.WhichOneof("prompt")
    if which == "text" and limits.max_prompt_bytes and len(req.text.encode()) > limits.max_prompt_bytes:
        raise too_long(prefix + "text", f"{len(req.text.encode())} bytes; at most {limits.max_prompt_bytes} bytes can "
                       f"fit the model's context of {limits.max_context} tokens")  # fmt: skip
    v: list[tuple[str, str]] = []
    if which is None:
        v.append((prefix + "prompt", "set one of text, token_ids or messages"))
    elif which == "text" and not req.text:
        v.append((prefix + "text", "must not be empty"))
    elif which == "token_ids":
        if not req.token_ids.ids:
            v.append((prefix + "token_ids.ids", "must not be empty"))
        bad = next((i for i, t in enumerate(req.token_ids.ids) if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            v.append((f"{prefix}token_ids.ids[{bad}]", f"{req.token_ids.ids[bad]} is outside [0, {limits.vocab_size})"))
    elif which == "messages":
        turns = [(m.role, m.content) for m in req.messages.messages]
        v += message_violations(turns, limits.chat, prefix + "messages")
    s = req.sampling
    sp = prefix + "sampling."
    if not (math.isfinite(s.temperature) and 0 <= s.temperature <= MAX_TEMPERATURE):
        v.append((sp + "temperature", f"{s.temperature} is outside [0, {MAX_TEMPERATURE:g}]"))
    if not (math.isfinite(s.top_p) and 0 <= s.top_p <= 1):
        v.append((sp + "top_p", f"{s.top_p} is outside (0, 1] (0 means 1)"))
    if s.top_k < 0:
        v.append((sp + "top_k", f"{s.top_k} is negative"))
    if s.max_tokens < 0:
        v.append((sp + "max_tokens", f"{s.max_tokens} must be >= 1 (0 means the default)"))
    if not 0 <= s.logprobs <= MAX_LOGPROBS:
        v.append((sp + "logprobs", f"{s.logprobs} is outside [0, {MAX_LOGPROBS}]"))
    if len(s.stop) > limits.max_stop_strings:
        v.append((sp + "stop", f"{len(s.stop)} stop strings; at most {limits.max_stop_strings}"))
    for i, stop in enumerate(s.stop):
        if not stop or len(stop.encode()) > MAX_STOP_BYTES:
            v.append((f"{sp}stop[{i}]", f"must be 1 to {MAX_STOP_BYTES} bytes"))
    if len(s.stop_token_ids) > limits.max_stop_token_ids:
        v.append(
            (sp + "stop_token_ids", f"{len(s.stop_token_ids)} stop token ids; at most {limits.max_stop_token_ids}")
        )
    for i, t in enumerate(s.stop_token_ids[: limits.max_stop_token_ids]):
        if not 0 <= t < limits.vocab_size:
            v.append((f"{sp}stop_token_ids[{i}]", f"{t} is outside [0, {limits.vocab_size})"))
    if req.pool not in inference_pb2.Pool.values():
        v.append((prefix + "pool", f"unknown pool {req.pool}"))
    if req.dedup not in inference_pb2.DedupPolicy.values():
        v.append((prefix + "dedup", f"unknown dedup policy {req.dedup}"))
    if req.request_id and not REQUEST_ID.fullmatch(req.request_id):
        v.append((prefix + "request_id", f"must be 1 to {MAX_REQUEST_ID_CHARS} characters of [A-Za-z0-9._:-]"))
    if len(req.idempotency_key.encode()) > MAX_KEY_BYTES:
        v.append((prefix + "idempotency_key", f"longer than {MAX_KEY_BYTES} bytes"))
    if req.model and req.model != limits.model_name:
        v.append((prefix + "model", f"{req.model!r} is not served here (this server serves {limits.model_name!r})"))
    if v:
        raise invalid_fields(v)


def resolve_max_tokens(prompt_tokens: int, requested: int, limits: Limits, prefix: str = "") -> int:
    """The completion budget: requested (or the default, capped by the context); over the context is an error."""
    if prompt_tokens >= limits.max_context:
        raise too_long(
            prefix + "prompt",
            f"prompt has {prompt_tokens} tokens; the model's context is {limits.max_context} tokens",
        )
    if requested == 0:
        return min(limits.default_max_tokens, limits.max_context - prompt_tokens)
    if prompt_tokens + requested > limits.max_context:
        raise too_long(
            prefix + "sampling.max_tokens",
            f"prompt ({prompt_tokens} tokens) + max_tokens ({requested}) = {prompt_tokens + requested} "
            f"exceeds the model's context of {limits.max_context} tokens",
        )
    return requested
