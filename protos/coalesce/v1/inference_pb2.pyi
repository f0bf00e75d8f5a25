from protos.coalesce.v1 import common_pb2 as _common_pb2
from google.protobuf import any_pb2 as _any_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Pool(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOL_UNSPECIFIED: _ClassVar[Pool]
    POOL_INTERACTIVE: _ClassVar[Pool]
    POOL_BATCH: _ClassVar[Pool]

class DedupPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEDUP_POLICY_UNSPECIFIED: _ClassVar[DedupPolicy]
    DEDUP_POLICY_AUTO: _ClassVar[DedupPolicy]
    DEDUP_POLICY_OFF: _ClassVar[DedupPolicy]

class DedupOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEDUP_OUTCOME_UNSPECIFIED: _ClassVar[DedupOutcome]
    DEDUP_OUTCOME_MISS: _ClassVar[DedupOutcome]
    DEDUP_OUTCOME_COALESCED: _ClassVar[DedupOutcome]
    DEDUP_OUTCOME_REPLAYED: _ClassVar[DedupOutcome]
    DEDUP_OUTCOME_TAKEOVER: _ClassVar[DedupOutcome]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class ItemState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ITEM_STATE_UNSPECIFIED: _ClassVar[ItemState]
    ITEM_STATE_INIT: _ClassVar[ItemState]
    ITEM_STATE_PROCESSING: _ClassVar[ItemState]
    ITEM_STATE_SUCCESS: _ClassVar[ItemState]
    ITEM_STATE_FAILED: _ClassVar[ItemState]
POOL_UNSPECIFIED: Pool
POOL_INTERACTIVE: Pool
POOL_BATCH: Pool
DEDUP_POLICY_UNSPECIFIED: DedupPolicy
DEDUP_POLICY_AUTO: DedupPolicy
DEDUP_POLICY_OFF: DedupPolicy
DEDUP_OUTCOME_UNSPECIFIED: DedupOutcome
DEDUP_OUTCOME_MISS: DedupOutcome
DEDUP_OUTCOME_COALESCED: DedupOutcome
DEDUP_OUTCOME_REPLAYED: DedupOutcome
DEDUP_OUTCOME_TAKEOVER: DedupOutcome
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_ERROR: FinishReason
ITEM_STATE_UNSPECIFIED: ItemState
ITEM_STATE_INIT: ItemState
ITEM_STATE_PROCESSING: ItemState
ITEM_STATE_SUCCESS: ItemState
ITEM_STATE_FAILED: ItemState

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("text", "token_ids", "messages", "sampling", "pool", "stream", "request_id", "idempotency_key", "dedup", "model", "resumable")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    DEDUP_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    RESUMABLE_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    messages: ChatMessages
    sampling: SamplingParams
    pool: Pool
    stream: bool
    request_id: str
    idempotency_key: str
    dedup: DedupPolicy
    model: str
    resumable: bool
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., pool: _Optional[_Union[Pool, str]] = ..., stream: _Optional[bool] = ..., request_id: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., dedup: _Optional[_Union[DedupPolicy, str]] = ..., model: _Optional[str] = ..., resumable: _Optional[bool] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "offset", "token_ids", "text", "logprobs", "finish_reason", "usage", "dedup_outcome", "queue_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    DEDUP_OUTCOME_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    offset: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finish_reason: FinishReason
    usage: Usage
    dedup_outcome: DedupOutcome
    queue_ms: float
    def __init__(self, request_id: _Optional[str] = ..., offset: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., dedup_outcome: _Optional[_Union[DedupOutcome, str]] = ..., queue_ms: _Optional[float] = ...) -> None: ...

class SessionGenerate(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: GenerateRequest
    def __init__(self, request: _Optional[_Union[GenerateRequest, _Mapping]] = ...) -> None: ...

class SessionCancel(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionResume(_message.Message):
    __slots__ = ("request_id", "offset")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    offset: int
    def __init__(self, request_id: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class SessionAck(_message.Message):
    __slots__ = ("offset",)
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    offset: int
    def __init__(self, offset: _Optional[int] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("stream_id", "generate", "cancel", "resume", "ack")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    generate: SessionGenerate
    cancel: SessionCancel
    resume: SessionResume
    ack: SessionAck
    def __init__(self, stream_id: _Optional[str] = ..., generate: _Optional[_Union[SessionGenerate, _Mapping]] = ..., cancel: _Optional[_Union[SessionCancel, _Mapping]] = ..., resume: _Optional[_Union[SessionResume, _Mapping]] = ..., ack: _Optional[_Union[SessionAck, _Mapping]] = ...) -> None: ...

class SessionError(_message.Message):
    __slots__ = ("code", "message", "reason", "details", "generation_continues")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_CONTINUES_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    reason: str
    details: _containers.RepeatedCompositeFieldContainer[_any_pb2.Any]
    generation_continues: bool
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., reason: _Optional[str] = ..., details: _Optional[_Iterable[_Union[_any_pb2.Any, _Mapping]]] = ..., generation_continues: _Optional[bool] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("stream_id", "chunk", "error")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    chunk: GenerateResponse
    error: SessionError
    def __init__(self, stream_id: _Optional[str] = ..., chunk: _Optional[_Union[GenerateResponse, _Mapping]] = ..., error: _Optional[_Union[SessionError, _Mapping]] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("request_id", "offset")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    offset: int
    def __init__(self, request_id: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("chunk",)
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    chunk: GenerateResponse
    def __init__(self, chunk: _Optional[_Union[GenerateResponse, _Mapping]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...

class BatchItem(_message.Message):
    __slots__ = ("seq_id", "request")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    request: GenerateRequest
    def __init__(self, seq_id: _Optional[str] = ..., request: _Optional[_Union[GenerateRequest, _Mapping]] = ...) -> None: ...

class SubmitBatchRequest(_message.Message):
    __slots__ = ("batch_id", "items")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    items: _containers.RepeatedCompositeFieldContainer[BatchItem]
    def __init__(self, batch_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[BatchItem, _Mapping]]] = ...) -> None: ...

class SubmitBatchResponse(_message.Message):
    __slots__ = ("batch_id", "queued", "skipped")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    queued: int
    skipped: int
    def __init__(self, batch_id: _Optional[str] = ..., queued: _Optional[int] = ..., skipped: _Optional[int] = ...) -> None: ...

class BatchItemStatus(_message.Message):
    __slots__ = ("seq_id", "state", "request_id", "text", "token_ids", "finish_reason", "usage", "error")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    state: ItemState
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    usage: Usage
    error: str
    def __init__(self, seq_id: _Optional[str] = ..., state: _Optional[_Union[ItemState, str]] = ..., request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., error: _Optional[str] = ...) -> None: ...

class GetBatchRequest(_message.Message):
    __slots__ = ("batch_id",)
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    def __init__(self, batch_id: _Optional[str] = ...) -> None: ...

class GetBatchResponse(_message.Message):
    __slots__ = ("batch_id", "items")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    items: _containers.RepeatedCompositeFieldContainer[BatchItemStatus]
    def __init__(self, batch_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[BatchItemStatus, _Mapping]]] = ...) -> None: ...

class WatchBatchRequest(_message.Message):
    __slots__ = ("batch_id",)
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    batch_id: str
    def __init__(self, batch_id: _Optional[str] = ...) -> None: ...

class WatchBatchResponse(_message.Message):
    __slots__ = ("item",)
    ITEM_FIELD_NUMBER: _ClassVar[int]
    item: BatchItemStatus
    def __init__(self, item: _Optional[_Union[BatchItemStatus, _Mapping]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model", "architecture", "vocab_size", "max_context", "eos_token_ids", "workers", "dtype", "has_chat_template", "kv_cache_dtype", "limits")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    vocab_size: int
    max_context: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    workers: int
    dtype: str
    has_chat_template: bool
    kv_cache_dtype: str
    limits: RequestLimits
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., workers: _Optional[int] = ..., dtype: _Optional[str] = ..., has_chat_template: _Optional[bool] = ..., kv_cache_dtype: _Optional[str] = ..., limits: _Optional[_Union[RequestLimits, _Mapping]] = ...) -> None: ...

class RequestLimits(_message.Message):
    __slots__ = ("max_request_bytes", "max_prompt_bytes", "max_stop_strings", "max_stop_bytes", "max_logprobs", "default_max_tokens", "max_request_id_chars", "max_idempotency_key_bytes", "max_batch_items", "resume_grace_s")
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_ID_CHARS_FIELD_NUMBER: _ClassVar[int]
    MAX_IDEMPOTENCY_KEY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_ITEMS_FIELD_NUMBER: _ClassVar[int]
    RESUME_GRACE_S_FIELD_NUMBER: _ClassVar[int]
    max_request_bytes: int
    max_prompt_bytes: int
    max_stop_strings: int
    max_stop_bytes: int
    max_logprobs: int
    default_max_tokens: int
    max_request_id_chars: int
    max_idempotency_key_bytes: int
    max_batch_items: int
    resume_grace_s: float
    def __init__(self, max_request_bytes: _Optional[int] = ..., max_prompt_bytes: _Optional[int] = ..., max_stop_strings: _Optional[int] = ..., max_stop_bytes: _Optional[int] = ..., max_logprobs: _Optional[int] = ..., default_max_tokens: _Optional[int] = ..., max_request_id_chars: _Optional[int] = ..., max_idempotency_key_bytes: _Optional[int] = ..., max_batch_items: _Optional[int] = ..., resume_grace_s: _Optional[float] = ...) -> None: ...
