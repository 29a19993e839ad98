"""Attention KV caches written and read at a position the device holds (a chained round, ``engine.chain``).

A speculative round keeps a number of its verify rows that only the device knows until the host reads the verdict.
To build and launch the next round before that read, the round's caches take their write position from a device
array: ``at(cache)`` is the position of the call's first row (an int32 scalar), and the cache's ``offset`` (a
Python int, what mlx-lm's code reads) is only an upper bound of the positions filled. The slots between the real
end and ``offset`` hold rows a round wrote and did not keep; the next call writes over them before anything reads
them (it writes from its real position, at most where they start, at least as many rows as there are of them),
and each row of a call attends only to the keys up to its own position:

- on MLX CUDA through exo's decode-attention kernel (``kernels.cuda_attn.attend_rows`` with the position an
  array): its chunks are fixed by a key's index, so a row computes the bits the plain step at its position
  computes, by construction;
- elsewhere through the layer's attention over the buffer up to the bound, under a boolean mask of each row's
  keys: on MLX's CPU backend a row under a mask of trailing keys computes the bits of the same row over exactly
  its keys (``tests/engine/test_positions.py`` checks it on the shapes and types the tests use).

``settle`` ends it: the host has read how many rows were kept, the cache is mlx-lm's plain KV cache again.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

# Arrays derived from a position (the next one, a write's start index, the attention kernel's meta): every layer of
# a call derives the same ones from the same position, so each is one node of the graph, not one a layer (on MLX
# CUDA a node is the host's work). Keyed by the position array's identity, the last few positions only.
_DERIVED: dict[int, tuple[mx.array, dict[Any, mx.array]]] = {}
_DERIVED_KEEP = 16


def derived(position: mx.array, key: Any, make: Any) -> mx.array:
    """``make(position)``, once per ``position`` (the same array object) and ``key``."""
    entry = _DERIVED.get(id(position))
    if entry is None or entry[0] is not position:
        if len(_DERIVED) >= _DERIVED_KEEP:
            _DERIVED.clear()
        entry = _DERIVED[id(position)] = (position, {})
    found = entry[1]
    if key not in found:
        found[key] = make(position)
    return found[key]


def _scalar(position: mx.array) -> mx.array:
    """``position`` as an int32 scalar (itself where it is one)."""
    if position.dtype == mx.int32 and position.ndim == 0:
        return position
    return position.astype(mx.int32).reshape(())


def at(cache: Any) -> mx.array | None:
    """The device position of ``cache``'s next write, or None where the cache is written at its ``offset``."""
    return cache.__dict__.get("at") if hasattr(cache, "__dict__") else None


def start(cache: Any, position: mx.array, bound: int) -> None:
    """From now on ``cache`` is written at ``position`` (int32 scalar; at most ``bound``, the host's upper bound)."""
    cache.at = _scalar(position)
    cache.offset = bound


def settle(cache: Any, offset: int) -> None:
    """The host knows the real ``offset`` (the positions filled): a plain KV cache again."""
    cache.__dict__.pop("at", None)
    cache.offset = offset


def write(cache: Any, keys: mx.array, values: mx.array) -> mx.array:
    """Write ``keys`` / ``values`` [1, Hkv, L, D] at ``at(cache)`` (the buffers grown as mlx-lm's ``KVCache`` grows
    them, from the bound); the position moves on by L, the bound by L. Returns the position of the first row."""
    position = at(cache)
    assert position is not None
    L = keys.shape[2]
    bound = cache.offset
    if cache.keys is None or bound + L > cache.keys.shape[2]:
        B, heads, _, k_dim = keys.shape
        step = cache.step
        grown = ((bound + L + step - 1) // step) * step
        new_k = mx.zeros((B, heads, grown - (0 if cache.keys is None else cache.keys.shape[2]), k_dim), keys.dtype)
        new_v = mx.zeros((B, heads, new_k.shape[2], values.shape[3]), values.dtype)
        if cache.keys is None:
            cache.keys, cache.values = new_k, new_v
        else:
            cache.keys = mx.concatenate([cache.keys, new_k], axis=2)
            cache.values = mx.concatenate([cache.values, new_v], axis=2)
    start_index = derived(position, "index", lambda p: p.reshape(1))
    cache.keys = mx.slice_update(cache.keys, keys, start_index, axes=(2,))
    cache.values = mx.slice_update(cache.values, values, start_index, axes=(2,))
    cache.offset = bound + L
    cache.at = derived(position, ("next", L), lambda p: p + L)
    return position


def rewind(cache: Any, position: mx.array) -> None:
    """The next write goes to ``position`` (device; a round kept fewer rows than it wrote: the first row's position
    plus the rows kept). The bound stays."""
    cache.at = _scalar(position)


def row_mask(position: mx.array, rows: int, bound: int) -> mx.array:
    """[rows, bound] bool: row t (at ``position`` + t) sees keys 0 .. ``position`` + t."""
    return derived(position, ("mask", rows, bound), lambda p: mx.arange(bound, dtype=mx.int32)[None]
                   <= (p + mx.arange(rows, dtype=mx.int32))[:, None])
