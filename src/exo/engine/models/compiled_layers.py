"""A decoder layer's decode step and verify rows as compiled calls (``EXO_COMPILED_LAYERS``, on MLX CUDA by default).

On MLX CUDA a 9B decode step is the host's work more than the device's: building its graph, op by op in Python,
took 5.6 ms of a ~9.5 ms step on an H200 (``bench/build_profile.py``), and a speculative round's build is serial
where plain steps overlap it (issue 50's K = 1 round), as is each pipeline stage's (issue 51). An ``mx.compile``d
function is traced once per shape; a call replays its graph in C++, without the Python. Here:

- a GatedDeltaNet decoder layer's call of a decode step's rows, or of a verify call's recorded rows (at most
  ``MAX_ROWS`` a sequence; of one sequence or a batch's, a trace per batch size) is one compiled call of (hidden
  rows, conv window, recurrent state): its norms, mixer (the same path the layer takes op by op: exo's step
  kernel on MLX CUDA), residuals and dense MLP. What the layer writes
  into its cache (window, state, a verify call's recorded rows) comes out of the call and goes into the real cache
  as the layer would have put it. A layer with an MoE block keeps the block op by op (its routing is stateful
  around a verify call), after the compiled mixer;
- the MTP head's decoder layer (``models.mtp``, an attention layer) likewise, under ``head_key``;
- an attention decoder layer keeps its attention op by op (its KV cache's write position is a Python int) and
  runs its residuals and dense MLP after it as one compiled call; where its attention takes exo's kernel (MLX
  CUDA's decode steps and verify rows), its norm, projections and rope are one compiled call too (the position an
  array input), the KV write and the kernel op by op, and the output gate and projection join the call after.

The same ops in the same order: on this CPU the outputs are the op-by-op layers' bits (tests/engine/
test_compiled_layers.py); where MLX fuses elementwise ops in a compiled graph on a GPU, ``bench/compiled_step.py``
says whether the bits stay. A tensor-sharded layer (``engine/sharding.py``) all-reduces its mixer's and its MLP's
partial sums inside the same compiled calls (MLX's ``all_sum`` is an op of the traced graph), in the order the
op-by-op layer runs them, so every member's collectives stay in step whichever path each takes. Not compiled: prompt
chunks (their lengths vary), a batch-invariant step, a GatedDeltaNet call under a mask or per-sequence lengths (a
batch's prefill); a batch's attention runs under its mask op by op, its residuals and MLP compiled after it.

A traced function bakes in the Python path it took, so the functions are kept per layer and per everything that
changes that path at run time: the benchmarks' kernel switches (``layers.QGEMV_ON``, ``GDN_KERNEL_ON``,
``COMPILED_ROWS``, ``prompt_dense.suspended``: a batch step's products dense or not, ``EXO_BATCH_DENSE``), the
model's verify state (``set_verify_mode``: MoE routing, per-row products) and whether a tensor forward's collectives
are on (``sharding.collectives``).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from ..sharding import reduce_partial
from . import layers, positions, prompt_dense
from .layers import Attention, RollbackArraysCache, SparseMoeBlock

log = logging.getLogger(__name__)

# "cuda" (the default; also "1": on MLX CUDA, where one H200 decoded the 9B shape 1.26x faster with them, the
# same greedy tokens: docs/performance.md), "always" (any device: the tests, A/B on the CPU), "off" (also "0")
def parse_mode(value: str) -> str:
    """``EXO_COMPILED_LAYERS``'s value as a mode: "off", "cuda" or "always" (anything else: the default, "cuda")."""
    return {"0": "off", "off": "off", "always": "always"}.get(value.strip().lower(), "cuda")


MODE = parse_mode(os.environ.get("EXO_COMPILED_LAYERS", ""))

# A call of more rows is a prompt chunk: op by op (a trace per length would be compiled once and rarely used again)
MAX_ROWS = 8


def mode_key(model: Any) -> tuple[Any, ...] | None:
    """The run-time state the compiled functions of ``model``'s layers depend on, or None where nothing is compiled
    now (off, another device, a batch-invariant step)."""
    if not _applies():
        return None
    state = model.__dict__
    if state.get("_batch_invariant_on"):
        return None
    verify = state.get("_verify_state", (None, False, False))
    share = state.get("tensor_share")
    return (layers.QGEMV_ON, layers.GDN_KERNEL_ON, layers.COMPILED_ROWS, verify, share is not None and share.active,
            prompt_dense.state())


def head_key() -> tuple[Any, ...] | None:
    """``mode_key`` for the MTP head's decoder layer (``models.mtp``: no verify state, never sharded), or None."""
    if not _applies():
        return None
    return (layers.QGEMV_ON, layers.GDN_KERNEL_ON, layers.COMPILED_ROWS, prompt_dense.state(), "head")


def _applies() -> bool:
    """Whether ``MODE`` compiles anything on this process's device."""
    return MODE == "always" or (MODE == "cuda" and mx.default_device() == mx.gpu and mx.cuda.is_available())


def describe() -> str:
    """What the runner's log says of them: the mode, and whether it applies on this process's device."""
    return f"{MODE} ({'on' if _applies() else 'off'} here)"


def traced(model: Any) -> int:
    """How many compiled functions ``model``'s layers hold now (each traced at its first call; a diagnostic)."""
    return sum(1 for layer in model.stage_layers for name, f in layer.__dict__.get("_compiled_layer_steps", {}).items()
               if f is not None and name[0] != "gdn-structure")


def call(layer: Any, x: mx.array, mask: Any, cache: Any, key: tuple[Any, ...]) -> mx.array:
    """``layer(x, mask=mask, cache=cache)``, through compiled calls where they apply (``key``: ``mode_key``). On
    every decode step of every layer: the per-layer facts are found once (``_facts``), the compiled function in one
    lookup."""
    shape = x.shape
    rows = shape[1]
    if rows > MAX_ROWS or layer.training:
        return layer(x, mask=mask, cache=cache)
    state = layer.__dict__
    is_linear, dense, attention = state.get("_compiled_facts") or _facts(layer)
    found = state.get("_compiled_layer_steps") or state.setdefault("_compiled_layer_steps", {})
    if not is_linear:
        if not dense:
            return layer(x, mask=mask, cache=cache)
        if attention is not None and (attention.kernel_applies(cache, mask, shape[0], rows)
                                      or positions.at(cache) is not None):
            return _attention_layer(layer, attention, x, cache, key)
        r = layer.self_attn(layer.input_layernorm(x), mask, cache)  # (a batch's attention under its mask)
        name = ("tail", key)
        tail = found[name] if name in found else _compiled(layer, name, lambda: _tail(layer))
        if tail is not None:
            try:
                return tail(x, r)
            except Exception as e:  # noqa: BLE001 - MLX could not trace it: op by op from now on
                _give_up(layer, name, e)
        h = x + _reduce(layer, r)
        return h + _reduce(layer, layer.mlp(layer.post_attention_layernorm(h)))
    if mask is not None or not isinstance(cache, RollbackArraysCache):
        return layer(x, mask=mask, cache=cache)
    recording = cache.recording
    window, recurrent = cache[0], cache[1]
    if (window is None or recurrent is None or cache.lengths is not None or cache.capture_at
            or not (rows == 1 or recording)):
        return layer(x, mask=mask, cache=cache)
    name = ("gdn", recording, dense, key)
    if name in found:
        compiled = found[name]
    else:  # (the shapes each trace saw, and what it wrote into its cache: ``_gdn_step``)
        structure = _compiled(layer, ("gdn-structure", recording, dense, key), dict)
        compiled = _compiled(layer, name, lambda: (_gdn_step(layer, recording, dense, structure), structure))
    if compiled is None:  # (given up)
        return layer(x, mask=mask, cache=cache)
    step, structure = compiled
    try:
        outputs = step(x, window, recurrent)  # (nothing written into the cache before it returns)
    except Exception as e:  # noqa: BLE001 - MLX could not trace it: op by op from now on
        _give_up(layer, name, e)
        return layer(x, mask=mask, cache=cache)
    new_window, new_state, states, has_after = structure[shape]
    i = 1
    if new_window:
        cache[0] = outputs[i]
        i += 1
    if new_state:
        cache[1] = outputs[i]
        i += 1
    if recording:
        cache.record(outputs[i], outputs[i + 1 : i + 1 + states], after=outputs[i + 1 + states] if has_after else None)
    cache.advance(rows)
    h = outputs[0]
    return h if dense else h + _reduce(layer, layer.mlp(layer.post_attention_layernorm(h)))


def _facts(layer: Any) -> tuple[bool, bool, Attention | None]:
    """What ``call`` asks of a layer on every call, found once: whether it is a GatedDeltaNet layer, whether its MLP
    is dense, and its attention where it is exo's ``Attention`` (whose kernel path the compiled calls go around)."""
    mlp = layer.mlp
    attention = None if layer.is_linear else layer.self_attn
    facts = (bool(layer.is_linear), not isinstance(mlp, SparseMoeBlock) and not hasattr(mlp, "switch_mlp"),
             attention if isinstance(attention, Attention) else None)
    layer.__dict__["_compiled_facts"] = facts  # (not a child module: no parameters)
    return facts


def _reduce(layer: Any, partial: mx.array) -> mx.array:
    """A tensor-sharded layer's partial sum summed over its group (``sharding.reduce_partial``; else itself)."""
    return reduce_partial(layer.__dict__.get("_tensor_share"), partial)


def _compiled(layer: Any, name: tuple[Any, ...], make: Callable[[], Any]) -> Any:
    found = layer.__dict__.setdefault("_compiled_layer_steps", {})  # (not a child module: no parameters)
    if name not in found:
        found[name] = make()
    return found[name]


def _give_up(layer: Any, name: tuple[Any, ...], error: Exception) -> None:
    """A compiled call that failed (MLX 0.32's compile raised ``IndexError: _Map_base::at`` tracing an MLP whose
    products run row by row in a verify call, on this CPU): that layer's calls of that kind go op by op."""
    layer.__dict__["_compiled_layer_steps"][name] = None
    log.warning("a compiled %s call of a decoder layer failed (%s: %s): op by op from now on", name[0],
                type(error).__name__, str(error)[:200])


def _attention_layer(layer: Any, attention: Attention, x: mx.array, cache: Any, key: tuple[Any, ...]) -> mx.array:
    """An attention decoder layer whose attention takes exo's kernel (MLX CUDA's decode step and verify rows): its
    norm, projections and rope one compiled call (``_heads``), the KV cache's write and the kernel op by op (the
    write's position is a Python int), then the output gate and projection, the residuals and the dense MLP one
    compiled call."""
    from ..kernels.cuda_attn import attend_rows

    heads = _compiled(layer, ("heads", key), lambda: _heads(layer, attention))
    if heads is None:
        return layer(x, mask=None, cache=cache)
    at = positions.at(cache)  # (a chained round's cache: written at a device position)
    try:
        queries, keys, values, gate = heads(x, _position(cache.offset) if at is None else at)
    except Exception as e:  # noqa: BLE001 - MLX could not trace it: op by op from now on
        _give_up(layer, ("heads", key), e)
        return layer(x, mask=None, cache=cache)
    if at is None:
        cache.update_and_fetch(keys, values)  # (the cache's buffers hold the new keys now: the kernel reads them)
        output = attend_rows(queries, cache.keys, cache.values, cache.offset, attention.scale)
    else:  # (a chained round's cache: written and read at its device position)
        output = attention.at_position(x, cache, queries, keys, values, gate)
    after = _compiled(layer, ("after-attention", key), lambda: _after_attention(layer))
    if after is not None:
        try:
            return after(x, output, gate)
        except Exception as e:  # noqa: BLE001 - MLX could not trace it: op by op from now on
            _give_up(layer, ("after-attention", key), e)
    h = x + _reduce(layer, attention.gated_output(output, gate))
    return h + _reduce(layer, layer.mlp(layer.post_attention_layernorm(h)))


def _heads(layer: Any, attention: Attention) -> Callable[[mx.array, mx.array], tuple[mx.array, ...]]:
    """An attention decoder layer before its KV write: norm, projections and rope at ``position`` (an int32 array:
    ``mx.fast.rope`` takes a Python int offset as exactly that array, so the bits are the op-by-op call's), one
    compiled call where rope was two Python calls of its own."""
    norm, rope = layer.input_layernorm, attention.rope

    def heads(x: mx.array, position: mx.array) -> tuple[mx.array, ...]:
        queries, keys, values, gate = attention.heads(norm(x))
        return rope(queries, offset=position), rope(keys, offset=position), values, gate

    return mx.compile(heads)


@functools.lru_cache(maxsize=64)
def _position(offset: int) -> mx.array:
    """A cache offset as the int32 array rope takes (one a step, shared by its attention layers)."""
    return mx.array(offset, dtype=mx.int32)


def _after_attention(layer: Any) -> Callable[[mx.array, mx.array, mx.array], mx.array]:
    """An attention decoder layer after its kernel: output gate and projection, residual, norm, MLP, residual."""
    attention, mlp, norm = layer.self_attn, layer.mlp, layer.post_attention_layernorm

    def after(x: mx.array, output: mx.array, gate: mx.array) -> mx.array:
        h = x + _reduce(layer, attention.gated_output(output, gate))
        return h + _reduce(layer, mlp(norm(h)))

    return mx.compile(after)


def _tail(layer: Any) -> Callable[[mx.array, mx.array], mx.array]:
    """An attention decoder layer after its attention: residual, norm, dense MLP, residual."""
    mlp, norm = layer.mlp, layer.post_attention_layernorm

    def tail(x: mx.array, r: mx.array) -> mx.array:
        h = x + _reduce(layer, r)
        return h + _reduce(layer, mlp(norm(h)))

    return mx.compile(tail)


def _gdn_step(layer: Any, recording: bool, dense: bool,
              structure: dict[tuple[int, ...], tuple[bool, bool, int, bool]]) -> Callable[..., list[mx.array]]:
    """A GatedDeltaNet decoder layer's call on a cache of (``window``, ``state``), recording or not: the hidden
    rows out (after the dense MLP, or before an MoE block), then what the layer wrote into its cache, in the order
    ``structure[x.shape]`` says (set while the function is traced: which of window and state it set, how many
    recorded states, whether a stacked ``after``)."""

    def step(x: mx.array, window: mx.array, state: mx.array) -> list[mx.array]:
        cache = RollbackArraysCache()
        cache[0], cache[1] = window, state
        cache.recording = recording
        h = x + _reduce(layer, layer.linear_attn(layer.input_layernorm(x), None, cache))
        if dense:
            h = h + _reduce(layer, layer.mlp(layer.post_attention_layernorm(h)))
        out = [h]
        new_window, new_state = cache[0] is not window, cache[1] is not state
        out += [a for a, new in ((cache[0], new_window), (cache[1], new_state)) if new]
        states, has_after = 0, False
        if recording:
            assert cache._conv_input is not None and cache._states is not None
            states, has_after = len(cache._states), cache._after is not None
            out += [cache._conv_input, *cache._states, *([cache._after] if has_after else [])]
        structure[tuple(x.shape)] = (new_window, new_state, states, has_after)
        return out

    return mx.compile(step)
