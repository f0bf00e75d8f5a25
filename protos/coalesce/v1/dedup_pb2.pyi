from protos.coalesce.v1 import inference_pb2 as _inference_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RecordState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RECORD_STATE_UNSPECIFIED: _ClassVar[RecordState]
    RECORD_STATE_INIT: _ClassVar[RecordState]
    RECORD_STATE_PROCESSING: _ClassVar[RecordState]
    RECORD_STATE_SUCCESS: _ClassVar[RecordState]
    RECORD_STATE_FAILED: _ClassVar[RecordState]
RECORD_STATE_UNSPECIFIED: RecordState
RECORD_STATE_INIT: RecordState
RECORD_STATE_PROCESSING: RecordState
RECORD_STATE_SUCCESS: RecordState
RECORD_STATE_FAILED: RecordState

class LookupRequest(_message.Message):
    __slots__ = ("tenant", "idempotency_key", "request_id")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    idempotency_key: str
    request_id: str
    def __init__(self, tenant: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("state", "owner", "epoch", "fingerprint", "request_id", "logged_tokens", "ttl_ms", "text", "error")
    STATE_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LOGGED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    state: RecordState
    owner: str
    epoch: int
    fingerprint: str
    request_id: str
    logged_tokens: int
    ttl_ms: int
    text: str
    error: str
    def __init__(self, state: _Optional[_Union[RecordState, str]] = ..., owner: _Optional[str] = ..., epoch: _Optional[int] = ..., fingerprint: _Optional[str] = ..., request_id: _Optional[str] = ..., logged_tokens: _Optional[int] = ..., ttl_ms: _Optional[int] = ..., text: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class PurgeRequest(_message.Message):
    __slots__ = ("tenant", "idempotency_key", "request_id")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    idempotency_key: str
    request_id: str
    def __init__(self, tenant: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class PurgeResponse(_message.Message):
    __slots__ = ("purged",)
    PURGED_FIELD_NUMBER: _ClassVar[int]
    purged: bool
    def __init__(self, purged: _Optional[bool] = ...) -> None: ...

class ListBatchRequest(_message.Message):
    __slots__ = ("tenant", "batch_id")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    batch_id: str
    def __init__(self, tenant: _Optional[str] = ..., batch_id: _Optional[str] = ...) -> None: ...

class ListBatchResponse(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[_inference_pb2.BatchItemStatus]
    def __init__(self, items: _Optional[_Iterable[_Union[_inference_pb2.BatchItemStatus, _Mapping]]] = ...) -> None: ...
