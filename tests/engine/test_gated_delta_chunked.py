"""The chunked (WY) gated delta rule (engine/models/gated_delta_chunked.py) against the token loop, and where
the layers take it (``EngineConfig.gdn_prefill``).

The tolerance: in float32 the chunked form equals mlx-lm's token loop (``gated_delta_ops``) up to
``TOL * max(1, max |loop|)`` in every output and every state entry. The two sum the same products in another
order (C x C and C x D products instead of row by row), so they agree to a few float32 ulps of the values'
scale: measured at most 2.5e-6 of it on these inputs, the stress case (nearly parallel keys, beta ~ 1, no
decay: the triangular solve at its worst) included; TOL leaves 4x room.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.gated_delta import compute_g, gated_delta_ops, normalize_qk

from exo.engine import GenerationRequest, SamplingParams
from exo.engine import prefix_cache as pc
from exo.engine.models import layers
from exo.engine.models.gated_delta_chunked import _inverse_unit_lower, gated_delta_chunked, log_decay
from exo.engine.models.layers import RollbackArraysCache
from tests.fixtures.engines import fresh_engine

TOL = 1e-5


def _inputs(B: int, T: int, hk: int = 2, hv: int = 4, dk: int = 32, dv: int = 16, seed: int = 0,
            dtype: mx.Dtype = mx.float32) -> tuple[mx.array, ...]:
    """Random q, k (normalized and scaled as mlx-lm's layers do), v, a, b, A_log, dt_bias, and a state."""
    mx.random.seed(seed)
    q, k = normalize_qk(mx.random.normal((B, T, hk, dk)), mx.random.normal((B, T, hk, dk)),
                        inv_scale=dk**-0.5, eps=1e-6)
    v = mx.random.normal((B, T, hv, dv))
    a, b = mx.random.normal((B, T, hv)), mx.random.normal((B, T, hv))
    A_log, dt_bias = mx.log(mx.random.uniform(1, 16, (hv,))), 0.5 * mx.random.normal((hv,))
    state = 0.1 * mx.random.normal((B, hv, dv, dk))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), a, b, A_log, dt_bias, state


def _loop(q, k, v, a, b, A_log, dt_bias, state, mask=None):
    return gated_delta_ops(q, k, v, compute_g(A_log, a, dt_bias), mx.sigmoid(b), state, mask)


def _chunked(q, k, v, a, b, A_log, dt_bias, state, mask=None, chunk=64):
    return gated_delta_chunked(q, k, v, log_decay(A_log, a, dt_bias), mx.sigmoid(b), state, mask, chunk)


def _close(got: mx.array, want: mx.array, tol: float = TOL) -> None:
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    scale = max(1.0, mx.abs(want).max().item())
    err = mx.abs(got - want).max().item()
    assert err <= tol * scale, f"max |chunked - loop| = {err:.3g} at scale {scale:.3g}"


@pytest.mark.parametrize("T", [1, 63, 64, 65, 1000])
def test_chunked_equals_the_token_loop_with_a_state_carried_in_and_out(T):
    """Grouped heads (4 value heads on 2 key heads), a random state in, the state out."""
    x = _inputs(2, T)
    y, state = _chunked(*x)
    y_loop, state_loop = _loop(*x)
    assert y.shape == y_loop.shape and y.dtype == y_loop.dtype and state.dtype == mx.float32
    _close(y, y_loop)
    _close(state, state_loop)


def test_a_state_carried_across_calls_equals_one_call():
    """Two calls with the state carried between them: at a chunk edge the same values bit for bit (the same
    chunks, the same products); elsewhere the chunks differ and the values agree within the tolerance."""
    q, k, v, a, b, A_log, dt_bias, s0 = _inputs(1, 200, seed=1)
    y, s = _chunked(q, k, v, a, b, A_log, dt_bias, s0)
    for cut, exact in ((64, True), (128, True), (70, False)):
        y1, s1 = _chunked(q[:, :cut], k[:, :cut], v[:, :cut], a[:, :cut], b[:, :cut], A_log, dt_bias, s0)
        y2, s2 = _chunked(q[:, cut:], k[:, cut:], v[:, cut:], a[:, cut:], b[:, cut:], A_log, dt_bias, s1)
        joined = mx.concatenate([y1, y2], axis=1)
        if exact:
            assert mx.array_equal(joined, y).item() and mx.array_equal(s2, s).item(), cut
        _close(joined, y)
        _close(s2, s)


def test_left_padding_masks_of_a_batch():
    """Rows masked off (a batch's left padding) leave the state as it was, as mlx-lm's masked step does: each
    sequence's outputs and final state equal its own unpadded run, its padded rows output 0, and a call whose
    rows are all masked returns the state it was given, bit for bit."""
    T, pads = 150, [0, 7, 90]
    q, k, v, a, b, A_log, dt_bias, s0 = _inputs(3, T, seed=2)
    mask = mx.arange(T)[None] >= mx.array(pads)[:, None]
    y, s = _chunked(q, k, v, a, b, A_log, dt_bias, s0, mask)
    y_loop, s_loop = _loop(q, k, v, a, b, A_log, dt_bias, s0, mask)
    _close(s, s_loop)
    for i, p in enumerate(pads):
        _close(y[i, p:], y_loop[i, p:])
        assert not mx.any(y[i, :p]).item()
        alone_y, alone_s = _chunked(q[i : i + 1, p:], k[i : i + 1, p:], v[i : i + 1, p:], a[i : i + 1, p:],
                                    b[i : i + 1, p:], A_log, dt_bias, s0[i : i + 1])
        _close(y[i : i + 1, p:], alone_y)
        _close(s[i : i + 1], alone_s)
    _, kept = _chunked(q, k, v, a, b, A_log, dt_bias, s0, mx.zeros((3, T), dtype=mx.bool_))
    assert mx.array_equal(kept, s0).item()


def test_nearly_parallel_keys_and_no_decay_stay_within_the_tolerance():
    """The triangular solve at its worst: every key close to one direction, beta ~ 1, g ~ 1 (the inverse's
    entries are then large alternating sums; a power series of A would lose everything in float32)."""
    B, T, hk, hv, dk, dv = 2, 1000, 2, 4, 64, 32
    mx.random.seed(3)
    base = mx.random.normal((1, 1, hk, dk))
    q, k = normalize_qk(mx.random.normal((B, T, hk, dk)), base + 0.05 * mx.random.normal((B, T, hk, dk)),
                        inv_scale=dk**-0.5, eps=1e-6)
    v = 3 * mx.random.normal((B, T, hv, dv))
    a, b = mx.full((B, T, hv), -20.0), mx.full((B, T, hv), 8.0)
    A_log, dt_bias = mx.zeros((hv,)), mx.zeros((hv,))
    y, s = _chunked(q, k, v, a, b, A_log, dt_bias, None)
    y_loop, s_loop = _loop(q, k, v, a, b, A_log, dt_bias, None)
    _close(y, y_loop)
    _close(s, s_loop)


def test_the_block_inverse_inverts():
    """(I + A)^-1 for A as the rule builds it (beta_t k_t . k_i below the diagonal, unit keys)."""
    mx.random.seed(4)
    k = mx.random.normal((3, 64, 32))
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    a = mx.tril(mx.random.uniform(0, 1, (3, 64, 1)) * (k @ k.swapaxes(-1, -2)), k=-1)
    eye = mx.eye(64)
    _close((eye + a) @ _inverse_unit_lower(a), mx.broadcast_to(eye, (3, 64, 64)))


def test_bfloat16_inputs_round_like_the_loop():
    """bfloat16 q, k, v (a bfloat16 model's): the outputs are bfloat16 like the loop's and differ from them by
    at most one bfloat16 rounding of their scale; the float32 states by the float32 tolerance."""
    x = _inputs(1, 300, seed=5, dtype=mx.bfloat16)
    y, s = _chunked(*x)
    y_loop, s_loop = _loop(*x)
    assert y.dtype == mx.bfloat16
    _close(y, y_loop, tol=2**-8)
    _close(s, s_loop)


# -- in the layers ----------------------------------------------------------------------------------------


def _layer_run(layer, inputs: mx.array, mode: str, state=None, recording=False):
    cache = RollbackArraysCache()
    if state is not None:
        cache[0], cache[1] = state
    cache.recording = recording
    layer.gdn_prefill = mode
    out = layer(inputs, cache=cache)
    mx.eval(out, cache[0], cache[1])
    return out, (cache[0], cache[1])


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_the_layer_takes_the_chunked_form_for_a_prompt_only(checkpoint, arch):
    """``chunked``: a prompt chunk's recurrence is the chunked form (its state then differs from the loop's in
    the last bits, within the tolerance); a one-row decode step and a recorded verify call stay exactly on
    today's path. ``auto`` on the CPU is today's path (exo's kernel) bit for bit."""
    engine = fresh_engine(checkpoint(arch, dtype="float32"))
    layer = next(layer.linear_attn for layer in engine.model.stage_layers if layer.is_linear)
    try:
        mx.random.seed(6)
        prompt = mx.random.normal((1, 150, engine.model.hidden_size))
        out_loop, state_loop = _layer_run(layer, prompt, "loop")
        out_auto, state_auto = _layer_run(layer, prompt, "auto")
        out, state = _layer_run(layer, prompt, "chunked")
        assert mx.array_equal(out_auto, out_loop).item() and mx.array_equal(state_auto[1], state_loop[1]).item()
        assert not mx.array_equal(state[1], state_loop[1]).item()  # another path ran
        _close(state[1], state_loop[1])
        _close(out, out_loop)
        assert mx.array_equal(state[0], state_loop[0]).item()  # the conv window is not the recurrence's
        for rows, recording in ((1, False), (3, True)):
            step = prompt[:, :rows]
            got = _layer_run(layer, step, "chunked", state_loop, recording)
            want = _layer_run(layer, step, "loop", state_loop, recording)
            assert mx.array_equal(got[0], want[0]).item() and mx.array_equal(got[1][1], want[1][1]).item()
    finally:
        layer.gdn_prefill = "auto"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_shifted_conv_equals_the_layer_s_conv1d(checkpoint, dtype):
    """The chunked path's conv (its taps' shifted rows summed in float32, rounded once) gives the layer's
    ``conv1d`` bit for bit on this CPU (on a GPU up to the order of its float32 sums)."""
    engine = fresh_engine(checkpoint("qwen3_5", dtype=dtype))
    layer = next(layer.linear_attn for layer in engine.model.stage_layers if layer.is_linear)
    mx.random.seed(7)
    x = mx.random.normal((2, 130, layer.conv_dim)).astype(layer.conv1d.weight.dtype)
    got, want = layers._shifted_conv(x, layer.conv1d), layer.conv1d(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert mx.array_equal(got, want).item()


def _greedy(engine, prompt: list[int], max_tokens: int = 24):
    return engine.complete(GenerationRequest(prompt, max_tokens=max_tokens, native_mtp="off",
                                             sampling=SamplingParams(temperature=0.0)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_greedy_output_with_the_chunked_prefill_equals_the_loop(checkpoint, arch, dtype):
    """A whole model, prefill forced through the chunked form vs today's path, 150-token prompt in 64-token
    prefill chunks: the greedy reply is the same token for token, and with MTP at K = 2 too. Why equality
    holds: in float32 the two prefills differ by ~1e-6 of the values' scale, in bfloat16 by at most a
    rounding of a GatedDeltaNet output here and there, while the trained fixtures' greedy choices lead by far
    more than that (a near tie could flip on other weights: the GPU benchmark counts those,
    bench/prefill.py). The first token's logits agree to 1e-3 (float32) / 5e-2 (bfloat16) of their scale, and
    the recurrent states differ (the chunked form ran)."""
    path = checkpoint(arch, dtype=dtype)
    prompt = list(range(3, 153))
    replies, logits, states = {}, {}, {}
    for mode in ("loop", "chunked"):
        engine = fresh_engine(path, eos=False, prefill_chunk=64, gdn_prefill=mode)
        replies[mode] = (_greedy(engine, prompt).token_ids,
                         engine.complete(GenerationRequest(prompt, max_tokens=16, mtp_k=2)).token_ids)
        cache = engine.model.make_cache()
        hidden = engine.model.hidden(mx.array(prompt)[None], cache)
        logits[mode] = engine.model.logits(hidden[:, -1:])
        states[mode] = [c[1] for c in cache if isinstance(c, RollbackArraysCache)]
    assert replies["chunked"] == replies["loop"]
    assert not all(mx.array_equal(a, b).item() for a, b in zip(states["chunked"], states["loop"], strict=True))
    _close(logits["chunked"], logits["loop"], tol=1e-3 if dtype == "float32" else 5e-2)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_a_snapshot_at_a_chunk_edge_restored_equals_a_cold_run(checkpoint, arch):
    """The chunked prefill with the prefix cache: a snapshot at a chunk edge (position 128, prefill chunks of
    64) restored, then the rest prefilled, gives the recurrent states and the reply of a cold run of the whole
    prompt, bit for bit: the cold run (an empty cache) stops at the same edges, so its chunks fall on the same
    rows. (A run without a cache stops at other edges; its values differ from these within the float32
    tolerance, as any other chunking does.)"""
    path = checkpoint(arch, dtype="float32")
    first = list(range(3, 132))  # a raw prompt of 129 tokens: snapshots at 64 and 128 (its last token's)
    second = first[:128] + list(range(200, 280))
    warm, cold = (fresh_engine(path, eos=False, prefill_chunk=64, gdn_prefill="chunked") for _ in range(2))
    for engine in (warm, cold):  # the cold one's cache stays empty: its prefill stops at the same edges
        engine.prefix_cache = pc.PrefixCache(pc.MemoryStore(1 << 30), pc.namespace(engine.loaded), block_tokens=16,
                                             stride_tokens=64, message_starts=frozenset(), min_snapshot_tokens=8)

    def states(engine):  # (a prefill alone stores nothing: the store comes after the first token)
        run = engine.start(GenerationRequest(second, max_tokens=2, native_mtp="off"))
        for _ in run.prefill():
            pass
        mx.eval([c.state for c in run.cache])
        return [c[1] for c in run.cache if isinstance(c, RollbackArraysCache)], run.prefilled

    _greedy(warm, first)
    restored, prefilled = states(warm)
    cold_states, cold_prefilled = states(cold)
    assert (prefilled, cold_prefilled) == (128, 0)
    assert all(mx.array_equal(r, c).item() for r, c in zip(restored, cold_states, strict=True))
    loop_states, _ = states(fresh_engine(path, eos=False, prefill_chunk=64, gdn_prefill="loop"))
    assert not all(mx.array_equal(r, c).item() for r, c in zip(restored, loop_states, strict=True))  # chunked ran
    hit, cold_run = _greedy(warm, second), _greedy(cold, second)
    assert (hit.stats.cached_tokens, cold_run.stats.cached_tokens) == (128, 0)
    assert hit.token_ids == cold_run.token_ids


@pytest.mark.parametrize(("mode", "rows", "on_cuda", "chunked"), [
    ("auto", 100, True, True), ("auto", 12, True, True), ("auto", 11, True, False), ("auto", 2, True, False),
    ("auto", 1, True, False), ("auto", 100, False, False), ("chunked", 2, False, True),
    ("chunked", 100, False, True), ("chunked", 1, False, False), ("loop", 100, True, False),
])
def test_which_calls_take_the_chunked_form(mode, rows, on_cuda, chunked):
    """``auto``: a prompt chunk of ``CHUNKED_MIN_ROWS`` rows or more on MLX CUDA only (fewer go faster by steps);
    ``chunked``: any call of more than one row on any device; never a one-row decode step (a recorded verify call's
    rows go one by one: rows == 1)."""
    assert layers.chunked_prefill(mode, rows, on_cuda) is chunked


# -- the chunk-to-chunk state steps in exo's CUDA kernel (engine/models/gated_delta_states_cuda.py) ---------------
def _steps_row_by_row(u_free, w, k_out, g_last, s):
    """The kernel's arithmetic as MLX ops: every state row on its own, sums as elementwise products summed
    (another order than ``chunk_states_ops``' matmuls)."""
    starts = []
    for c in range(u_free.shape[1]):
        starts.append(s)
        u = u_free[:, c] - (w[:, c, :, None, :] * s[:, None, :, :]).sum(-1)  # [G, C, Dv]
        s = g_last[:, c, None, None] * s + (u[..., :, :, None] * k_out[:, c, :, None, :]).sum(1)
    return mx.stack(starts, axis=1), s


def test_the_state_kernel_s_self_check_passes_its_arithmetic_and_refuses_a_wrong_or_broken_kernel():
    """Before its first use on a head shape the kernel is compared with the ops form (``self_check``): the
    kernel's arithmetic in another summation order agrees; steps off by 1e-3 of the state, of the wrong shape, or
    that raise (a kernel that fails to build) are refused with the reason."""
    from exo.engine.models import gated_delta_states_cuda as states_cuda

    assert states_cuda.self_check(_steps_row_by_row, 32, 16) == "ok"

    def off(*args):
        before, s = _steps_row_by_row(*args)
        return before, s * (1 + 1e-3)

    def short(*args):
        before, s = _steps_row_by_row(*args)
        return before[:, 1:], s

    def broken(*args):
        raise RuntimeError("nvrtc: error")

    assert states_cuda.self_check(off, 32, 16).startswith("final state differ")
    assert states_cuda.self_check(short, 32, 16).startswith("starting states: shape")
    assert states_cuda.self_check(broken, 32, 16) == "failed: RuntimeError: nvrtc: error"


def test_the_layers_take_the_state_kernel_only_where_it_is_usable(monkeypatch, caplog):
    """``auto`` and ``chunked`` run the chunked form's state steps in the kernel where ``usable`` (on MLX CUDA, its
    head dims, its self-check passed; never on this CPU), the ops form elsewhere; ``loop`` has no chunked form; a
    refused kernel is logged once."""
    from exo.engine.models import gated_delta_states_cuda as states_cuda

    assert not states_cuda.usable(128, 128)  # the CPU: not MLX CUDA
    states_cuda.usable.cache_clear()
    monkeypatch.setattr(states_cuda, "applies", lambda dk, dv: True)  # as on MLX CUDA, with a kernel that
    monkeypatch.setattr(states_cuda, "chunk_states", lambda *a: _steps_row_by_row(*a))  # computes right
    try:
        assert layers.states_kernel("auto", 32, 16) and layers.states_kernel("chunked", 32, 16)
        assert not layers.states_kernel("loop", 32, 16)
        monkeypatch.setattr(states_cuda, "chunk_states", lambda *a: (_steps_row_by_row(*a)[0], a[4] * 2))
        with caplog.at_level("WARNING"):
            assert not layers.states_kernel("auto", 64, 16) and not layers.states_kernel("auto", 64, 16)
        assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
        assert "refused for head dims 64/16 (final state differ" in caplog.records[0].message
    finally:
        states_cuda.usable.cache_clear()


def test_the_chunked_form_through_other_state_steps_equals_the_ops_form():
    """``gated_delta_chunked(steps=...)`` (how the layers pass the kernel) gives the ops form's outputs and
    state when the steps compute the same sums in another order."""
    q, k, v, a, b, A_log, dt_bias, state = _inputs(2, 200)
    want = gated_delta_chunked(q, k, v, log_decay(A_log, a, dt_bias), mx.sigmoid(b), state)
    got = gated_delta_chunked(q, k, v, log_decay(A_log, a, dt_bias), mx.sigmoid(b), state, steps=_steps_row_by_row)
    _close(got[0], want[0])
    _close(got[1], want[1])
