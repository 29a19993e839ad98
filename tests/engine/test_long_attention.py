"""A long context's prompt chunks attend in key blocks (engine/models/long_attention.py, ``EXO_LONG_ATTENTION``).

The point on MLX CUDA is speed (bench/long_attention.py measures it there). What these tests hold on the CPU
(``on:KEYS:BLOCK``): the setting; the blocked attention against MLX's causal attention and a float32 one on random
inputs (grouped heads, blocks that do not divide the keys, no cached keys); which calls take it; and a model whose
prompt chunks take it: its tokens do not depend on how the prompt is cut into chunks (what a cache hit relies on),
and stay close to MLX's attention's.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import pytest

from exo.engine import Engine, EngineConfig, GenerationRequest, load_checkpoint
from exo.engine.models import long_attention
from exo.engine.models.long_attention import applies, blocked_attention, causal_mask, setting


@pytest.mark.parametrize(("value", "want"), [(None, ("off", 0, 0)), ("off", ("off", 0, 0)), ("0", ("off", 0, 0)),
                                             ("on", ("cuda", long_attention.MIN_KEYS, long_attention.BLOCK)),
                                             (" ON:64:32 ", ("always", 64, 32))])
def test_the_setting(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv("EXO_LONG_ATTENTION", raising=False)
    else:
        monkeypatch.setenv("EXO_LONG_ATTENTION", value)
    assert setting() == want


@pytest.mark.parametrize("value", ["yes", "on:64", "on:0:32", "on:64:x", "always:1:1"])
def test_a_bad_setting_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("EXO_LONG_ATTENTION", value)
    with pytest.raises(ValueError, match="EXO_LONG_ATTENTION must be"):
        setting()


def test_on_is_for_mlx_cuda_alone(monkeypatch):
    monkeypatch.setenv("EXO_LONG_ATTENTION", "on")
    assert long_attention.configured() is None  # this CPU
    monkeypatch.setenv("EXO_LONG_ATTENTION", "on:8:4")
    assert long_attention.configured() == (8, 4)


def _inputs(rows: int, context: int, heads: int = 4, kv_heads: int = 2, dim: int = 32, dtype=mx.bfloat16):
    a, b, c = mx.random.split(mx.random.key(rows * 31 + context), 3)
    q = mx.random.normal((1, heads, rows, dim), key=a).astype(dtype)
    k = mx.random.normal((1, kv_heads, context + rows, dim), key=b).astype(dtype)
    v = mx.random.normal((1, kv_heads, context + rows, dim), key=c).astype(dtype)
    return q, k, v


def _float32(q, k, v, context):
    b, heads, rows, dim = q.shape
    qf = q.astype(mx.float32).reshape(b, k.shape[1], heads // k.shape[1], rows, dim) * dim**-0.5
    scores = qf @ k.astype(mx.float32)[:, :, None].swapaxes(-1, -2)
    scores = mx.where(causal_mask(rows, context, 0, k.shape[2]), scores, -mx.inf)
    return (mx.softmax(scores, axis=-1) @ v.astype(mx.float32)[:, :, None]).reshape(b, heads, rows, dim)


@pytest.mark.parametrize(("rows", "context", "block"), [(8, 0, 4), (8, 50, 16), (13, 77, 32), (20, 100, 512)])
def test_blocked_attention_is_mlx_s_causal_attention(rows, context, block):
    """Within bfloat16 rounding of a float32 computation, as MLX's own call is; in float32 equal to it closely."""
    q, k, v = _inputs(rows, context)
    scale = q.shape[-1] ** -0.5
    want = _float32(q, k, v, context)
    got = blocked_attention(q, k, v, scale, block)
    mlx = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
    assert got.shape == q.shape and got.dtype == q.dtype
    top = mx.abs(want).max()
    ours, theirs = (mx.abs(x.astype(mx.float32) - want).max() / top for x in (got, mlx))
    assert ours.item() < 2e-2 and ours.item() <= 2 * theirs.item() + 1e-3
    q32, k32, v32 = (x.astype(mx.float32) for x in (q, k, v))
    exact = mx.fast.scaled_dot_product_attention(q32, k32, v32, scale=scale, mask="causal")
    assert mx.allclose(blocked_attention(q32, k32, v32, scale, block), exact, atol=1e-5, rtol=1e-5).item()
    # the query heads of a KV head as rows of one product, or as a group axis against broadcast keys: alike
    unfolded = blocked_attention(q32, k32, v32, scale, block, fold=False)
    assert mx.allclose(blocked_attention(q32, k32, v32, scale, block), unfolded, atol=1e-6, rtol=1e-6).item()


def test_the_blocks_past_a_row_leave_it_as_it_was():
    """A row's value does not depend on how many later rows (and key blocks) share its call: a prompt cut into other
    chunks gives it the same bits (on this CPU, whose products round each row alike)."""
    q, k, v = _inputs(24, 40)
    scale = q.shape[-1] ** -0.5
    whole = blocked_attention(q, k, v, scale, 16)
    first = blocked_attention(q[:, :, :10], k[:, :, : 40 + 10], v[:, :, : 40 + 10], scale, 16)
    assert mx.array_equal(whole[:, :, :10], first).item()
    unfolded = blocked_attention(q, k, v, scale, 16, fold=False)
    assert mx.array_equal(unfolded[:, :, :10], blocked_attention(q[:, :, :10], k[:, :, :50], v[:, :, :50], scale, 16,
                                                                 fold=False)).item()


def test_which_calls_take_it():
    q, k, _ = _inputs(8, 56)
    assert applies(q, k, "causal", 64)
    assert not applies(q, k, "causal", 65)  # too few keys
    assert not applies(q, k, None, 1) and not applies(q, k, mx.ones((8, 64), dtype=mx.bool_), 1)  # a batch's mask
    assert not applies(q[:, :, :1], k, "causal", 1)  # a decode step
    assert not applies(mx.concatenate([q, q]), mx.concatenate([k, k]), "causal", 1)  # a batch


def test_a_model_s_long_prompt_takes_it_whatever_its_chunks(checkpoint, monkeypatch):
    """``EXO_LONG_ATTENTION=on:24:16``: a 70-token prompt's chunks past 24 keys attend in blocks; the greedy tokens are
    the same in chunks of 16 and of 40, and close to MLX's attention's (the first step's logits)."""
    path = checkpoint("qwen3_5", dtype="float32")
    prompt = list(range(3, 73))
    plain = Engine(dataclasses.replace(load_checkpoint(path), eos_token_ids=frozenset()), EngineConfig(prefill_chunk=16))
    want = plain.complete(GenerationRequest(prompt, max_tokens=8, native_mtp="off"))
    monkeypatch.setenv("EXO_LONG_ATTENTION", "on:24:16")
    loaded = dataclasses.replace(load_checkpoint(path), eos_token_ids=frozenset())
    calls: list[tuple[int, int]] = []
    real = long_attention.blocked_attention
    monkeypatch.setattr(long_attention, "blocked_attention",
                        lambda q, k, v, s, b: calls.append((q.shape[2], k.shape[2])) or real(q, k, v, s, b))
    got = {chunk: Engine(loaded, EngineConfig(prefill_chunk=chunk)).complete(
        GenerationRequest(prompt, max_tokens=8, native_mtp="off")) for chunk in (16, 40)}
    assert calls and all(keys >= 24 and rows > 1 for rows, keys in calls)
    assert got[16].token_ids == got[40].token_ids
    assert got[16].token_ids == want.token_ids
