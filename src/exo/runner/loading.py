"""A model made ready to serve, the one way both model services do it.

Two services stand behind the HTTP API. ``exo.api.local.LocalModelService`` runs models in the API's own
process (notebooks, benchmarks, the API's tests); ``exo.cluster.orchestration.ClusterModelService`` (``exo
serve``) runs each model in a runner process (``exo.runner.main``) that placement puts on some node of the
cluster. They share what runs a model: this module (the checkpoint and its engine configuration from a
resolved model and the node's settings; the engine warmed up), the device queue (``exo.runner.device.Device``:
FIFO, batching, cancellation, the KV budget), the model listing (``exo.cluster.listing``) and the service
interface and its errors (``exo.cluster.service``).

What stays apart is where a model runs, and that is what each of them is: the local service holds engines
in its process, on one device thread, and evicts the least recently used engine; the cluster service places
runner processes over nodes, supervises and restarts them, relays their tokens over gRPC, splits a model into
pipeline stages, and stops the least recently used on-demand runner. One could not be the other: the local
service as a cluster of one would start a daemon and a runner process for every test (seconds each, and no
in-process hooks for the tests that inject failures at a decode step), and the cluster without runner
processes would lose what they give it (a crash or an out-of-memory kill takes one model down, not the node;
a stage's process joins its pipeline's ring).
"""

from __future__ import annotations

import logging
from typing import Any

from exo.engine import Engine, EngineConfig, ResolvedModel, engine_config, load_checkpoint
from exo.engine.loader import LoadedModel
from exo.engine.memory import keep_cache_room
from exo.engine.sharding import TensorShare
from exo.settings import Settings


def load_for_serving(
    resolved: ResolvedModel, settings: Settings, *, layers: tuple[int, int] | None = None,
    tensor: TensorShare | None = None, **config: Any
) -> tuple[LoadedModel, EngineConfig]:
    """The checkpoint (its ``layers`` only, for a pipeline stage; a tensor group member's slice of every layer) and
    the engine configuration the node's settings and the model's card give it (``config``: fields to override,
    e.g. the node's MTP switch)."""
    engine_settings = engine_config(resolved, settings, **config)
    loaded = load_checkpoint(
        resolved.path, model_id=resolved.model_id, head_source_repo=resolved.head_source_repo, layers=layers,
        tensor=tensor,
    )
    return loaded, engine_settings


def ready_engine(loaded: LoadedModel, config: EngineConfig, settings: Settings | None = None) -> Engine:
    """An engine for a whole model, its costs measured for adaptive depth once, here, not in a request; with
    ``settings``, its prefix cache as they say (``exo.runner.prefix_store``; set after the warm-up, which
    is no request of a user's)."""
    engine = Engine(loaded, config)
    engine.warmup()
    if settings is not None:
        from exo.engine.kernel_warmup import warm_batches

        set_state_room(engine, settings)
        # a batch's kernels, before a user's batch waits on them (as large a batch as the server would admit)
        seconds = warm_batches(engine, settings.max_batch, _kv_budget(settings))
        if seconds is not None:
            engine.warmup_seconds["batch steps"] = seconds
        attach_prefix_cache(engine, settings)
    keep_cache_room()  # the warm-ups' buffers, dead now (engine/memory.py)
    return engine


def attach_prefix_cache(engine: Engine, settings: Settings, layers: tuple[int, int] | None = None) -> None:
    """The node's prefix cache for a warmed-up engine (a whole model, or a pipeline's leader: ``layers``, its
    stage's), its RAM tier shrunk to fit (``reserve_bytes``). A failure leaves the model serving without one."""
    from .prefix_store import open_prefix_cache, ram_budget

    try:
        engine.prefix_cache = open_prefix_cache(engine.loaded, settings, layers,
                                                ram_bytes=ram_budget(settings, reserve_bytes(engine, settings)))
    except Exception:  # noqa: BLE001 - the model serves without one
        logging.getLogger(__name__).exception("prefix cache: not available")
    _log_budget(engine.prefix_cache, settings)


def _kv_budget(settings: Settings) -> int:
    from exo.cards.schema import CONTEXT_BUDGET_TOKENS

    return settings.kv_budget_tokens or CONTEXT_BUDGET_TOKENS


def _reserve(per_token: int, per_sequence: int, settings: Settings, room: int = 0) -> int:
    """What an instance (or a stage) will still take: its KV budget, its recurrent states (one sequence's, or
    ``room`` for a full batch's where set aside) and the activation margin placement counts."""
    from exo.cards.schema import ACTIVATION_MARGIN_BYTES

    return per_token * _kv_budget(settings) + max(per_sequence, room) + ACTIVATION_MARGIN_BYTES


def stage_memory(loaded: LoadedModel, settings: Settings, batch_room: bool) -> tuple[int | None, int]:
    """A group member that does not lead (a pipeline's stage, a tensor member): (what it will still take, the room
    in that for a full batch's recurrent states, 0: none), its rates measured on a one-token forward of its layers
    (``forward.cache_rates``). ``batch_room``: set room aside where the node's available memory (read as a served
    engine reads it, ``set_state_room``) holds it; the stage then reports its states as needing none of the KV
    budget (``serve_stage``'s ``states_room``). (None, 0) where the measurement failed."""
    from exo.engine.batch_memory import state_room
    from exo.engine.forward import cache_rates
    from exo.system import memory

    try:
        per_token, per_sequence = cache_rates(loaded.model)
        room = 0
        if batch_room:
            free = memory(settings.memory_budget_bytes).available_bytes - _reserve(per_token, per_sequence, settings)
            room = state_room(per_sequence, settings.max_batch, free)
    except Exception:  # noqa: BLE001 - no room for states, no prefix cache: the stage serves as before
        logging.getLogger(__name__).exception("a stage's memory: not measured")
        return None, 0
    return _reserve(per_token, per_sequence, settings, room), room


def stage_prefix_cache(loaded: LoadedModel, settings: Settings, layers: tuple[int, int] | None,
                       reserve: int | None) -> Any:
    """A pipeline stage's (not the leader's) prefix cache: its layers' part under its own namespace, its RAM tier
    shrunk to fit what the stage will still take (``reserve``: ``stage_memory``'s). None: turned off, or it failed
    (the stage then never restores and the leader finds no prefix every stage holds)."""
    from .prefix_store import open_prefix_cache, ram_budget

    if reserve is None:
        return None
    try:
        prefix_cache = open_prefix_cache(loaded, settings, layers, ram_bytes=ram_budget(settings, reserve))
    except Exception:  # noqa: BLE001 - the stage serves without one
        logging.getLogger(__name__).exception("prefix cache: not available")
        return None
    _log_budget(prefix_cache, settings)
    return prefix_cache


def _log_budget(cache: Any, settings: Settings) -> None:
    if cache is not None:
        figures = cache.figures()
        logging.getLogger(__name__).info(
            "prefix cache: RAM budget %d MiB (setting %d MiB), disk budget %d MiB", figures["ram_budget_bytes"] >> 20,
            settings.prefix_cache_ram_bytes >> 20, figures.get("disk_budget_bytes", 0) >> 20)


def set_state_room(engine: Engine, settings: Settings) -> None:
    """A served engine's ``state_room``: a full batch's recurrent states where the node's available memory (the
    GPU's on MLX CUDA, as placement reads it) holds them beyond what the instance will still take
    (``reserve_bytes``, before any room is set aside); a pipeline's leader, for its own stage's layers."""
    from exo.engine.batch import sequence_bytes
    from exo.engine.batch_memory import state_room
    from exo.system import memory

    engine.state_room = 0
    free = memory(settings.memory_budget_bytes).available_bytes - reserve_bytes(engine, settings)
    engine.state_room = state_room(sequence_bytes(engine)[1], settings.max_batch, free)


def reserve_bytes(engine: Engine, settings: Settings) -> int:
    """What a loaded, warmed-up instance will still take beyond what the node's memory shows: its KV budget
    (``kv_budget_tokens``, as the device admits batches), its states (a full batch's where ``state_room`` set
    them aside) and the activation margin placement counts. The prefix cache's RAM tier gets at most what is
    free after that, so it never takes what placement promised the instance (docs/prefix-cache.md)."""
    from exo.engine.batch import sequence_bytes

    per_token, per_sequence = sequence_bytes(engine)
    return _reserve(per_token, per_sequence, settings, engine.state_room)
