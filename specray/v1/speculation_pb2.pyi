from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("data", "dtype", "shape")
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, data: _Optional[bytes] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class DraftProbs(_message.Message):
    __slots__ = ("encoding", "vocab_size", "values", "token_ids")
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    encoding: str
    vocab_size: int
    values: Tensor
    token_ids: Tensor
    def __init__(self, encoding: _Optional[str] = ..., vocab_size: _Optional[int] = ..., values: _Optional[_Union[Tensor, _Mapping]] = ..., token_ids: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class DraftBlock(_message.Message):
    __slots__ = ("request_id", "step", "num_committed", "token_ids", "draft_probs", "num_target_features")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_TARGET_FEATURES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    step: int
    num_committed: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_probs: DraftProbs
    num_target_features: int
    def __init__(self, request_id: _Optional[str] = ..., step: _Optional[int] = ..., num_committed: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., draft_probs: _Optional[_Union[DraftProbs, _Mapping]] = ..., num_target_features: _Optional[int] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("request_id", "step", "num_accepted", "token_ids", "dropped_reason", "target_features", "features_start")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_REASON_FIELD_NUMBER: _ClassVar[int]
    TARGET_FEATURES_FIELD_NUMBER: _ClassVar[int]
    FEATURES_START_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    step: int
    num_accepted: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    dropped_reason: str
    target_features: Tensor
    features_start: int
    def __init__(self, request_id: _Optional[str] = ..., step: _Optional[int] = ..., num_accepted: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., dropped_reason: _Optional[str] = ..., target_features: _Optional[_Union[Tensor, _Mapping]] = ..., features_start: _Optional[int] = ...) -> None: ...

class DraftUp(_message.Message):
    __slots__ = ("worker_id", "blocks", "replies")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    blocks: _containers.RepeatedCompositeFieldContainer[DraftBlock]
    replies: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, worker_id: _Optional[str] = ..., blocks: _Optional[_Iterable[_Union[DraftBlock, _Mapping]]] = ..., replies: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DraftDown(_message.Message):
    __slots__ = ("verdicts", "command")
    VERDICTS_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    verdicts: _containers.RepeatedCompositeFieldContainer[Verdict]
    command: bytes
    def __init__(self, verdicts: _Optional[_Iterable[_Union[Verdict, _Mapping]]] = ..., command: _Optional[bytes] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("status", "role", "vocab_size")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    status: str
    role: str
    vocab_size: int
    def __init__(self, status: _Optional[str] = ..., role: _Optional[str] = ..., vocab_size: _Optional[int] = ...) -> None: ...
