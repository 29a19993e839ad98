// The JSON the daemon sends: /v1/events sections, /v1/instances/preview, chat stream chunks.
// Field names are the API's (snake_case); see docs/architecture.md.

export interface ClusterMeta {
  node_id: string;
  namespace: string;
  name: string;
  version: string;
}

export interface NodeView {
  id: string;
  name: string;
  self: boolean;
  host: string | null;
  api_port: number;
  grpc_port: number;
  version: string;
  namespace: string;
  memory_total_bytes: number;
  memory_available_bytes: number;
  chip: string;
  backend: string;
  disk_free_bytes: number;
  platform: string;
  cpu_count: number;
  uptime_s: number;
  secured: boolean;
  models: string[];
  instances: string[];
  last_seen_s: number;
  rtt_ms: number;
  source: string;
  /** Its instances' prefix caches together (absent or null: none has one). */
  prefix_cache?: PrefixCacheView | null;
}

/** A node's prefix caches (docs/prefix-cache.md): since their runners started. */
export interface PrefixCacheView {
  lookups: number;
  hits: number;
  prompt_tokens: number;
  cached_tokens: number;
  token_hit_rate: number;
  ram_bytes: number;
  ram_budget_bytes: number;
  disk_bytes: number;
  disk_budget_bytes: number;
  ram_evictions: number;
  disk_evictions: number;
  /** calls on the cache that raised (out of memory or disk, an unreadable entry): each only a miss */
  failures: number;
}

export interface LinkView {
  from: string;
  to: string;
  rtt_ms: number;
  source: string;
}

/** One pipeline stage of an instance (a single-node instance is one stage). */
export interface StageView {
  node: string;
  start_layer: number;
  end_layer: number;
  rank: number;
  state?: string;
  /** What the stage's runner is doing ("loading weights", "ready"), its load progress and failure. */
  stage?: string;
  progress?: number;
  failure?: { exit_code: number; message: string } | null;
  /** A placement preview's stage: what it needs and what its node has free. */
  needed_bytes?: number;
  free_bytes?: number;
}

export type InstanceState = "loading" | "downloading" | "ready" | "failed" | "stopping" | "gone";

/** The download that fetches an instance's weights (state "downloading"). */
export interface InstanceDownload {
  id: string;
  status: string;
  bytes_done: number;
  bytes_total: number;
  files_done: number;
  files_total: number;
  speed_bytes_per_s: number;
  eta_s: number | null;
  elapsed_s: number;
}

export interface InstanceFailure {
  exit_code: number;
  message: string;
  stderr_tail: string[];
  at: number;
}

export interface MTPAvailability {
  available: boolean;
  reason: string | null;
  default_k: number | null;
  max_k: number | null;
}

export interface InstanceView {
  id: string;
  model: string;
  model_ref: string;
  node: string;
  self: boolean;
  state: InstanceState;
  progress: number;
  stage: string;
  shard: { start_layer: number; end_layer: number; rank: number; world_size: number };
  /** How it is split over nodes: one node, layers (pipeline), or a slice of every layer on each member (tensor). */
  sharding?: Sharding;
  /** A tensor group's collectives (ring | nccl | jaccl). */
  backend?: string | null;
  stages?: StageView[];
  failure: InstanceFailure | null;
  restarts: number;
  pid: number;
  created: number;
  updated: number;
  on_demand: boolean;
  queue_depth: number;
  running: number;
  native_mtp: MTPAvailability | null;
  gone_reason?: string;
  download?: InstanceDownload | null;
  /** A pipeline's state explained (a stage missing, a node gone). */
  pipeline_reason?: string | null;
}

export type ModelStatus = "loaded" | "local" | "remote";

export interface ModelView {
  id: string;
  status: ModelStatus;
  owned_by: string;
  created: number;
  name: string;
  arch: string | null;
  context_length: number | null;
  native_mtp: MTPAvailability;
}

export interface SettingsView {
  native_mtp_enabled: boolean;
  sources: Record<string, string>;
  env_overrides: Record<string, string>;
  settings_file: string;
}

export interface ShardView {
  node_id: string;
  start_layer: number;
  end_layer: number;
  rank: number;
  world_size: number;
}

export type Sharding = "none" | "pipeline" | "tensor";

/** One split placement considered (the preview lists both): where it would go and its estimated speed, or why not. */
export interface PlacementOptionView {
  sharding: "pipeline" | "tensor";
  /** What the "pipeline" option places: one node ("none") or a pipeline. */
  placement_sharding: Sharding | null;
  estimated_tokens_per_s: number | null;
  /** "measured": every node's decode speed was measured by its runners; "nominal": some are a backend's guess. */
  estimate_basis: "measured" | "nominal" | null;
  nodes: string[];
  backend: string | null;
  headroom_bytes: number | null;
  error: string | null;
}

export interface PlacementView {
  model: string;
  node: string;
  sharding?: Sharding;
  backend?: string | null;
  estimated_tokens_per_s?: number | null;
  options?: PlacementOptionView[];
  needed_bytes: number;
  weights_bytes: number;
  kv_bytes: number;
  context_tokens: number;
  activation_bytes: number;
  node_free_bytes: number;
  headroom_bytes: number;
  shards: ShardView[];
  stages?: StageView[];
}

/** What the browser measured of a streamed reply (the server's own figures come only with a finished one):
 * the time from sending to the first piece of text, and how many pieces came over how long after it. A
 * piece carries one token or more (several when native MTP's drafts are accepted in one step), so the
 * counts are lower bounds of the tokens. */
export interface StreamTiming {
  ttftMs: number;
  chunks: number;
  /** From the first piece of text to the last. */
  streamMs: number;
}

/** The engine's NativeMTPStats, as the last chunk of a chat stream carries them. */
export interface MTPStats {
  enabled: boolean;
  reason: string | null;
  k: number;
  k_fixed: boolean;
  k_histogram: Record<string, number>;
  rounds: number;
  drafted_tokens: number;
  accepted_tokens: number;
  acceptance_rate: number;
  per_position_acceptance: number[];
  ttft_ms: number;
  decode_tokens_per_s: number;
  prompt_tokens: number;
  completion_tokens: number;
}

export type DownloadStatus =
  | "queued"
  | "planning"
  | "downloading"
  | "recovering_head"
  | "validating"
  | "complete"
  | "failed"
  | "cancelled";

/** One download of GET /v1/downloads (this node's). */
export interface DownloadView {
  id: string;
  model: string;
  repo: string | null;
  revision: string;
  status: DownloadStatus;
  progress: {
    bytes_done: number;
    bytes_total: number;
    files_done: number;
    files_total: number;
    speed_bytes_per_s: number;
    eta_s: number | null;
    elapsed_s: number;
    current_files: string[];
  };
  created_at: number;
  error: { code: string; message: string } | null;
}
