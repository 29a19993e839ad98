"""Caches written at a position the device holds (``models.positions``, ``RollbackArraysCache.commit_at``): the
pieces of a chained round, whose kept rows only the device knows when the next round is built. A verify call's
rows computed at a device position give the bits plain decoding gives at those positions, whatever rows a round
before wrote past its kept ones; the caches then hold the plain ones' values."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import pytest

from exo.engine import Engine, EngineConfig, load_checkpoint
from exo.engine.models import layers, positions

ARCHS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def _engine(path) -> Engine:
    loaded = dataclasses.replace(load_checkpoint(path), eos_token_ids=frozenset())
    return Engine(loaded, EngineConfig(prefill_chunk=8))


def _bits_equal(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(mx.array_equal(a, b).item())


def test_a_masked_row_over_trailing_keys_computes_the_bits_of_the_row_over_its_keys():
    """What the CPU's path rests on: MLX's attention (and exo's CPU attention, its bits) of a row under a boolean
    mask of trailing keys equals the same row over exactly its keys, in the types the models use."""
    from exo.engine.kernels import cpu_linear

    linear = cpu_linear()
    key = mx.random.key(7)
    for dtype in (mx.bfloat16, mx.float32):
        for n, extra, rows in ((1, 1, 1), (17, 3, 2), (64, 5, 4), (257, 9, 4), (300, 40, 3)):
            kq, kk, kv, key = mx.random.split(key, 4)
            bound = n + extra + rows - 1
            q = mx.random.normal((1, 8, rows, 128), key=kq).astype(dtype)
            k = mx.random.normal((1, 2, bound, 128), key=kk).astype(dtype)
            v = mx.random.normal((1, 2, bound, 128), key=kv).astype(dtype)
            position = mx.array(n - 1, dtype=mx.int32)
            mask = positions.row_mask(position, rows, bound)
            together = [mx.fast.scaled_dot_product_attention(q, k, v, scale=0.088, mask=mask)]
            if linear is not None and dtype == mx.bfloat16:
                together.append(layers.cpu_attention(linear, q, k, v, 0.088, mask))
            for t in range(rows):
                alone = mx.fast.scaled_dot_product_attention(q[:, :, t : t + 1], k[:, :, : n + t], v[:, :, : n + t],
                                                             scale=0.088)
                for out in together:
                    assert _bits_equal(out[:, :, t : t + 1], alone), (dtype, n, extra, rows, t)


def _caches_equal(a: list, b: list, keys: int) -> None:
    for x, y in zip(a, b, strict=True):
        if isinstance(x, layers.RollbackArraysCache):
            assert _bits_equal(x[0], y[0]) and _bits_equal(x[1], y[1])
        else:
            assert x.offset == y.offset == keys
            assert _bits_equal(x.keys[:, :, :keys], y.keys[:, :, :keys])
            assert _bits_equal(x.values[:, :, :keys], y.values[:, :, :keys])


@pytest.mark.parametrize("paths", ["cpu", "compiled", "cuda"])
@pytest.mark.parametrize("arch", ARCHS)
def test_rounds_at_a_device_position_give_plain_decodings_bits(checkpoint, arch, paths, monkeypatch):
    """Plain steps of tokens a..e against chained verify calls: [a, x, y] keeping 1 (its rows past a written, not
    kept), then [b, c, d] at the device position after a, keeping 3, then the caches settled and a plain step of
    e. Every kept row's hidden and logits are plain decoding's bits, and so are the caches after. ``compiled``:
    the decoder layers as compiled calls; ``cuda``: wired as on MLX CUDA (exo's GatedDeltaNet and attention kernels,
    their references standing in on this CPU), compiled."""
    if paths in ("compiled", "cuda"):
        monkeypatch.setattr("exo.engine.models.compiled_layers.MODE", "always")
    if paths == "cuda":
        monkeypatch.setenv("EXO_GDN_KERNEL", "always")
        monkeypatch.setenv("EXO_ATTN_KERNEL", "always")
    engine = _engine(checkpoint(arch, dtype="bfloat16"))
    forward, model = engine.forward, engine.model
    prompt = mx.array([[(7 * i + 3) % engine.vocab_size for i in range(13)]], dtype=mx.uint32)
    a, b, c, d, e, x, y = ((11 * i + 5) % engine.vocab_size for i in range(7))

    plain = forward.new_cache()
    mx.eval(forward.hidden(prompt, plain))
    want = []
    for token in (a, b, c, d, e):
        hidden = forward.hidden(mx.array([[token]], dtype=mx.uint32), plain)
        want.append((hidden, model.logits(hidden)))
        mx.eval(want[-1])

    chained = forward.new_cache()
    mx.eval(forward.hidden(prompt, chained))
    attention = [cache for cache in chained if not isinstance(cache, layers.RollbackArraysCache)]
    assert attention
    start = mx.array(13, dtype=mx.int32)
    for cache in attention:
        positions.start(cache, start, 13)

    def round_of(tokens: list[int], first: mx.array, kept: mx.array) -> mx.array:
        hidden = forward.hidden(mx.array([tokens], dtype=mx.uint32), chained, verify=True)
        for cache in chained:
            if isinstance(cache, layers.RollbackArraysCache):
                cache.commit_at(kept)
            else:
                positions.rewind(cache, first + kept)
        return hidden

    one = mx.array(1, dtype=mx.int32)
    first = round_of([a, x, y], start, one)
    second = round_of([b, c, d], start + one, mx.array(3, dtype=mx.int32))
    got = [first[:, :1], second[:, :1], second[:, 1:2], second[:, 2:3]]
    mx.eval(got, [cache.state for cache in chained])
    for (hidden, logits), row in zip(want, got, strict=False):
        assert _bits_equal(row, hidden)
        assert _bits_equal(model.logits(row), logits)
    assert all(cache.offset == 19 for cache in attention)  # the bound: every row written
    for cache in attention:
        positions.settle(cache, 17)
        assert positions.at(cache) is None
    hidden = forward.hidden(mx.array([[e]], dtype=mx.uint32), chained)
    assert _bits_equal(hidden, want[4][0])
    _caches_equal(chained, plain, 18)


def test_the_dynamic_ops_a_chained_round_takes_compute_as_their_python_offset_forms_here():
    """``ahead.dynamic_ops``: the check that leaves rounds unchained on a device whose array-offset slices fail or
    differ (run once per process on MLX CUDA) passes on this CPU."""
    from exo.engine.ahead import dynamic_ops

    dynamic_ops.cache_clear()
    assert dynamic_ops()
