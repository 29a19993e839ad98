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
        from exo.cards.schema import CONTEXT_BUDGET_TOKENS
        from exo.engine.kernel_warmup import warm_batches

        set_state_room(engine, settings)
        # a batch's kernels, before a user's batch waits on them (as large a batch as the server would admit)
        seconds = warm_batches(engine, settings.max_batch, settings.kv_budget_tokens or CONTEXT_BUDGET_TOKENS)
        if seconds is not None:
            engine.warmup_seconds["batch steps"] = seconds
        attach_prefix_cache(engine, settings)
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


def _stage_rates(loaded: LoadedModel, first: bool) -> tuple[int, int]:
    """A stage's (bytes of attention KV per token, bytes of recurrent state per sequence), measured on a one-token
    forward of its layers."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    model = loaded.model
    cache = model.make_cache()
    x = mx.array([[0]], dtype=mx.uint32) if first else mx.zeros((1, 1, model.hidden_size),
                                                               dtype=model.stage_layers[0].input_layernorm.weight.dtype)
    mx.eval(model.stage_hidden(x, cache))
    per_token = sum((c.keys.nbytes + c.values.nbytes) // c.keys.shape[2] for c in cache if isinstance(c, KVCache))
    per_sequence = sum(a.nbytes for c in cache if not isinstance(c, KVCache) for a in c.cache if a is not None)
    return per_token, per_sequence


def _stage_reserve(per_token: int, per_sequence: int, settings: Settings, room: int = 0) -> int:
    from exo.cards.schema import ACTIVATION_MARGIN_BYTES, CONTEXT_BUDGET_TOKENS

    budget = settings.kv_budget_tokens or CONTEXT_BUDGET_TOKENS
    return per_token * budget + max(per_sequence, room) + ACTIVATION_MARGIN_BYTES


def stage_states_room(loaded: LoadedModel, settings: Settings, first: bool) -> bool:
    """Whether a pipeline stage's (not the leader's) node has room for a full batch's recurrent states beyond what
    the stage will still take (``batch_memory.state_room``, read as a served engine reads it): then the stage
    reports its states as needing none of the KV budget (``serve_stage``'s ``states_room``), and its prefix cache's
    RAM tier leaves that room (``stage_prefix_cache``'s ``room``)."""
    from exo.engine.batch_memory import state_room
    from exo.system import memory

    try:
        per_token, per_sequence = _stage_rates(loaded, first)
        free = memory(settings.memory_budget_bytes).available_bytes - _stage_reserve(per_token, per_sequence, settings)
        return state_room(per_sequence, settings.max_batch, free) > 0
    except Exception:  # noqa: BLE001 - the stage counts its states against the KV budget, as before
        logging.getLogger(__name__).exception("room for a batch's states: not measured")
        return False


def stage_prefix_cache(loaded: LoadedModel, settings: Settings, layers: tuple[int, int] | None, first: bool,
                       states_room: bool = False) -> Any:
    """A pipeline stage's (not the leader's) prefix cache: its layers' part under its own namespace, its RAM tier
    shrunk to fit what the stage will still take (its KV budget and state, measured on a one-token forward of
    its layers, a full batch's states where ``states_room``, and the activation margin). None: turned off, or it
    failed (the stage then never restores and the leader finds no prefix every stage holds)."""
    from .prefix_store import open_prefix_cache, ram_budget

    try:
        per_token, per_sequence = _stage_rates(loaded, first)
        room = settings.max_batch * per_sequence if states_room else 0
        reserve = _stage_reserve(per_token, per_sequence, settings, room)
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
    (``kv_budget_tokens``, as the device admits batches) and the activation margin placement counts. The
    prefix cache's RAM tier gets at most what is free after that, so it never takes what placement
    promised the instance (docs/prefix-cache.md)."""
    from exo.cards.schema import ACTIVATION_MARGIN_BYTES, CONTEXT_BUDGET_TOKENS
    from exo.engine.batch import sequence_bytes

    per_token, per_sequence = sequence_bytes(engine)
    states = max(per_sequence, engine.state_room)  # a full batch's, where set aside (``state_room``)
    return per_token * (settings.kv_budget_tokens or CONTEXT_BUDGET_TOKENS) + states + ACTIVATION_MARGIN_BYTES
