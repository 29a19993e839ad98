"""One typed settings object. Precedence: defaults < settings file < EXO_* env < CLI flags.

`load_settings()` records which of those sources set each field (`settings.source("api_port")`), so the
CLI and the dashboard can show where a value came from. Only `PERSISTED_FIELDS` are read from (and
written to) `$EXO_HOME/settings.json`; other keys in that file are kept untouched.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, ValidationError, field_validator

# "app": an EXO_* variable that the app which started exo (the menu-bar app) set from its own saved choice,
# marked by EXO_<FIELD>_FROM_APP=1: a start-up default that PUT /v1/settings may change, no override.
Source = Literal["default", "file", "env", "app", "cli"]
MoEVerify = Literal["route_locked", "batched", "safe"]
GdnPrefill = Literal["auto", "chunked", "loop"]

ENV_PREFIX = "EXO_"
SETTINGS_FILE_NAME = "settings.json"
DEFAULT_HOME = "~/.exo"
# Fields the settings file may hold (the dashboard's toggles); add a field name here to persist it.
PERSISTED_FIELDS: tuple[str, ...] = ("native_mtp_enabled",)

_TRUE, _FALSE = ("1", "true"), ("0", "false")
_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))  # annotated_types constraint attributes


class SettingsError(ValueError):
    """A setting that cannot be used; the message names where it came from and what is accepted."""


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    home: Path = Path(DEFAULT_HOME)
    native_mtp_enabled: bool = Field(default=True, strict=True)
    native_mtp_moe_verify: MoEVerify = "route_locked"
    native_mtp_async_draft_eval: bool = Field(default=True, strict=True)
    # a greedy request's next speculative round built while a round computes (EngineConfig.round_ahead): off
    # until measured paying (slower on a 2-core CPU and on an H200 at 9B, both host-bound); "chain": built on the
    # round's device verdict and launched before the host reads it (engine.ahead.ChainedRound)
    native_mtp_round_ahead: Literal["on", "off", "chain"] = "off"
    api_host: str = Field(default="0.0.0.0", min_length=1)
    api_port: int = Field(default=52415, ge=1, le=65535)
    grpc_port: int = Field(default=52416, ge=1, le=65535)
    api_key: SecretStr | None = None
    peers: tuple[str, ...] = ()
    namespace: str = Field(default="default", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    discovery: bool = Field(default=True, strict=True)
    cluster_secret: SecretStr | None = None
    request_timeout_s: float = Field(default=600.0, gt=0)
    max_queue: int = Field(default=64, ge=1)
    # Generations of one model that decode together in a batch at most (1: strictly one at a time).
    max_batch: int = Field(default=32, ge=1)
    # Tokens of attention KV (prompt + max_tokens per generation; recurrent state counted as its bytes) the
    # generations batching on one instance may hold together. None: CONTEXT_BUDGET_TOKENS, what placement
    # reserves. A generation that does not fit waits in the queue; a lone generation always runs.
    kv_budget_tokens: int | None = Field(default=None, ge=1)
    # Prompt tokens one prefill step feeds the model at most (EngineConfig.prefill_chunk). None: the engine's
    # default for the device (512 on the CPU, 2048 on a GPU: EngineConfig.prefill_chunk). Small values exercise the chunk edges (tests) or bound one step's activations.
    prefill_chunk: int | None = Field(default=None, ge=1)
    # Prompt tokens per prefill chunk of a generation joining a running batch, which decodes a step between
    # its chunks (EngineConfig.batch_prefill_chunk). None: the engine's default (2048 on MLX CUDA, 256 elsewhere).
    batch_prefill_chunk: int | None = Field(default=None, ge=1)
    # EXO_BATCH_INVARIANT=1: a batched request's greedy output never depends on what else runs in its batch
    # (EngineConfig.batch_invariant). It makes batched steps dearer on GPUs (docs/performance.md,
    # "The code's reasons": ``EXO_BATCH_INVARIANT``), so off by default;
    # on MLX's CPU backend batched steps already equal solo ones.
    batch_invariant: bool = Field(default=False, strict=True)
    # How GatedDeltaNet layers run a prompt's rows (EngineConfig.gdn_prefill): "auto" = exo's prompt kernel on
    # MLX CUDA where its load check passes (else the chunked (WY) form), mlx-lm's Metal kernel on Apple GPUs,
    # exo's kernel on the CPU; "chunked" = the chunked form on every device (unmeasured on Metal); "loop" = the
    # token loop everywhere (as before).
    gdn_prefill: GdnPrefill = "auto"
    # Lanes a batch decodes in (EngineConfig.batch_lanes): on MLX's CPU backend each lane's steps run on a
    # stream thread of its own. None: 1 (two measured slower on a 2-core CPU: exo.engine.batch.default_lanes).
    batch_lanes: int | None = Field(default=None, ge=1)
    # The most memory (bytes) this node offers to models, whatever the OS has free: keep room for other
    # applications, or make a small node of a big machine. None: what the OS says is available.
    memory_budget_bytes: int | None = Field(default=None, ge=1)
    # Bytes of freed buffers MLX may keep for reuse in each runner (engine/memory.py ``limit_buffer_cache``). None: an
    # eighth of the device's memory on MLX CUDA, MLX's default elsewhere (up to its memory limit).
    mlx_cache_bytes: int | None = Field(default=None, ge=0)
    # The prefix cache (engine/prefix_cache.py, runner/prefix_store.py): a prompt that starts like an earlier
    # one restores that prefix's caches instead of prefilling it. RAM: bytes each instance may hold (counted in
    # its placement); disk: bytes under $EXO_HOME/prefix-cache (0: no disk tier), kept across restarts.
    prefix_cache_enabled: bool = Field(default=True, strict=True)
    prefix_cache_ram_bytes: int = Field(default=2 << 30, ge=0)
    prefix_cache_disk_bytes: int = Field(default=16 << 30, ge=0)
    # Tokens per cached block of attention KV, and the stride of the recurrent-state snapshots along long
    # prompts (0: only the prompt's end and message starts); docs/prefix-cache.md says what each costs.
    prefix_cache_block_tokens: int = Field(default=256, ge=1)
    prefix_cache_stride_tokens: int = Field(default=8192, ge=0)
    # How long a runner's other threads (gRPC's, each stream's) may wait for Python's GIL before the thread building
    # the model's graphs is made to hand it over (``sys.setswitchinterval``; Python's default 0.005 s). That thread
    # releases the GIL at every evaluation anyway (each step), so a longer interval only spares its graph building
    # the handoffs: one client through exo serve decoded at 0.88x the engine alone at 0.005 s, 1.08x at 0.05 s
    # (one H200, 9B shape: bench/gpu_session.sh servinggil).
    runner_switch_interval_s: float = Field(default=0.05, gt=0, le=1.0)
    # A streamed generation's tokens leave its runner (or the in-process service's device thread) at most this
    # often (the first and the last at once), each message with every token since the last: every wake-up of a
    # stream's thread costs the thread building the model's graphs (runner/outbox.py says how much). 0: a message
    # per token.
    stream_interval_s: float = Field(default=0.02, ge=0, le=1.0)
    # EXO_OFFLINE=1: downloads use only the Hugging Face cache, never the network (as HF_HUB_OFFLINE=1).
    offline: bool = Field(default=False, strict=True)
    # The collectives of the tensor groups this node places (MLX's distributed backend, the same for every
    # member): auto = NCCL where every member runs MLX on CUDA, else the TCP ring; jaccl (Thunderbolt 5 RDMA
    # between Macs) only when chosen here (docs/cluster.md).
    tensor_backend: Literal["auto", "ring", "nccl", "jaccl"] = "auto"

    _sources: dict[str, Source] = PrivateAttr(default_factory=dict)

    @field_validator("home")
    @classmethod
    def _expand_home(cls, value: Path) -> Path:
        return value.expanduser()

    @field_validator("peers")
    @classmethod
    def _peers_are_host_port(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for peer in value:
            host, sep, port = peer.rpartition(":")
            if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
                raise ValueError(f"peer {peer!r} must be host:port with a port in 1-65535")
        return value

    def source(self, field: str) -> Source:
        """Which source set `field`: "default", "file", "env", "app" or "cli"."""
        if field not in type(self).model_fields:
            raise KeyError(f"unknown setting {field!r}")
        return self._sources.get(field, "default")

    @property
    def settings_file(self) -> Path:
        return settings_path(self.home)

    def public_dict(self) -> dict[str, Any]:
        """JSON-ready values for display; secrets show only whether they are set."""
        out = self.model_dump(mode="json")
        for name in ("api_key", "cluster_secret"):
            out[name] = None if getattr(self, name) is None else "**********"
        return out


def env_var(field: str) -> str:
    return ENV_PREFIX + field.upper()


def app_default_var(field: str) -> str:
    """``EXO_<FIELD>_FROM_APP``: set to 1 next to ``EXO_<FIELD>``, the value is the starting app's default."""
    return env_var(field) + "_FROM_APP"


def settings_path(home: Path | str) -> Path:
    return Path(home).expanduser() / SETTINGS_FILE_NAME


def resolve_home(cli: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> Path:
    """EXO_HOME alone (the settings file lives inside it, so the file cannot set it)."""
    env = os.environ if env is None else env
    if cli and cli.get("home") is not None:
        return Path(cli["home"]).expanduser()
    return Path(env.get(env_var("home")) or DEFAULT_HOME).expanduser()


def load_settings(cli: dict[str, Any] | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Merge defaults, `$EXO_HOME/settings.json`, EXO_* variables (os.environ by default) and CLI values.

    `cli` maps field names to values; None means "flag not given". Strings are accepted for any field
    (parsed like the environment), so argparse values can be passed through as they are.
    """
    env = os.environ if env is None else env
    cli = {k: v for k, v in (cli or {}).items() if v is not None}
    unknown = sorted(set(cli) - set(Settings.model_fields))
    if unknown:
        raise SettingsError(f"unknown setting(s) {unknown}; known: {', '.join(Settings.model_fields)}")

    values: dict[str, Any] = {}
    sources: dict[str, Source] = {}
    where: dict[str, str] = {}  # field -> human name of the place its value came from, for errors

    home = resolve_home(cli, env)
    path = settings_path(home)
    for name, value in _read_settings_file(path).items():
        if name in PERSISTED_FIELDS:
            values[name], sources[name], where[name] = value, "file", f"{path} key {name!r}"

    for name in Settings.model_fields:
        raw = env.get(env_var(name))
        if raw:  # an empty variable counts as unset
            values[name] = _parse_text(name, raw, env_var(name))
            from_app = name in PERSISTED_FIELDS and env.get(app_default_var(name)) == "1"
            sources[name], where[name] = "app" if from_app else "env", env_var(name)

    for name, value in cli.items():
        flag = "--" + name.replace("_", "-")
        values[name] = _parse_text(name, value, flag) if isinstance(value, str) else value
        sources[name], where[name] = "cli", flag

    try:
        settings = Settings(**values)
    except ValidationError as exc:
        err = exc.errors()[0]
        name = str(err["loc"][0]) if err["loc"] else ""
        raise SettingsError(
            f"{where.get(name, name)}: {err['msg']} (got {err.get('input')!r}); accepted: {_accepted(name)}"
        ) from None
    settings._sources = sources
    return settings


def persist_settings(home: Path | str, updates: dict[str, Any]) -> None:
    """Write `updates` into `$home/settings.json` atomically, keeping every other key in the file."""
    for name, value in updates.items():
        if name not in PERSISTED_FIELDS:
            raise SettingsError(
                f"setting {name!r} cannot be persisted; persisted settings: {PERSISTED_FIELDS}"
            )
        _validate_field(name, value, f"value for {name!r}")
    path = settings_path(home)
    data = _read_settings_file(path)
    data.update(updates)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write a sibling temp file and rename it over the old one: readers never see a half-written file.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".settings.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read_settings_file(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SettingsError(f"{path}: cannot read settings file ({exc}); fix or delete it") from None
    if not isinstance(data, dict):
        raise SettingsError(f"{path}: settings file must hold a JSON object")
    for name in PERSISTED_FIELDS:
        if name in data:
            _validate_field(name, data[name], f"{path} key {name!r}")
    return data


def _validate_field(name: str, value: Any, where: str) -> None:
    try:
        Settings.model_validate({name: value})
    except ValidationError as exc:
        raise SettingsError(
            f"{where}: {exc.errors()[0]['msg']} (got {value!r}); accepted: {_accepted(name)}"
        ) from None


def _parse_text(name: str, raw: str, where: str) -> Any:
    """Text (environment, or a CLI string) -> the field's value; bools and choices are checked here."""
    annotation = Settings.model_fields[name].annotation
    text = raw.strip()
    if annotation is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise SettingsError(f"{where}={raw!r} is not a boolean; accepted: {_accepted(name)}")
    if get_origin(annotation) is Literal:
        if text not in get_args(annotation):
            raise SettingsError(f"{where}={raw!r} is not valid; accepted: {_accepted(name)}")
        return text
    if name == "peers":
        return tuple(p.strip() for p in text.split(",") if p.strip())
    return text  # numbers, paths and strings: pydantic converts and range-checks them


def _accepted(name: str) -> str:
    if name not in Settings.model_fields:
        return "see `exo --help`"
    info = Settings.model_fields[name]
    annotation = info.annotation
    if annotation is bool:
        return "0, 1, true, false"
    if get_origin(annotation) is Literal:
        return ", ".join(get_args(annotation))
    if name == "peers":
        return "a comma-separated list of host:port"
    bounds = [f"{op} {getattr(m, attr)}" for m in info.metadata for attr, op in _BOUNDS if hasattr(m, attr)]
    kind = "an integer" if annotation is int else "a number" if annotation is float else "text"
    return f"{kind} ({', '.join(bounds)})" if bounds else kind
