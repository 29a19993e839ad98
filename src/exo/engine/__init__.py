"""exo's engine: pure MLX. Load a model (with its MTP head), generate, read stats.

    from exo.engine import load, GenerationRequest
    engine = load("exo-demo")                       # a card id, a local checkpoint dir, or None
    prompt = engine.loaded.tokenizer.encode("def fibonacci(n):")
    result = engine.complete(GenerationRequest(prompt, max_tokens=64))
    print(result.text, result.stats.acceptance_rate)

Nothing here knows about sockets, HTTP or gRPC.
"""

from __future__ import annotations

from exo.settings import Settings, load_settings

from .adaptive import DepthCosts, DepthPolicy
from .generate import Engine, EngineConfig
from .loader import CheckpointError, LoadedModel, MTPHeadError, load_checkpoint
from .memory import DeviceMemoryError
from .models import UnsupportedModelError
from .request import (
    ContextLengthError,
    GenerationChunk,
    GenerationRequest,
    GenerationRequestError,
    GenerationResult,
    NativeMTPUnavailableError,
)
from .resolve import ModelNotAvailableError, ResolvedModel, resolve_model
from .sampling import SamplingParams, SamplingParamsError
from .stats import NativeMTPStats

__all__ = [
    "CheckpointError",
    "ContextLengthError",
    "DepthCosts",
    "DepthPolicy",
    "DeviceMemoryError",
    "Engine",
    "EngineConfig",
    "GenerationChunk",
    "GenerationRequest",
    "GenerationRequestError",
    "GenerationResult",
    "LoadedModel",
    "MTPHeadError",
    "ModelNotAvailableError",
    "NativeMTPStats",
    "NativeMTPUnavailableError",
    "ResolvedModel",
    "SamplingParams",
    "SamplingParamsError",
    "UnsupportedModelError",
    "engine_config",
    "load",
    "load_checkpoint",
    "resolve_model",
]


def engine_config(resolved: ResolvedModel, settings: Settings, **overrides) -> EngineConfig:
    """The engine configuration for a model: its card's depths and the node's settings."""
    source = settings.source("native_mtp_enabled")
    where = {"env": "EXO_NATIVE_MTP_ENABLED=0", "file": "the node's settings file", "cli": "the command line"}
    values = dict(
        native_mtp_enabled=settings.native_mtp_enabled,
        moe_verify=settings.native_mtp_moe_verify,
        async_draft_eval=settings.native_mtp_async_draft_eval,
        round_ahead=settings.native_mtp_round_ahead,
        default_k=resolved.default_k,
        max_k=resolved.max_k,
        disabled_reason=f"native MTP is disabled ({where.get(source, 'settings')})",
        batch_invariant=settings.batch_invariant,
        gdn_prefill=settings.gdn_prefill,
    )
    if settings.prefill_chunk is not None:
        values["prefill_chunk"] = settings.prefill_chunk
    if settings.batch_prefill_chunk is not None:
        values["batch_prefill_chunk"] = settings.batch_prefill_chunk
    if settings.batch_lanes is not None:
        values["batch_lanes"] = settings.batch_lanes
    values.update(overrides)
    return EngineConfig(**values)


def load(ref: str | None = None, settings: Settings | None = None, **overrides) -> Engine:
    """Load a model by card id, repo id or directory (None: the bundled default) into an Engine.

    ``overrides`` set EngineConfig fields (e.g. ``prefill_chunk=512``, ``native_mtp_enabled=False``).
    """
    settings = settings or load_settings()
    resolved = resolve_model(ref)
    config = engine_config(resolved, settings, **overrides)
    loaded = load_checkpoint(
        resolved.path,
        model_id=resolved.model_id,
        head_source_repo=resolved.head_source_repo,
    )
    return Engine(loaded, config)
