from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union
from pdserve.v1.common_pb2 import SamplingParams as SamplingParams
from pdserve.v1.common_pb2 import StructuredOutput as StructuredOutput
from pdserve.v1.common_pb2 import TokenLogprob as TokenLogprob

DESCRIPTOR: _descriptor.FileDescriptor

class TransferRecord(_message.Message):
    __slots__ = ("transfer_id", "bytes", "ms", "outcome", "path", "error")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    MS_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    bytes: int
    ms: float
    outcome: str
    path: str
    error: str
    def __init__(self, transfer_id: _Optional[int] = ..., bytes: _Optional[int] = ..., ms: _Optional[float] = ..., outcome: _Optional[str] = ..., path: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class KVTarget(_message.Message):
    __slots__ = ("transfer_id", "kv_endpoint", "decode_worker_id")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    kv_endpoint: str
    decode_worker_id: str
    def __init__(self, transfer_id: _Optional[int] = ..., kv_endpoint: _Optional[str] = ..., decode_worker_id: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "target", "num_output_tokens", "deadline_unix_ms", "age_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    AGE_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    target: KVTarget
    num_output_tokens: int
    deadline_unix_ms: int
    age_ms: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., target: _Optional[_Union[KVTarget, _Mapping]] = ..., num_output_tokens: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ..., age_ms: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "token", "cached_tokens", "queue_ms", "compute_ms", "transfer_ms", "transfer", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token: _common_pb2.TokenLogprob
    cached_tokens: int
    queue_ms: float
    compute_ms: float
    transfer_ms: float
    transfer: TransferRecord
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., token: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., cached_tokens: _Optional[int] = ..., queue_ms: _Optional[float] = ..., compute_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., transfer: _Optional[_Union[TransferRecord, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrefillStats(_message.Message):
    __slots__ = ("worker_id", "num_waiting", "num_queued_tokens", "num_running", "kv_blocks_used", "kv_blocks_total", "kv_blocks_cached", "prefix_cache_hit_rate", "prompt_tokens_per_s", "num_prefills", "transfer_bytes", "transfer_failures", "step_time_ms", "batch_size", "prompt_tokens_computed", "long_prefill_token_threshold", "num_queued_short_tokens")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    LONG_PREFILL_TOKEN_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_SHORT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    num_waiting: int
    num_queued_tokens: int
    num_running: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_blocks_cached: int
    prefix_cache_hit_rate: float
    prompt_tokens_per_s: float
    num_prefills: int
    transfer_bytes: int
    transfer_failures: int
    step_time_ms: float
    batch_size: float
    prompt_tokens_computed: int
    long_prefill_token_threshold: int
    num_queued_short_tokens: int
    def __init__(self, worker_id: _Optional[str] = ..., num_waiting: _Optional[int] = ..., num_queued_tokens: _Optional[int] = ..., num_running: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_cached: _Optional[int] = ..., prefix_cache_hit_rate: _Optional[float] = ..., prompt_tokens_per_s: _Optional[float] = ..., num_prefills: _Optional[int] = ..., transfer_bytes: _Optional[int] = ..., transfer_failures: _Optional[int] = ..., step_time_ms: _Optional[float] = ..., batch_size: _Optional[float] = ..., prompt_tokens_computed: _Optional[int] = ..., long_prefill_token_threshold: _Optional[int] = ..., num_queued_short_tokens: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "num_output_tokens", "sampling", "prefill_locally", "deadline_unix_ms", "kv_timeout_s", "age_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LOCALLY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    KV_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    AGE_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_output_tokens: int
    sampling: _common_pb2.SamplingParams
    prefill_locally: bool
    deadline_unix_ms: int
    kv_timeout_s: float
    age_ms: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., num_output_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., prefill_locally: _Optional[bool] = ..., deadline_unix_ms: _Optional[int] = ..., kv_timeout_s: _Optional[float] = ..., age_ms: _Optional[int] = ...) -> None: ...

class Accepted(_message.Message):
    __slots__ = ("transfer_id", "kv_endpoint", "decode_worker_id", "num_reserved_blocks", "cached_tokens")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    kv_endpoint: str
    decode_worker_id: str
    num_reserved_blocks: int
    cached_tokens: int
    def __init__(self, transfer_id: _Optional[int] = ..., kv_endpoint: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., num_reserved_blocks: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class Tokens(_message.Message):
    __slots__ = ("tokens", "prompt_logprobs")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, tokens: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("reason", "num_output_tokens")
    REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    reason: str
    num_output_tokens: int
    def __init__(self, reason: _Optional[str] = ..., num_output_tokens: _Optional[int] = ...) -> None: ...

class Preempted(_message.Message):
    __slots__ = ("output_token_ids", "reason")
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    reason: str
    def __init__(self, output_token_ids: _Optional[_Iterable[int]] = ..., reason: _Optional[str] = ...) -> None: ...

class ErrorEvent(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("accepted", "tokens", "finished", "preempted", "error")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    accepted: Accepted
    tokens: Tokens
    finished: Finished
    preempted: Preempted
    error: ErrorEvent
    def __init__(self, accepted: _Optional[_Union[Accepted, _Mapping]] = ..., tokens: _Optional[_Union[Tokens, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ..., preempted: _Optional[_Union[Preempted, _Mapping]] = ..., error: _Optional[_Union[ErrorEvent, _Mapping]] = ...) -> None: ...

class DecodeStats(_message.Message):
    __slots__ = ("worker_id", "num_running", "num_waiting_for_kv", "num_waiting", "kv_blocks_free", "kv_blocks_total", "step_time_ms", "generation_tokens_per_s", "num_preemptions", "num_finished", "kv_endpoint", "batch_size", "generation_tokens", "transfer_bytes_received")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FOR_KV_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_FIELD_NUMBER: _ClassVar[int]
    KV_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    num_running: int
    num_waiting_for_kv: int
    num_waiting: int
    kv_blocks_free: int
    kv_blocks_total: int
    step_time_ms: float
    generation_tokens_per_s: float
    num_preemptions: int
    num_finished: int
    kv_endpoint: str
    batch_size: float
    generation_tokens: int
    transfer_bytes_received: int
    def __init__(self, worker_id: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting_for_kv: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., step_time_ms: _Optional[float] = ..., generation_tokens_per_s: _Optional[float] = ..., num_preemptions: _Optional[int] = ..., num_finished: _Optional[int] = ..., kv_endpoint: _Optional[str] = ..., batch_size: _Optional[float] = ..., generation_tokens: _Optional[int] = ..., transfer_bytes_received: _Optional[int] = ...) -> None: ...
