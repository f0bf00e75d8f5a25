from protos.coalesce.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model_name", "architecture", "vocab_size", "eos_token_ids", "max_context", "block_size", "num_blocks", "dtype", "device", "tokenizer_json", "bos_token_id", "chat_template", "special_tokens", "kv_cache_dtype", "kv_block_units", "kv_tail_blocks")
    class SpecialTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_UNITS_FIELD_NUMBER: _ClassVar[int]
    KV_TAIL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    architecture: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_context: int
    block_size: int
    num_blocks: int
    dtype: str
    device: str
    tokenizer_json: bytes
    bos_token_id: int
    chat_template: str
    special_tokens: _containers.ScalarMap[str, str]
    kv_cache_dtype: str
    kv_block_units: int
    kv_tail_blocks: int
    def __init__(self, model_name: _Optional[str] = ..., architecture: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., max_context: _Optional[int] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., tokenizer_json: _Optional[bytes] = ..., bos_token_id: _Optional[int] = ..., chat_template: _Optional[str] = ..., special_tokens: _Optional[_Mapping[str, str]] = ..., kv_cache_dtype: _Optional[str] = ..., kv_block_units: _Optional[int] = ..., kv_tail_blocks: _Optional[int] = ...) -> None: ...

class WorkerSampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ...) -> None: ...

class SequenceWork(_message.Message):
    __slots__ = ("seq_id", "token_ids", "start_position", "new_blocks", "sampling", "sample", "traceparent", "tail_blocks")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TAIL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    start_position: int
    new_blocks: _containers.RepeatedScalarFieldContainer[int]
    sampling: WorkerSampling
    sample: bool
    traceparent: str
    tail_blocks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., start_position: _Optional[int] = ..., new_blocks: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[WorkerSampling, _Mapping]] = ..., sample: _Optional[bool] = ..., traceparent: _Optional[str] = ..., tail_blocks: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: int
    dst: int
    def __init__(self, src: _Optional[int] = ..., dst: _Optional[int] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("step_id", "seqs", "release", "copies", "kv_to_int8")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    KV_TO_INT8_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    seqs: _containers.RepeatedCompositeFieldContainer[SequenceWork]
    release: _containers.RepeatedScalarFieldContainer[int]
    copies: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    kv_to_int8: bool
    def __init__(self, step_id: _Optional[int] = ..., seqs: _Optional[_Iterable[_Union[SequenceWork, _Mapping]]] = ..., release: _Optional[_Iterable[int]] = ..., copies: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., kv_to_int8: _Optional[bool] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("seq_id", "token")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token: _common_pb2.TokenLogprob
    def __init__(self, seq_id: _Optional[int] = ..., token: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("step_id", "tokens", "forward_ms", "step_ms", "num_tokens")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_MS_FIELD_NUMBER: _ClassVar[int]
    STEP_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    tokens: _containers.RepeatedCompositeFieldContainer[SampledToken]
    forward_ms: float
    step_ms: float
    num_tokens: int
    def __init__(self, step_id: _Optional[int] = ..., tokens: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., forward_ms: _Optional[float] = ..., step_ms: _Optional[float] = ..., num_tokens: _Optional[int] = ...) -> None: ...
