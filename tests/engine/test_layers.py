"""Rollback of GatedDeltaNet state and route-locked MoE verification, on real mlx-lm layers."""

import mlx.core as mx
import pytest
from mlx_lm.models import qwen3_5, qwen3_next

from exo.engine.models.layers import (
    SORT_MIN_PAIRS,
    GatedDeltaNet,
    NextGatedDeltaNet,
    RollbackArraysCache,
    SparseMoeBlock,
    check_expert_sort,
    experts_unsorted,
)

DIMS = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    vocab_size=128,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
)


def _qwen35_args():
    return qwen3_5.TextModelArgs(model_type="qwen3_5_text", **DIMS)


def _next_args():
    return qwen3_next.ModelArgs(
        model_type="qwen3_next",
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        max_position_embeddings=4096,
        **DIMS,
    )


def _prefilled(layer, x):
    cache = RollbackArraysCache()
    layer(x, cache=cache)
    mx.eval(cache.state)
    return cache


@pytest.mark.parametrize("make", [lambda: GatedDeltaNet(_qwen35_args()), lambda: NextGatedDeltaNet(_next_args())])
def test_recorded_verify_commits_exactly_the_sequential_state(make):
    mx.random.seed(0)
    layer = make()
    context = mx.random.normal((1, 5, 64))
    rows = mx.random.normal((1, 4, 64))
    # Sequential decode, one row at a time: outputs and the state after each row.
    sequential = _prefilled(layer, context)
    seq_out, seq_states = [], []
    for t in range(4):
        seq_out.append(layer(rows[:, t : t + 1], cache=sequential))
        seq_states.append((sequential[0], sequential[1]))
    mx.eval(seq_out, seq_states)
    start = _prefilled(layer, context)
    for keep in range(0, 5):
        cache = _prefilled(layer, context)
        cache.recording = True
        out = layer(rows, cache=cache)
        cache.recording = False
        assert mx.allclose(out, mx.concatenate(seq_out, axis=1), atol=1e-5)
        cache.commit(keep)
        conv, ssm = seq_states[keep - 1] if keep else (start[0], start[1])
        assert mx.array_equal(cache[0], conv)
        assert mx.allclose(cache[1], ssm, atol=1e-6)
        # Decoding goes on from the committed state exactly as it does after `keep` sequential rows.
        nxt = mx.random.normal((1, 1, 64), key=mx.random.key(keep))
        replay = _prefilled(layer, context)
        for t in range(keep):
            layer(rows[:, t : t + 1], cache=replay)
        assert mx.allclose(layer(nxt, cache=cache), layer(nxt, cache=replay), atol=1e-5)


def test_commit_without_recording_is_an_error():
    cache = RollbackArraysCache()
    with pytest.raises(RuntimeError):
        cache.commit(1)


def _near_tie_moe():
    mx.random.seed(1)
    block = SparseMoeBlock(_qwen35_args())
    mx.eval(block.parameters())
    return block


@pytest.mark.parametrize("mode", ["route_locked", "safe"])
def test_locked_routing_equals_row_by_row_decode(mode):
    block = _near_tie_moe()
    x = mx.random.normal((1, 4, 64), key=mx.random.key(5))
    rows = mx.concatenate([block(x[:, i : i + 1]) for i in range(4)], axis=1)
    block.verify_mode = mode
    locked = block(x)
    block.verify_mode = None
    assert mx.allclose(locked, rows, atol=1e-5)


def test_route_locking_uses_the_row_router():
    # The routes a locked verify takes are the M = 1 router's, computed row by row.
    block = _near_tie_moe()
    x = mx.random.normal((1, 3, 64), key=mx.random.key(9))
    block.verify_mode = "route_locked"
    inds, _ = block._route(x)
    block.verify_mode = None
    for i in range(3):
        row_inds, _ = block._route(x[:, i : i + 1])
        assert sorted(inds[0, i].tolist()) == sorted(row_inds[0, 0].tolist())


def test_batched_routing_can_diverge_and_route_locking_restores_it():
    """A router whose multi-row matmul rounds differently (as GPU gemm vs gemv do) flips a near tie."""
    import mlx.nn as nn

    class RoundingGate(nn.Module):
        # Expert 2 always first; expert 1 beats expert 0 for the second slot by 1e-3 at M = 1, while
        # the "batched kernel" (M > 1) rounds expert 0 up by 2e-3 and flips the tie.
        def __call__(self, x):
            logits = mx.broadcast_to(mx.array([0.0, 1e-3, 5.0] + [-5.0] * 5), (*x.shape[:-1], 8))
            if x.shape[1] > 1:
                logits = logits + mx.array([2e-3] + [0.0] * 7)
            return logits

    block = _near_tie_moe()
    block.gate = RoundingGate()
    x = mx.random.normal((1, 3, 64), key=mx.random.key(2))
    per_row = mx.concatenate([block(x[:, i : i + 1]) for i in range(3)], axis=1)
    block.verify_mode = "batched"
    batched = block(x)
    block.verify_mode = "route_locked"
    locked = block(x)
    block.verify_mode = None
    assert not mx.allclose(batched, per_row, atol=1e-4), "the batched router should have flipped the tie"
    assert mx.allclose(locked, per_row, atol=1e-5)


def test_unsorted_experts_compute_each_row_as_alone_and_what_the_sorted_path_computes():
    """From SORT_MIN_PAIRS (row, expert) pairs on, mlx-lm sorts the rows by expert; the unsorted path (a device
    whose sorted kernels are wrong takes it) gives every row exactly what the row alone gives."""
    block = _near_tie_moe()
    rows = SORT_MIN_PAIRS // block.top_k + 8
    x = mx.random.normal((rows, 1, 64), key=mx.random.key(11))
    inds, _ = block._route(x)
    assert inds.size >= SORT_MIN_PAIRS  # the sorted path is the one mlx-lm takes here
    unsorted = experts_unsorted(block.switch_mlp, x, inds)
    alone = mx.concatenate([block.switch_mlp(x[i : i + 1], inds[i : i + 1]) for i in range(rows)], axis=0)
    assert mx.array_equal(unsorted, alone)
    assert mx.allclose(unsorted, block.switch_mlp(x, inds), atol=1e-5)
    sorted_block = block(x)
    block.sort_experts = False
    assert mx.array_equal(block(x), mx.concatenate([block(x[i : i + 1]) for i in range(rows)], axis=0))
    assert mx.allclose(block(x), sorted_block, atol=1e-5)


def test_a_device_whose_sorted_expert_kernels_are_wrong_decodes_unsorted():
    """MLX 0.32.4 CUDA returns wrong sorted gather_mm products (bench/results/h100-mlx-cuda-moe-sort.txt). The
    check keeps this CPU's (right) sorted path, and on a device simulated to be wrong there (sorted calls
    drop one expert's contribution, as a wrong kernel could) sends every block unsorted."""
    blocks = [_near_tie_moe() for _ in range(2)]
    assert check_expert_sort(blocks) < 1e-3 and all(block.sort_experts for block in blocks)

    switch = blocks[0].switch_mlp
    right = type(switch.down_proj).__call__

    class WrongWhenSorted(type(switch.down_proj)):
        def __call__(self, x, indices, sorted_indices=False):
            out = right(self, x, indices, sorted_indices=sorted_indices)
            return mx.where((indices == 0)[..., None, None], 0.0, out) if sorted_indices else out

    for block in blocks:
        block.switch_mlp.down_proj.__class__ = WrongWhenSorted
    x = mx.random.normal((SORT_MIN_PAIRS, 1, 64), key=mx.random.key(12))
    assert not mx.allclose(blocks[1](x), mx.concatenate([blocks[1](x[i : i + 1]) for i in range(SORT_MIN_PAIRS)]))
    assert check_expert_sort(blocks) > 0.05
    assert not any(block.sort_experts for block in blocks)
    assert mx.array_equal(blocks[1](x), mx.concatenate([blocks[1](x[i : i + 1]) for i in range(SORT_MIN_PAIRS)]))


def test_row_by_row_attention_equals_a_decode_step_per_row():
    """A verify call attending row by row computes, for each row, what a one-row decode step computes."""
    from mlx_lm.models.cache import KVCache

    from exo.engine.models.layers import Attention

    mx.random.seed(3)
    args = _qwen35_args()
    layer = Attention(args)
    mx.eval(layer.parameters())
    prefix = mx.random.normal((1, 6, args.hidden_size))
    rows = mx.random.normal((1, 4, args.hidden_size))
    decode_cache, verify_cache = KVCache(), KVCache()
    for c in (decode_cache, verify_cache):
        layer(prefix, mask="causal", cache=c)
    stepwise = mx.concatenate([layer(rows[:, t : t + 1], cache=decode_cache) for t in range(4)], axis=1)
    layer.per_row = True
    verified = layer(rows, mask="causal", cache=verify_cache)
    layer.per_row = False
    batched_cache = KVCache()
    layer(prefix, mask="causal", cache=batched_cache)
    batched = layer(rows, mask="causal", cache=batched_cache)
    mx.eval(stepwise, verified, batched)
    assert mx.array_equal(verified, stepwise)
    assert mx.allclose(batched, stepwise, atol=1e-5)  # and on this CPU the batched call too
    assert mx.array_equal(verify_cache.keys[..., :10, :], decode_cache.keys[..., :10, :])


@pytest.mark.parametrize("shape", [(1, 4, 64), (2, 3, 128), (5, 32)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_vector_matmul_is_the_one_row_products(shape, dtype):
    """Every row of ``vector_matmul`` is what a one-row call computes (bit for bit here, where a one-row call
    and a block of rows agree too), in one call, in the input's shape."""
    from exo.engine.models.layers import vector_matmul

    key = mx.random.key(3)
    x = mx.random.normal(shape, key=key).astype(dtype)
    weight = mx.random.normal((48, shape[-1]), key=mx.random.split(key)[0]).astype(dtype)
    out = vector_matmul(x, weight)
    rows = x.reshape(-1, shape[-1])
    one_by_one = mx.concatenate([rows[i : i + 1] @ weight.T for i in range(rows.shape[0])]).reshape(*shape[:-1], 48)
    assert out.shape == (*shape[:-1], 48) and out.dtype == dtype
    assert mx.array_equal(out, one_by_one).item()


@pytest.mark.parametrize("make", [lambda: GatedDeltaNet(_qwen35_args()), lambda: NextGatedDeltaNet(_next_args())])
def test_a_batch_commits_each_sequence_at_its_own_row(make):
    """A batched verify call records every row's state for every sequence; committing a count per sequence
    leaves each one exactly as committing that count alone would (and as a one-count commit does)."""
    mx.random.seed(4)
    layer = make()
    contexts = [mx.random.normal((1, 5, 64)) for _ in range(3)]
    rows = mx.random.normal((3, 4, 64))
    keep = [0, 2, 4]
    batch = RollbackArraysCache()
    singles = [_prefilled(layer, c) for c in contexts]
    batch.cache = [mx.concatenate([s[i] for s in singles]) for i in range(2)]
    batch.recording = True
    layer(rows, cache=batch)
    batch.recording = False
    batch.commit(keep)
    for b, (context, kept) in enumerate(zip(contexts, keep, strict=True)):
        alone = _prefilled(layer, context)
        alone.recording = True
        layer(rows[b : b + 1], cache=alone)
        alone.recording = False
        alone.commit(kept)
        assert mx.array_equal(batch[0][b : b + 1], alone[0]) and mx.array_equal(batch[1][b : b + 1], alone[1])
    with pytest.raises(ValueError):
        batch.recording = True
        layer(rows, cache=batch)
        batch.commit([1, 5, 0])


def _attention_over_a_padded_batch(seed, prefix_lengths, rows_per_sequence):
    """An attention layer, new rows [B, rows, H], each sequence's prefilled solo KVCache and the left-padded
    BatchKVCache merged from them (mlx-lm's)."""
    from mlx_lm.models.cache import BatchKVCache, KVCache

    from exo.engine.models.layers import Attention

    mx.random.seed(seed)
    args = _qwen35_args()
    layer = Attention(args)
    mx.eval(layer.parameters())
    singles = []
    for n in prefix_lengths:
        cache = KVCache()
        layer(mx.random.normal((1, n, args.hidden_size)), mask="causal", cache=cache)
        singles.append(cache)
    rows = mx.random.normal((len(prefix_lengths), rows_per_sequence, args.hidden_size))
    return layer, rows, singles, BatchKVCache.merge(singles)


def test_row_by_row_attention_in_a_batch_masks_the_left_padding():
    """In a batch (mlx-lm's left-padded BatchKVCache), a verify call attending row by row keeps the batch's
    mask: each sequence's rows equal its own decode steps, not attending the padding before it."""
    from mlx_lm.models.base import create_attention_mask

    layer, rows, singles, batch = _attention_over_a_padded_batch(6, (6, 2), 3)
    layer.per_row = True
    verified = layer(rows, mask=create_attention_mask(rows, batch), cache=batch)
    layer.per_row = False
    for b, cache in enumerate(singles):
        stepwise = mx.concatenate([layer(rows[b : b + 1, t : t + 1], cache=cache) for t in range(3)], axis=1)
        assert mx.allclose(verified[b : b + 1], stepwise, atol=1e-5), b


@pytest.mark.parametrize(("rows_per_sequence", "per_row"), [(1, False), (3, True), (3, False)])
def test_per_sequence_attention_is_each_sequence_alone(rows_per_sequence, per_row):
    """A batch-invariant step (``per_sequence``): each sequence of a left-padded batch gets bit for bit what its
    solo call computes: a decode step, verify rows one at a time, or a causal block of rows."""
    layer, rows, singles, batch = _attention_over_a_padded_batch(7, (6, 2, 4), rows_per_sequence)
    layer.per_sequence, layer.per_row = True, per_row
    batched = layer(rows, cache=batch)
    layer.per_sequence = False
    for b, cache in enumerate(singles):
        if per_row or rows_per_sequence == 1:
            alone = mx.concatenate([layer(rows[b : b + 1, t : t + 1], cache=cache) for t in range(rows_per_sequence)],
                                   axis=1)
        else:
            layer.per_row = False
            alone = layer(rows[b : b + 1], mask="causal", cache=cache)
        assert mx.array_equal(batched[b : b + 1], alone), b
    layer.per_row = False
    assert batch.offset.tolist() == [n + rows_per_sequence for n in (6, 2, 4)]


@pytest.mark.parametrize("shape", [(1, 1, 256), (8, 1, 256), (1, 37, 128), (3, 4, 64)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_norms_fused_on_the_cpu_equal_mlx_fast_bit_for_bit(shape, dtype):
    """MLX's CPU backend has no RMSNorm kernel; exo runs its norms through mx.compile there (fewer ops a
    step). The fused norm, gated norm and GatedDeltaNet q/k norms are mlx's and mlx-lm's values exactly, at
    decode, verify, batch and prefill shapes."""
    from mlx_lm.models.activations import precise_swiglu
    from mlx_lm.models.gated_delta import normalize_qk

    from exo.engine.models.layers import _gated_rms_norm, fused_normalize_qk, rms_norm

    assert mx.default_device() == mx.cpu
    keys = mx.random.split(mx.random.key(7), 4)
    x = (3 * mx.random.normal(shape, key=keys[0])).astype(dtype)
    gate = mx.random.normal(shape, key=keys[1]).astype(dtype)
    weight = (1 + 0.1 * mx.random.normal(shape[-1:], key=keys[2])).astype(dtype)
    assert mx.array_equal(rms_norm(x, weight, 1e-6), mx.fast.rms_norm(x, weight, 1e-6)).item()
    gated = precise_swiglu(x, gate, mx.fast.rms_norm(x, weight, 1e-6))
    assert mx.array_equal(_gated_rms_norm(x, gate, weight, 1e-6), gated).item()
    heads = x.reshape(*shape[:-1], 2, shape[-1] // 2)
    q, k = fused_normalize_qk(heads, heads * 0.5, 0.125, 1e-6)
    q_ref, k_ref = normalize_qk(heads, heads * 0.5, inv_scale=0.125, eps=1e-6)
    assert mx.array_equal(q, q_ref).item() and mx.array_equal(k, k_ref).item()


def test_a_model_loaded_on_the_cpu_runs_fused_norms_with_the_same_logits(checkpoint):
    """``cpu_compatible`` gives the backbone's and the head's RMSNorms (plain and gated) their fused class;
    the model's logits are those of the unfused model, bit for bit."""
    import mlx.nn as nn

    from exo.engine import load_checkpoint
    from exo.engine.models.layers import FusedRMSNorm, FusedRMSNormGated

    loaded = load_checkpoint(checkpoint("qwen3_5", head="trained", dtype="bfloat16"))
    model, head = loaded.model, loaded.head
    norms = [m for _, m in model.named_modules() if isinstance(m, nn.RMSNorm | qwen3_next.Qwen3NextRMSNormGated)]
    assert norms and all(type(m) in (FusedRMSNorm, FusedRMSNormGated) for m in norms)
    assert any(type(m) is FusedRMSNormGated for m in norms)
    assert head is not None and any(type(m) is FusedRMSNorm for _, m in head.named_modules())
    tokens = mx.array([[5, 9, 2, 7, 1, 3]])
    fused = model.logits(model.hidden(tokens, model.make_cache()))
    for m in norms:
        m.__class__ = nn.RMSNorm if type(m) is FusedRMSNorm else qwen3_next.Qwen3NextRMSNormGated
    try:
        plain = model.logits(model.hidden(tokens, model.make_cache()))
    finally:
        for m in norms:
            m.__class__ = FusedRMSNorm if type(m) is nn.RMSNorm else FusedRMSNormGated
    assert mx.array_equal(fused, plain).item()


@pytest.mark.parametrize("mode", ["auto", "chunked"])
@pytest.mark.parametrize("make", [lambda: GatedDeltaNet(_qwen35_args()), lambda: NextGatedDeltaNet(_next_args())])
def test_an_armed_prompt_chunk_keeps_its_state_at_each_offset_as_a_chunk_cut_there(make, mode):
    """A prompt chunk armed at offsets (``RollbackArraysCache.arm``: a prefix cache's snapshot edges inside it)
    keeps (conv window, state) after that many rows: what a chunk cut there ends with, bit for bit, and its
    outputs and final state are the cut chunks' (the recurrence stops at each offset; the rest is row by row).
    Each call captures once: the next call is not armed."""
    mx.random.seed(1)
    layer = make()
    layer.gdn_prefill = mode  # chunked: the form's C-row blocks restart at each offset, as in chunks cut there
    context, rows = mx.random.normal((1, 5, 64)), mx.random.normal((1, 40, 64))
    armed = _prefilled(layer, context)
    armed.arm([7, 30])
    out = layer(rows, cache=armed)
    cut = _prefilled(layer, context)
    pieces, states = [], {}
    for lo, hi in ((0, 7), (7, 30), (30, 40)):
        pieces.append(layer(rows[:, lo:hi], cache=cut))
        states[hi] = (cut[0], cut[1])
    mx.eval(out, armed.state, armed.captured, pieces, states)
    assert sorted(armed.captured) == [7, 30] and armed.capture_at == ()
    for offset in (7, 30):
        assert mx.array_equal(armed.captured[offset][0], states[offset][0]).item()
        assert mx.array_equal(armed.captured[offset][1], states[offset][1]).item()
    assert mx.array_equal(out, mx.concatenate(pieces, axis=1)).item()
    assert mx.array_equal(armed[1], cut[1]).item() and mx.array_equal(armed[0], cut[0]).item()
    again = layer(rows[:, :9], cache=armed)  # not armed: nothing captured
    mx.eval(again)
    assert sorted(armed.captured) == [7, 30]


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("hk,hv", [(16, 32), (8, 8)])
def test_one_row_delta_is_mlx_lm_s_step_bit_for_bit_in_fewer_nodes(dtype, hk, hv):
    """``one_row_delta`` (the compiled decode / verify row's recurrence on MLX CUDA) gives mlx-lm's
    ``gated_delta_update`` output and state bit for bit, alone and compiled, with fewer graph nodes (each one a
    few microseconds of a host-bound decode step there)."""
    import re
    import tempfile

    from mlx_lm.models.gated_delta import gated_delta_update

    from exo.engine.models.layers import one_row_delta

    def nodes(*outs: mx.array) -> int:
        with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
            mx.export_to_dot(f.name, *outs)
            return len(re.findall(r'label\s*=\s*"[A-Za-z]', f.read()))

    ks = mx.random.split(mx.random.key(7), 8)
    B, dk, dv = 2, 64, 32
    q = mx.random.normal((B, 1, hk, dk), key=ks[0]).astype(dtype)
    k = (mx.random.normal((B, 1, hk, dk), key=ks[1]) * 0.2).astype(dtype)
    v = mx.random.normal((B, 1, hv, dv), key=ks[2]).astype(dtype)
    a, b = (mx.random.normal((B, 1, hv), key=key).astype(dtype) for key in ks[3:5])
    A_log, dt_bias = mx.random.normal((hv,), key=ks[5]), mx.random.normal((hv,), key=ks[6]).astype(dtype)
    state = mx.random.normal((B, hv, dv, dk), key=ks[7])
    args = (q, k, v, a, b, A_log, dt_bias, state)
    mx.eval(*args)
    want = gated_delta_update(*args, None)
    for got in (one_row_delta(*args), mx.compile(one_row_delta)(*args)):
        assert all(g.dtype == w.dtype and g.shape == w.shape and mx.array_equal(g, w).item()
                   for g, w in zip(got, want, strict=True))
    stock = mx.compile(lambda *x: gated_delta_update(*x, None))(*args)
    assert nodes(*mx.compile(one_row_delta)(*args)) < nodes(*stock)


@pytest.mark.parametrize("make", [lambda: GatedDeltaNet(_qwen35_args()), lambda: NextGatedDeltaNet(_next_args())])
def test_a_batch_s_one_row_recurrence_is_mlx_lm_s_bit_for_bit(make):
    """Where mlx-lm runs its ops (not Metal, no CPU kernel on the layer), a call of one row per sequence (a batch's
    decode step) goes through ``one_row_delta``: mlx-lm's values bit for bit, with or without a state; a masked
    call keeps mlx-lm's path."""
    from mlx_lm.models.gated_delta import gated_delta_update

    from exo.engine.models import layers

    layer = make()
    layer.eval()  # (as the loader leaves a model)
    assert getattr(layer, "cpu_gated_delta", None) is None
    hk, hv, dk, dv = layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim
    ks = mx.random.split(mx.random.key(11), 6)
    B = 3
    q = mx.random.normal((B, 1, hk, dk), key=ks[0]).astype(mx.bfloat16)
    k = (mx.random.normal((B, 1, hk, dk), key=ks[1]) * 0.2).astype(mx.bfloat16)
    v = mx.random.normal((B, 1, hv, dv), key=ks[2]).astype(mx.bfloat16)
    a, b = (mx.random.normal((B, 1, hv), key=key).astype(mx.bfloat16) for key in ks[3:5])
    state = mx.random.normal((B, hv, dv, dk), key=ks[5])
    calls = []
    real = layers.one_row_delta
    try:
        layers.one_row_delta = lambda *x: calls.append(1) or real(*x)
        for s in (state, None):
            got = layers._recurrence(layer, q, k, v, a, b, s, None)
            want = gated_delta_update(q, k, v, a, b, layer.A_log, layer.dt_bias, s, None)
            assert all(mx.array_equal(g, w).item() and g.dtype == w.dtype for g, w in zip(got, want, strict=True))
        assert len(calls) == 2
        mask = mx.array([[True], [False], [True]])
        layers._recurrence(layer, q, k, v, a, b, state, mask)
        assert len(calls) == 2  # a masked call: mlx-lm's path
    finally:
        layers.one_row_delta = real
