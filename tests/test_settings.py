import json
from pathlib import Path

import pytest

from exo.settings import (
    PERSISTED_FIELDS,
    Settings,
    SettingsError,
    load_settings,
    persist_settings,
    settings_path,
)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "exo-home"


def env_for(home: Path, **variables: str) -> dict[str, str]:
    return {"EXO_HOME": str(home), **variables}


def test_defaults(home: Path) -> None:
    s = load_settings(env=env_for(home))
    assert s.home == home and s.source("home") == "env"
    assert (s.native_mtp_enabled, s.native_mtp_moe_verify, s.native_mtp_async_draft_eval) == (
        True,
        "route_locked",
        True,
    )
    assert (s.api_host, s.api_port, s.grpc_port) == ("0.0.0.0", 52415, 52416)
    assert (s.api_key, s.cluster_secret, s.peers, s.namespace, s.discovery) == (
        None,
        None,
        (),
        "default",
        True,
    )
    assert (s.request_timeout_s, s.max_queue, s.offline) == (600.0, 64, False)
    for field in Settings.model_fields:
        if field != "home":
            assert s.source(field) == "default", field


def test_home_defaults_to_dot_exo() -> None:
    s = load_settings(env={})
    assert s.home == Path("~/.exo").expanduser() and s.source("home") == "default"


def test_precedence_default_file_env_cli(home: Path) -> None:
    persist_settings(home, {"native_mtp_enabled": False})
    from_file = load_settings(env=env_for(home))
    assert from_file.native_mtp_enabled is False and from_file.source("native_mtp_enabled") == "file"

    from_env = load_settings(env=env_for(home, EXO_NATIVE_MTP_ENABLED="1"))
    assert from_env.native_mtp_enabled is True and from_env.source("native_mtp_enabled") == "env"

    from_cli = load_settings(cli={"native_mtp_enabled": False}, env=env_for(home, EXO_NATIVE_MTP_ENABLED="1"))
    assert from_cli.native_mtp_enabled is False and from_cli.source("native_mtp_enabled") == "cli"

    # None means "flag not given": the lower layer stays.
    not_given = load_settings(
        cli={"native_mtp_enabled": None}, env=env_for(home, EXO_NATIVE_MTP_ENABLED="true")
    )
    assert not_given.native_mtp_enabled is True and not_given.source("native_mtp_enabled") == "env"


def test_every_field_from_env(home: Path) -> None:
    s = load_settings(
        env=env_for(
            home,
            EXO_NATIVE_MTP_ENABLED="false",
            EXO_NATIVE_MTP_MOE_VERIFY="batched",
            EXO_NATIVE_MTP_ASYNC_DRAFT_EVAL="0",
            EXO_NATIVE_MTP_ROUND_AHEAD="off",
            EXO_API_HOST="127.0.0.1",
            EXO_API_PORT="8000",
            EXO_GRPC_PORT="8001",
            EXO_API_KEY="sk-secret-value",
            EXO_PEERS="10.0.0.2:52416, mac-mini.local:52416,[::1]:9000",
            EXO_NAMESPACE="lab",
            EXO_DISCOVERY="FALSE",
            EXO_CLUSTER_SECRET="cluster-secret-value",
            EXO_REQUEST_TIMEOUT_S="12.5",
            EXO_MAX_QUEUE="3",
            EXO_MAX_BATCH="4",
            EXO_KV_BUDGET_TOKENS="2048",
            EXO_PREFILL_CHUNK="8",
            EXO_BATCH_PREFILL_CHUNK="16",
            EXO_BATCH_INVARIANT="1",
            EXO_BATCH_LANES="3",
            EXO_GDN_PREFILL="loop",
            EXO_OFFLINE="1",
            EXO_MEMORY_BUDGET_BYTES=str(16 << 30),
            EXO_MLX_CACHE_BYTES=str(4 << 30),
            EXO_PREFIX_CACHE_ENABLED="0",
            EXO_PREFIX_CACHE_RAM_BYTES=str(1 << 30),
            EXO_PREFIX_CACHE_DISK_BYTES="0",
            EXO_PREFIX_CACHE_BLOCK_TOKENS="128",
            EXO_PREFIX_CACHE_STRIDE_TOKENS="4096",
            EXO_TENSOR_BACKEND="nccl",
            EXO_RUNNER_SWITCH_INTERVAL_S="0.02",
            EXO_STREAM_INTERVAL_S="0.05",
        )
    )
    assert (s.native_mtp_enabled, s.native_mtp_moe_verify, s.native_mtp_async_draft_eval, s.native_mtp_round_ahead) == (
        False,
        "batched",
        False,
        "off",
    )
    assert (s.api_host, s.api_port, s.grpc_port, s.namespace, s.discovery) == (
        "127.0.0.1",
        8000,
        8001,
        "lab",
        False,
    )
    assert s.peers == ("10.0.0.2:52416", "mac-mini.local:52416", "[::1]:9000")
    assert s.api_key.get_secret_value() == "sk-secret-value"
    assert s.cluster_secret.get_secret_value() == "cluster-secret-value"
    assert (s.request_timeout_s, s.max_queue, s.offline, s.memory_budget_bytes) == (12.5, 3, True, 16 << 30)
    assert (s.max_batch, s.kv_budget_tokens, s.prefill_chunk, s.batch_invariant) == (4, 2048, 8, True)
    assert s.batch_lanes == 3 and s.batch_prefill_chunk == 16
    assert (s.prefix_cache_enabled, s.prefix_cache_ram_bytes, s.prefix_cache_disk_bytes) == (False, 1 << 30, 0)
    assert (s.prefix_cache_block_tokens, s.prefix_cache_stride_tokens) == (128, 4096)
    assert s.tensor_backend == "nccl" and s.mlx_cache_bytes == 4 << 30
    assert s.runner_switch_interval_s == 0.02 and s.stream_interval_s == 0.05
    assert all(s.source(f) == "env" for f in Settings.model_fields)


def test_cli_values_typed_or_text(home: Path) -> None:
    s = load_settings(
        cli={"api_port": 9000, "peers": "a:1,b:2", "discovery": "0", "home": str(home / "other")},
        env=env_for(home, EXO_API_PORT="8000"),
    )
    assert (s.api_port, s.peers, s.discovery) == (9000, ("a:1", "b:2"), False)
    assert s.home == home / "other" and s.source("home") == "cli" and s.source("api_port") == "cli"


def test_secrets_never_in_repr(home: Path) -> None:
    s = load_settings(
        env=env_for(home, EXO_API_KEY="sk-secret-value", EXO_CLUSTER_SECRET="cluster-secret-value")
    )
    for text in (repr(s), str(s), json.dumps(s.public_dict())):
        assert "sk-secret-value" not in text and "cluster-secret-value" not in text
    assert s.public_dict()["api_key"] == "**********"


@pytest.mark.parametrize(
    ("variable", "value", "accepted"),
    [
        ("EXO_NATIVE_MTP_ENABLED", "yes", "0, 1, true, false"),
        ("EXO_NATIVE_MTP_ASYNC_DRAFT_EVAL", "2", "0, 1, true, false"),
        ("EXO_DISCOVERY", "on", "0, 1, true, false"),
        ("EXO_NATIVE_MTP_MOE_VERIFY", "fast", "route_locked, batched, safe"),
        ("EXO_API_PORT", "70000", "<= 65535"),
        ("EXO_GRPC_PORT", "port", "an integer"),
        ("EXO_MAX_QUEUE", "0", ">= 1"),
        ("EXO_REQUEST_TIMEOUT_S", "-5", "> 0"),
        ("EXO_PEERS", "10.0.0.2", "host:port"),
    ],
)
def test_bad_env_values(home: Path, variable: str, value: str, accepted: str) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(env=env_for(home, **{variable: value}))
    assert variable in str(info.value) and accepted in str(info.value)


def test_unknown_cli_key(home: Path) -> None:
    with pytest.raises(SettingsError, match="api_prot"):
        load_settings(cli={"api_prot": 1}, env=env_for(home))


def test_persist_round_trip_keeps_unknown_keys(home: Path) -> None:
    home.mkdir()
    settings_path(home).write_text(json.dumps({"future_setting": {"x": 1}, "native_mtp_enabled": True}))
    persist_settings(home, {"native_mtp_enabled": False})
    data = json.loads(settings_path(home).read_text())
    assert data == {"future_setting": {"x": 1}, "native_mtp_enabled": False}
    assert load_settings(env=env_for(home)).native_mtp_enabled is False
    persist_settings(home, {"native_mtp_enabled": True})
    assert load_settings(env=env_for(home)).native_mtp_enabled is True
    assert [p.name for p in home.iterdir()] == ["settings.json"]  # no temp files left behind


def test_file_holds_only_persisted_fields(home: Path) -> None:
    home.mkdir()
    settings_path(home).write_text(json.dumps({"api_port": 1234}))
    s = load_settings(env=env_for(home))
    assert s.api_port == 52415 and s.source("api_port") == "default"
    with pytest.raises(SettingsError, match="cannot be persisted"):
        persist_settings(home, {"api_port": 1234})
    assert "native_mtp_enabled" in PERSISTED_FIELDS


def test_bad_settings_file(home: Path) -> None:
    home.mkdir()
    settings_path(home).write_text(json.dumps({"native_mtp_enabled": "sometimes"}))
    with pytest.raises(SettingsError, match="native_mtp_enabled"):
        load_settings(env=env_for(home))
    settings_path(home).write_text("{not json")
    with pytest.raises(SettingsError, match="cannot read settings file"):
        load_settings(env=env_for(home))
    with pytest.raises(SettingsError, match="native_mtp_enabled"):
        persist_settings(home, {"native_mtp_enabled": "sometimes"})


def test_source_of_unknown_field(home: Path) -> None:
    with pytest.raises(KeyError):
        load_settings(env=env_for(home)).source("nope")


def test_settings_are_frozen(home: Path) -> None:
    s = load_settings(env=env_for(home))
    with pytest.raises(ValueError):
        s.api_port = 1


def test_prefill_chunk_reaches_the_engine(home: Path) -> None:
    """EXO_PREFILL_CHUNK sets the engine's prefill chunk (what a runner builds from its node's settings)."""
    from exo.cards import bundled_model_dir
    from exo.engine import engine_config, resolve_model

    resolved = resolve_model(str(bundled_model_dir("exo-demo")))
    assert engine_config(resolved, load_settings(env=env_for(home, EXO_PREFILL_CHUNK="8"))).prefill_chunk == 8
    default = engine_config(resolved, load_settings(env=env_for(home)))
    assert default.prefill_chunk is None  # the device's: the engine chooses (512 on the CPU)
    from exo.engine import Engine, load_checkpoint
    from exo.engine.generate import CPU_PREFILL_CHUNK

    assert Engine(load_checkpoint(resolved.path), default).config.prefill_chunk == CPU_PREFILL_CHUNK == 512


def test_round_ahead_reaches_the_engine(home: Path) -> None:
    """EXO_NATIVE_MTP_ROUND_AHEAD (engine/ahead.py): off by default (slower where measured), on / off; anything
    else is a clear error naming what it accepts."""
    from exo.cards import bundled_model_dir
    from exo.engine import engine_config, resolve_model
    from exo.settings import SettingsError

    resolved = resolve_model(str(bundled_model_dir("exo-demo")))
    for value in ("on", "off"):
        env = env_for(home, EXO_NATIVE_MTP_ROUND_AHEAD=value)
        assert engine_config(resolved, load_settings(env=env)).round_ahead == value
    assert engine_config(resolved, load_settings(env=env_for(home))).round_ahead == "off"
    with pytest.raises(SettingsError, match="on, off"):
        load_settings(env=env_for(home, EXO_NATIVE_MTP_ROUND_AHEAD="1"))


def test_batch_invariant_reaches_the_engine(home: Path) -> None:
    """EXO_BATCH_INVARIANT=1 turns on the engine's batch-invariant batched steps (off by default)."""
    from exo.cards import bundled_model_dir
    from exo.engine import engine_config, resolve_model

    resolved = resolve_model(str(bundled_model_dir("exo-demo")))
    assert engine_config(resolved, load_settings(env=env_for(home, EXO_BATCH_INVARIANT="1"))).batch_invariant is True
    assert engine_config(resolved, load_settings(env=env_for(home))).batch_invariant is False


def test_gdn_prefill_reaches_the_engine_and_the_layers(home: Path) -> None:
    """EXO_GDN_PREFILL chooses how GatedDeltaNet layers prefill (auto by default; a bad value is refused), and
    an engine hands its choice to its model's layers."""
    from exo.cards import bundled_model_dir
    from exo.engine import Engine, engine_config, load_checkpoint, resolve_model

    resolved = resolve_model(str(bundled_model_dir("exo-demo")))
    assert engine_config(resolved, load_settings(env=env_for(home))).gdn_prefill == "auto"
    config = engine_config(resolved, load_settings(env=env_for(home, EXO_GDN_PREFILL="chunked")))
    assert config.gdn_prefill == "chunked"
    with pytest.raises(SettingsError, match="auto, chunked, loop"):
        load_settings(env=env_for(home, EXO_GDN_PREFILL="fast"))
    model = Engine(load_checkpoint(resolved.path), config).model
    modes = {layer.linear_attn.gdn_prefill for layer in model.stage_layers if layer.is_linear}
    assert modes == {"chunked"}


def test_batch_lanes_reach_the_engine(home: Path) -> None:
    """EXO_BATCH_LANES sets how many lanes a batch decodes in (None: the engine's default per device)."""
    from exo.cards import bundled_model_dir
    from exo.engine import engine_config, resolve_model

    resolved = resolve_model(str(bundled_model_dir("exo-demo")))
    assert engine_config(resolved, load_settings(env=env_for(home, EXO_BATCH_LANES="1"))).batch_lanes == 1
    assert engine_config(resolved, load_settings(env=env_for(home))).batch_lanes is None
    with pytest.raises(SettingsError):
        load_settings(env=env_for(home, EXO_BATCH_LANES="0"))


def test_batch_prefill_chunk_reaches_the_engine(home: Path, monkeypatch) -> None:
    """EXO_BATCH_PREFILL_CHUNK sets the prefill chunk of a generation joining a running batch (unset: the
    device's: 256, 2048 on MLX CUDA)."""
    from exo.cards import bundled_model_dir
    from exo.engine import Engine, EngineConfig, engine_config, load_checkpoint, resolve_model
    from exo.engine import generate as engine_generate

    resolved = resolve_model(str(bundled_model_dir("exo-demo")))
    assert engine_config(resolved, load_settings(env=env_for(home, EXO_BATCH_PREFILL_CHUNK="64"))).batch_prefill_chunk == 64
    assert engine_config(resolved, load_settings(env=env_for(home))).batch_prefill_chunk is None  # the device's
    assert engine_generate.default_batch_prefill_chunk() == 256  # this CPU
    engine = Engine(load_checkpoint(bundled_model_dir("exo-demo")), EngineConfig())
    assert engine.config.batch_prefill_chunk == 256
    monkeypatch.setattr(engine_generate, "on_cuda", lambda: True)  # as on MLX CUDA
    assert Engine(engine.loaded, EngineConfig()).config.batch_prefill_chunk == 2048
    assert Engine(engine.loaded, EngineConfig(batch_prefill_chunk=64)).config.batch_prefill_chunk == 64
    with pytest.raises(SettingsError):
        load_settings(env=env_for(home, EXO_BATCH_PREFILL_CHUNK="0"))
