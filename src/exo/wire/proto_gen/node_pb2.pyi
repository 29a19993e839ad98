from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InstanceState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INSTANCE_STATE_UNSPECIFIED: _ClassVar[InstanceState]
    INSTANCE_STATE_LOADING: _ClassVar[InstanceState]
    INSTANCE_STATE_READY: _ClassVar[InstanceState]
    INSTANCE_STATE_FAILED: _ClassVar[InstanceState]
    INSTANCE_STATE_STOPPING: _ClassVar[InstanceState]
INSTANCE_STATE_UNSPECIFIED: InstanceState
INSTANCE_STATE_LOADING: InstanceState
INSTANCE_STATE_READY: InstanceState
INSTANCE_STATE_FAILED: InstanceState
INSTANCE_STATE_STOPPING: InstanceState

class Caller(_message.Message):
    __slots__ = ("node_id", "boot_nonce", "grpc_port", "api_port", "namespace")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BOOT_NONCE_FIELD_NUMBER: _ClassVar[int]
    GRPC_PORT_FIELD_NUMBER: _ClassVar[int]
    API_PORT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    boot_nonce: int
    grpc_port: int
    api_port: int
    namespace: str
    def __init__(self, node_id: _Optional[str] = ..., boot_nonce: _Optional[int] = ..., grpc_port: _Optional[int] = ..., api_port: _Optional[int] = ..., namespace: _Optional[str] = ...) -> None: ...

class NodeInfoRequest(_message.Message):
    __slots__ = ("caller", "challenge")
    CALLER_FIELD_NUMBER: _ClassVar[int]
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    caller: Caller
    challenge: str
    def __init__(self, caller: _Optional[_Union[Caller, _Mapping]] = ..., challenge: _Optional[str] = ...) -> None: ...

class Link(_message.Message):
    __slots__ = ("node_id", "host", "grpc_port", "rtt_ms", "source")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    GRPC_PORT_FIELD_NUMBER: _ClassVar[int]
    RTT_MS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    host: str
    grpc_port: int
    rtt_ms: float
    source: str
    def __init__(self, node_id: _Optional[str] = ..., host: _Optional[str] = ..., grpc_port: _Optional[int] = ..., rtt_ms: _Optional[float] = ..., source: _Optional[str] = ...) -> None: ...

class ModelAvailability(_message.Message):
    __slots__ = ("model_id", "weights_bytes", "kv_bytes_per_token", "context_length", "n_layers", "layer_bytes", "embed_bytes", "output_bytes", "mtp_bytes", "full_attention_interval", "tensor_node_counts", "tensor_checked", "active_bytes")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LAYER_BYTES_FIELD_NUMBER: _ClassVar[int]
    EMBED_BYTES_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MTP_BYTES_FIELD_NUMBER: _ClassVar[int]
    FULL_ATTENTION_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    TENSOR_NODE_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_CHECKED_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    weights_bytes: int
    kv_bytes_per_token: int
    context_length: int
    n_layers: int
    layer_bytes: _containers.RepeatedScalarFieldContainer[int]
    embed_bytes: int
    output_bytes: int
    mtp_bytes: int
    full_attention_interval: int
    tensor_node_counts: _containers.RepeatedScalarFieldContainer[int]
    tensor_checked: bool
    active_bytes: int
    def __init__(self, model_id: _Optional[str] = ..., weights_bytes: _Optional[int] = ..., kv_bytes_per_token: _Optional[int] = ..., context_length: _Optional[int] = ..., n_layers: _Optional[int] = ..., layer_bytes: _Optional[_Iterable[int]] = ..., embed_bytes: _Optional[int] = ..., output_bytes: _Optional[int] = ..., mtp_bytes: _Optional[int] = ..., full_attention_interval: _Optional[int] = ..., tensor_node_counts: _Optional[_Iterable[int]] = ..., tensor_checked: _Optional[bool] = ..., active_bytes: _Optional[int] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "name", "version", "namespace", "api_port", "grpc_port", "boot_nonce", "memory_total_bytes", "memory_available_bytes", "chip", "backend", "disk_free_bytes", "instances", "links", "models", "proof", "secured", "uptime_s", "platform", "cpu_count", "downloads", "offline", "hub_cache_free_bytes", "decode_bytes_per_s")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    API_PORT_FIELD_NUMBER: _ClassVar[int]
    GRPC_PORT_FIELD_NUMBER: _ClassVar[int]
    BOOT_NONCE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_AVAILABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHIP_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DISK_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    LINKS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    SECURED_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    CPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    DOWNLOADS_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_FIELD_NUMBER: _ClassVar[int]
    HUB_CACHE_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DECODE_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    name: str
    version: str
    namespace: str
    api_port: int
    grpc_port: int
    boot_nonce: int
    memory_total_bytes: int
    memory_available_bytes: int
    chip: str
    backend: str
    disk_free_bytes: int
    instances: _containers.RepeatedCompositeFieldContainer[Instance]
    links: _containers.RepeatedCompositeFieldContainer[Link]
    models: _containers.RepeatedCompositeFieldContainer[ModelAvailability]
    proof: str
    secured: bool
    uptime_s: float
    platform: str
    cpu_count: int
    downloads: _containers.RepeatedCompositeFieldContainer[NodeDownload]
    offline: bool
    hub_cache_free_bytes: int
    decode_bytes_per_s: float
    def __init__(self, node_id: _Optional[str] = ..., name: _Optional[str] = ..., version: _Optional[str] = ..., namespace: _Optional[str] = ..., api_port: _Optional[int] = ..., grpc_port: _Optional[int] = ..., boot_nonce: _Optional[int] = ..., memory_total_bytes: _Optional[int] = ..., memory_available_bytes: _Optional[int] = ..., chip: _Optional[str] = ..., backend: _Optional[str] = ..., disk_free_bytes: _Optional[int] = ..., instances: _Optional[_Iterable[_Union[Instance, _Mapping]]] = ..., links: _Optional[_Iterable[_Union[Link, _Mapping]]] = ..., models: _Optional[_Iterable[_Union[ModelAvailability, _Mapping]]] = ..., proof: _Optional[str] = ..., secured: _Optional[bool] = ..., uptime_s: _Optional[float] = ..., platform: _Optional[str] = ..., cpu_count: _Optional[int] = ..., downloads: _Optional[_Iterable[_Union[NodeDownload, _Mapping]]] = ..., offline: _Optional[bool] = ..., hub_cache_free_bytes: _Optional[int] = ..., decode_bytes_per_s: _Optional[float] = ...) -> None: ...

class DownloadProgress(_message.Message):
    __slots__ = ("status", "bytes_done", "bytes_total", "files_done", "files_total", "speed_bytes_per_s", "eta_s", "elapsed_s")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FILES_DONE_FIELD_NUMBER: _ClassVar[int]
    FILES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SPEED_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    ETA_S_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    status: str
    bytes_done: int
    bytes_total: int
    files_done: int
    files_total: int
    speed_bytes_per_s: float
    eta_s: float
    elapsed_s: float
    def __init__(self, status: _Optional[str] = ..., bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., files_done: _Optional[int] = ..., files_total: _Optional[int] = ..., speed_bytes_per_s: _Optional[float] = ..., eta_s: _Optional[float] = ..., elapsed_s: _Optional[float] = ...) -> None: ...

class LayerRange(_message.Message):
    __slots__ = ("start_layer", "end_layer", "n_layers")
    START_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    start_layer: int
    end_layer: int
    n_layers: int
    def __init__(self, start_layer: _Optional[int] = ..., end_layer: _Optional[int] = ..., n_layers: _Optional[int] = ...) -> None: ...

class NodeDownload(_message.Message):
    __slots__ = ("download_id", "model_id", "repo", "revision", "progress", "stage", "created_unix", "error_code", "error_message")
    DOWNLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    REPO_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    download_id: str
    model_id: str
    repo: str
    revision: str
    progress: DownloadProgress
    stage: LayerRange
    created_unix: float
    error_code: str
    error_message: str
    def __init__(self, download_id: _Optional[str] = ..., model_id: _Optional[str] = ..., repo: _Optional[str] = ..., revision: _Optional[str] = ..., progress: _Optional[_Union[DownloadProgress, _Mapping]] = ..., stage: _Optional[_Union[LayerRange, _Mapping]] = ..., created_unix: _Optional[float] = ..., error_code: _Optional[str] = ..., error_message: _Optional[str] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("node_id", "status", "instances_ready", "uptime_s")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_READY_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    status: str
    instances_ready: int
    uptime_s: float
    def __init__(self, node_id: _Optional[str] = ..., status: _Optional[str] = ..., instances_ready: _Optional[int] = ..., uptime_s: _Optional[float] = ...) -> None: ...

class Shard(_message.Message):
    __slots__ = ("start_layer", "end_layer", "rank", "world_size", "sharding", "backend")
    START_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHARDING_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    start_layer: int
    end_layer: int
    rank: int
    world_size: int
    sharding: str
    backend: str
    def __init__(self, start_layer: _Optional[int] = ..., end_layer: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., sharding: _Optional[str] = ..., backend: _Optional[str] = ...) -> None: ...

class StagePlacement(_message.Message):
    __slots__ = ("node_id", "start_layer", "end_layer", "rank")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    START_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    start_layer: int
    end_layer: int
    rank: int
    def __init__(self, node_id: _Optional[str] = ..., start_layer: _Optional[int] = ..., end_layer: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class LoadInstanceRequest(_message.Message):
    __slots__ = ("instance_id", "model", "shard", "on_demand", "group_id", "stages", "owner_node")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    ON_DEMAND_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    OWNER_NODE_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    model: str
    shard: Shard
    on_demand: bool
    group_id: str
    stages: _containers.RepeatedCompositeFieldContainer[StagePlacement]
    owner_node: str
    def __init__(self, instance_id: _Optional[str] = ..., model: _Optional[str] = ..., shard: _Optional[_Union[Shard, _Mapping]] = ..., on_demand: _Optional[bool] = ..., group_id: _Optional[str] = ..., stages: _Optional[_Iterable[_Union[StagePlacement, _Mapping]]] = ..., owner_node: _Optional[str] = ...) -> None: ...

class JoinGroupRequest(_message.Message):
    __slots__ = ("instance_id", "hosts")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    hosts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, instance_id: _Optional[str] = ..., hosts: _Optional[_Iterable[str]] = ...) -> None: ...

class JoinGroupReply(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...

class Failure(_message.Message):
    __slots__ = ("exit_code", "message", "stderr_tail", "at_unix")
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STDERR_TAIL_FIELD_NUMBER: _ClassVar[int]
    AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    exit_code: int
    message: str
    stderr_tail: _containers.RepeatedScalarFieldContainer[str]
    at_unix: float
    def __init__(self, exit_code: _Optional[int] = ..., message: _Optional[str] = ..., stderr_tail: _Optional[_Iterable[str]] = ..., at_unix: _Optional[float] = ...) -> None: ...

class ModelSummary(_message.Message):
    __slots__ = ("model_id", "name", "arch", "context_length", "mtp_available", "mtp_reason", "default_k", "max_k", "owned_by")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MTP_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    MTP_REASON_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_K_FIELD_NUMBER: _ClassVar[int]
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    OWNED_BY_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    name: str
    arch: str
    context_length: int
    mtp_available: bool
    mtp_reason: str
    default_k: int
    max_k: int
    owned_by: str
    def __init__(self, model_id: _Optional[str] = ..., name: _Optional[str] = ..., arch: _Optional[str] = ..., context_length: _Optional[int] = ..., mtp_available: _Optional[bool] = ..., mtp_reason: _Optional[str] = ..., default_k: _Optional[int] = ..., max_k: _Optional[int] = ..., owned_by: _Optional[str] = ...) -> None: ...

class Instance(_message.Message):
    __slots__ = ("instance_id", "model_id", "model_ref", "node_id", "state", "progress", "stage", "shard", "failure", "restarts", "pid", "created_unix", "updated_unix", "model", "on_demand", "queue_depth", "running", "group_id", "stages", "ring_port", "owner_node", "download", "download_id", "prefix_cache", "prefix_summary", "decode_bytes_per_s")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_REF_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ON_DEMAND_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    RING_PORT_FIELD_NUMBER: _ClassVar[int]
    OWNER_NODE_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_FIELD_NUMBER: _ClassVar[int]
    DOWNLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SUMMARY_FIELD_NUMBER: _ClassVar[int]
    DECODE_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    model_id: str
    model_ref: str
    node_id: str
    state: InstanceState
    progress: float
    stage: str
    shard: Shard
    failure: Failure
    restarts: int
    pid: int
    created_unix: float
    updated_unix: float
    model: ModelSummary
    on_demand: bool
    queue_depth: int
    running: int
    group_id: str
    stages: _containers.RepeatedCompositeFieldContainer[StagePlacement]
    ring_port: int
    owner_node: str
    download: DownloadProgress
    download_id: str
    prefix_cache: PrefixCacheFigures
    prefix_summary: PrefixSummary
    decode_bytes_per_s: float
    def __init__(self, instance_id: _Optional[str] = ..., model_id: _Optional[str] = ..., model_ref: _Optional[str] = ..., node_id: _Optional[str] = ..., state: _Optional[_Union[InstanceState, str]] = ..., progress: _Optional[float] = ..., stage: _Optional[str] = ..., shard: _Optional[_Union[Shard, _Mapping]] = ..., failure: _Optional[_Union[Failure, _Mapping]] = ..., restarts: _Optional[int] = ..., pid: _Optional[int] = ..., created_unix: _Optional[float] = ..., updated_unix: _Optional[float] = ..., model: _Optional[_Union[ModelSummary, _Mapping]] = ..., on_demand: _Optional[bool] = ..., queue_depth: _Optional[int] = ..., running: _Optional[int] = ..., group_id: _Optional[str] = ..., stages: _Optional[_Iterable[_Union[StagePlacement, _Mapping]]] = ..., ring_port: _Optional[int] = ..., owner_node: _Optional[str] = ..., download: _Optional[_Union[DownloadProgress, _Mapping]] = ..., download_id: _Optional[str] = ..., prefix_cache: _Optional[_Union[PrefixCacheFigures, _Mapping]] = ..., prefix_summary: _Optional[_Union[PrefixSummary, _Mapping]] = ..., decode_bytes_per_s: _Optional[float] = ...) -> None: ...

class UnloadInstanceRequest(_message.Message):
    __slots__ = ("instance_id",)
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    def __init__(self, instance_id: _Optional[str] = ...) -> None: ...

class UnloadInstanceReply(_message.Message):
    __slots__ = ("unloaded",)
    UNLOADED_FIELD_NUMBER: _ClassVar[int]
    unloaded: bool
    def __init__(self, unloaded: _Optional[bool] = ...) -> None: ...

class GetInstanceRequest(_message.Message):
    __slots__ = ("instance_id",)
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    def __init__(self, instance_id: _Optional[str] = ...) -> None: ...

class ListInstancesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InstanceList(_message.Message):
    __slots__ = ("instances",)
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[Instance]
    def __init__(self, instances: _Optional[_Iterable[_Union[Instance, _Mapping]]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls_json", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls_json: str
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls_json: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class Messages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty", "frequency_penalty")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ...) -> None: ...

class NodeSwitch(_message.Message):
    __slots__ = ("enabled", "disabled_reason")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    DISABLED_REASON_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    disabled_reason: str
    def __init__(self, enabled: _Optional[bool] = ..., disabled_reason: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "instance_id", "messages", "text", "token_ids", "template_kwargs_json", "max_tokens", "default_max_tokens", "sampling", "stop", "native_mtp", "mtp_k", "timeout_s", "node_mtp", "tools_json", "constraint_json", "logprobs", "ignore_eos", "prompt_cache_key", "rendered")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_KWARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    NATIVE_MTP_FIELD_NUMBER: _ClassVar[int]
    MTP_K_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    NODE_MTP_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_JSON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CACHE_KEY_FIELD_NUMBER: _ClassVar[int]
    RENDERED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    instance_id: str
    messages: Messages
    text: str
    token_ids: TokenIds
    template_kwargs_json: str
    max_tokens: int
    default_max_tokens: int
    sampling: SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    native_mtp: str
    mtp_k: int
    timeout_s: float
    node_mtp: NodeSwitch
    tools_json: str
    constraint_json: str
    logprobs: int
    ignore_eos: bool
    prompt_cache_key: str
    rendered: TokenIds
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., instance_id: _Optional[str] = ..., messages: _Optional[_Union[Messages, _Mapping]] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., template_kwargs_json: _Optional[str] = ..., max_tokens: _Optional[int] = ..., default_max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., native_mtp: _Optional[str] = ..., mtp_k: _Optional[int] = ..., timeout_s: _Optional[float] = ..., node_mtp: _Optional[_Union[NodeSwitch, _Mapping]] = ..., tools_json: _Optional[str] = ..., constraint_json: _Optional[str] = ..., logprobs: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., prompt_cache_key: _Optional[str] = ..., rendered: _Optional[_Union[TokenIds, _Mapping]] = ...) -> None: ...

class Started(_message.Message):
    __slots__ = ("prompt_tokens", "max_tokens", "queue_s", "thinking")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    THINKING_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    max_tokens: int
    queue_s: float
    thinking: bool
    def __init__(self, prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., queue_s: _Optional[float] = ..., thinking: _Optional[bool] = ...) -> None: ...

class GenerateError(_message.Message):
    __slots__ = ("type", "message", "param", "retry_after_s")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PARAM_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    type: str
    message: str
    param: str
    retry_after_s: float
    def __init__(self, type: _Optional[str] = ..., message: _Optional[str] = ..., param: _Optional[str] = ..., retry_after_s: _Optional[float] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token", "bytes", "logprob")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token: int
    bytes: bytes
    logprob: float
    def __init__(self, token: _Optional[int] = ..., bytes: _Optional[bytes] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token", "bytes", "logprob", "top")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token: int
    bytes: bytes
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token: _Optional[int] = ..., bytes: _Optional[bytes] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "native_mtp_json", "error", "started", "heartbeat", "logprobs", "stop_sequence")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NATIVE_MTP_JSON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    native_mtp_json: str
    error: GenerateError
    started: Started
    heartbeat: bool
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    stop_sequence: str
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., native_mtp_json: _Optional[str] = ..., error: _Optional[_Union[GenerateError, _Mapping]] = ..., started: _Optional[_Union[Started, _Mapping]] = ..., heartbeat: _Optional[bool] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., stop_sequence: _Optional[str] = ...) -> None: ...

class RunnerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunnerStatus(_message.Message):
    __slots__ = ("instance_id", "state", "progress", "stage", "error", "model", "queue_depth", "running", "pid", "shard", "generations", "ring_port", "prefix_cache", "prefix_summary", "decode_bytes_per_s")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    RING_PORT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SUMMARY_FIELD_NUMBER: _ClassVar[int]
    DECODE_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    state: InstanceState
    progress: float
    stage: str
    error: str
    model: ModelSummary
    queue_depth: int
    running: int
    pid: int
    shard: Shard
    generations: int
    ring_port: int
    prefix_cache: PrefixCacheFigures
    prefix_summary: PrefixSummary
    decode_bytes_per_s: float
    def __init__(self, instance_id: _Optional[str] = ..., state: _Optional[_Union[InstanceState, str]] = ..., progress: _Optional[float] = ..., stage: _Optional[str] = ..., error: _Optional[str] = ..., model: _Optional[_Union[ModelSummary, _Mapping]] = ..., queue_depth: _Optional[int] = ..., running: _Optional[int] = ..., pid: _Optional[int] = ..., shard: _Optional[_Union[Shard, _Mapping]] = ..., generations: _Optional[int] = ..., ring_port: _Optional[int] = ..., prefix_cache: _Optional[_Union[PrefixCacheFigures, _Mapping]] = ..., prefix_summary: _Optional[_Union[PrefixSummary, _Mapping]] = ..., decode_bytes_per_s: _Optional[float] = ...) -> None: ...

class PrefixSummary(_message.Message):
    __slots__ = ("namespace", "block_tokens", "positions", "hashes", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    block_tokens: int
    positions: _containers.RepeatedScalarFieldContainer[int]
    hashes: _containers.RepeatedScalarFieldContainer[int]
    keys: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, namespace: _Optional[str] = ..., block_tokens: _Optional[int] = ..., positions: _Optional[_Iterable[int]] = ..., hashes: _Optional[_Iterable[int]] = ..., keys: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefixCacheFigures(_message.Message):
    __slots__ = ("lookups", "hits", "prompt_tokens", "cached_tokens", "ram_bytes", "ram_budget_bytes", "disk_bytes", "disk_budget_bytes", "ram_evictions", "disk_evictions", "failures")
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    RAM_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    RAM_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    DISK_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    lookups: int
    hits: int
    prompt_tokens: int
    cached_tokens: int
    ram_bytes: int
    ram_budget_bytes: int
    disk_bytes: int
    disk_budget_bytes: int
    ram_evictions: int
    disk_evictions: int
    failures: int
    def __init__(self, lookups: _Optional[int] = ..., hits: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., ram_bytes: _Optional[int] = ..., ram_budget_bytes: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., disk_budget_bytes: _Optional[int] = ..., ram_evictions: _Optional[int] = ..., disk_evictions: _Optional[int] = ..., failures: _Optional[int] = ...) -> None: ...
