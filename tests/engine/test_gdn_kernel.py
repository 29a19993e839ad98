"""exo's GatedDeltaNet step kernel (engine/kernels/cuda_gdn.py): the engine's wiring around it.

The kernel runs on MLX CUDA only (bench/gdn_check.py checks it there: a call's rows against its rows one after
another, bit for bit, and against mlx-lm's ops); with ``EXO_GDN_KERNEL=always`` the CPU runs its stand-in
(``cuda_gdn.reference``, mlx-lm's ops row by row) through the same wiring: one call per decode step and per verify
call of each layer, the states of every row recorded from its output for the rollback. These tests check that
wiring: the loader sets the layers up, decode steps and verify calls go through it, and greedy MTP (whose
rejected drafts roll the recorded states back) gives plain decoding's tokens.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import mlx.core as mx
import pytest

from exo.engine import Engine, EngineConfig, GenerationRequest, load_checkpoint
from exo.engine.kernels import cuda_gdn
from exo.engine.models import layers
from exo.engine.models.layers import GatedDeltaNet, NextGatedDeltaNet, RollbackArraysCache, use_gdn_kernel


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_decode_steps_and_verify_calls_run_the_kernel_and_mtp_stays_exact(checkpoint, monkeypatch, arch):
    path = checkpoint(arch, layout="mlx_sidecar", head="trained", dtype="bfloat16")
    plain_before = _plain(Engine(dataclasses.replace(load_checkpoint(path), eos_token_ids=frozenset())))
    monkeypatch.setenv("EXO_GDN_KERNEL", "always")
    loaded = dataclasses.replace(load_checkpoint(path), eos_token_ids=frozenset())
    assert loaded.gdn and all(v.startswith("ok") for v in loaded.gdn.values()), loaded.gdn
    gdn = [m for _, m in loaded.model.named_modules() if isinstance(m, (GatedDeltaNet, NextGatedDeltaNet))]
    assert gdn and all(m.gdn_kernel for m in gdn)
    rows: list[int] = []
    kernel_rows = layers._kernel_rows
    monkeypatch.setattr(layers, "_kernel_rows", lambda *a: rows.append(a[1].shape[1]) or kernel_rows(*a))
    engine = Engine(loaded, EngineConfig(prefill_chunk=8))
    plain = _plain(engine)
    assert plain.token_ids == plain_before.token_ids  # the reference computes what the layers compute
    assert rows and set(rows) == {1}  # every decode step of every layer
    stats = {}
    for depth in (1, 3, None):
        rows.clear()
        mtp = engine.complete(GenerationRequest(_prompt(engine), max_tokens=16, native_mtp="on", mtp_k=depth))
        assert mtp.token_ids == plain.token_ids, depth
        assert depth is None or max(rows) > 1, depth  # the verify calls' rows, one call each
        stats[depth] = mtp.stats
    # Some drafts rejected at the fixed depth 3, so states were rolled back. The adaptive run (None) is not asked:
    # its policy may measure this machine's rounds as not worth drafting and decode plainly (k=0 throughout).
    assert stats[3].accepted_tokens < stats[3].drafted_tokens


def test_a_recorded_call_keeps_each_row_s_state_and_window(checkpoint, monkeypatch):
    """A verify call of 4 rows through the kernel's wiring, committed at 0..4 rows: the cache holds what that many
    decode steps through it leave (state and conv window, bit for bit)."""
    monkeypatch.setenv("EXO_GDN_KERNEL", "always")
    loaded = load_checkpoint(checkpoint("qwen3_5", layout="mlx_sidecar", head="trained", dtype="bfloat16"))
    layer = next(m for _, m in loaded.model.named_modules() if isinstance(m, GatedDeltaNet))
    assert layer.gdn_kernel
    x = (mx.random.normal((1, 7, loaded.model.hidden_size), key=mx.random.key(1)) * 0.5).astype(mx.bfloat16)

    def primed() -> RollbackArraysCache:
        cache = RollbackArraysCache()
        layer(x[:, :3], cache=cache)  # a prefill (not the kernel's: no window yet)
        return cache

    steps = primed()
    after = [(steps[0], steps[1])]
    outs = []
    for t in range(3, 7):
        outs.append(layer(x[:, t : t + 1], cache=steps))
        after.append((steps[0], steps[1]))
    for kept in range(5):
        cache = primed()
        cache.recording = True
        out = layer(x[:, 3:], cache=cache)
        cache.recording = False
        assert mx.array_equal(out, mx.concatenate(outs, axis=1)).item()
        cache.commit(kept)
        assert mx.array_equal(cache[0], after[kept][0]).item() and mx.array_equal(cache[1], after[kept][1]).item()


def _kinds(*arrays: mx.array) -> list[str]:
    import re
    import tempfile

    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *arrays)
        return re.findall(r'label\s*=\s*"([A-Za-z_][A-Za-z0-9_]*)"', f.read())


def test_the_kernel_s_states_are_kept_as_views_not_per_row_nodes(checkpoint, monkeypatch):
    """A decode step keeps the kernel's state as a view (``states[0]`` would gather a copy, a launch on MLX CUDA);
    a recorded call builds no node per row (its state after each row is taken at the commit) and leaves the cache's
    window and state to the commit: its graph is the same size at 2 and at 4 rows."""
    monkeypatch.setenv("EXO_GDN_KERNEL", "always")
    loaded = load_checkpoint(checkpoint("qwen3_5", layout="mlx_sidecar", head="trained", dtype="bfloat16"))
    layer = next(m for _, m in loaded.model.named_modules() if isinstance(m, GatedDeltaNet))
    x = (mx.random.normal((1, 7, loaded.model.hidden_size), key=mx.random.key(2)) * 0.5).astype(mx.bfloat16)
    cache = RollbackArraysCache()
    mx.eval(layer(x[:, :3], cache=cache), cache[0], cache[1])
    before = (cache[0], cache[1])
    mx.eval(layer(x[:, 3:4], cache=cache))
    assert cache[1] is not before[1] and "Gather" not in _kinds(cache[1])  # the step's state: reshape of a slice
    counts = {}
    for rows in (2, 4):
        cache = RollbackArraysCache()
        cache[0], cache[1] = before
        cache.recording = True
        out = layer(x[:, 3 : 3 + rows], cache=cache)
        cache.recording = False
        assert cache[0] is before[0] and cache[1] is before[1]  # the commit sets them
        pending = cache.pending_arrays()
        assert len(pending) == 3  # the conv input, the state before, the states after each row (stacked)
        counts[rows] = (len(_kinds(out, *pending)), _kinds(out, *pending).count("Gather"))
        cache.commit(rows - 1)
        assert "Gather" not in _kinds(cache[1])
        # one sequence's next window: a slice of the call's conv input, nothing more (no copy)
        assert Counter(_kinds(cache[0])) - Counter(_kinds(pending[0])) == Counter({"Slice": 1})
    # (the CPU's stand-in computes each row with mlx-lm's ops: its nodes grow with the rows; the wiring's do not)
    assert counts[4][1] == counts[2][1]


def test_exo_gdn_kernel_0_keeps_the_compiled_rows(checkpoint, monkeypatch):
    loaded = load_checkpoint(checkpoint("qwen3_5", layout="mlx_sidecar", head="trained", dtype="bfloat16"))
    monkeypatch.setenv("EXO_GDN_KERNEL", "0")
    assert use_gdn_kernel(loaded.model) == {}
    monkeypatch.setenv("EXO_GDN_KERNEL", "1")  # the default: on MLX CUDA only
    assert use_gdn_kernel(loaded.model) == {}
    assert cuda_gdn.mode() == "cuda"


def test_the_check_measures_both_against_the_step_in_float32(checkpoint):
    """``check`` reports how far the kernel and mlx-lm's ops each are from the same step computed in float32
    throughout (no rounding to bfloat16 between ops): a distance between the two that their roundings alone make
    (as large as either's own error) is then told apart from an error of the kernel. Off MLX CUDA ``gdn_rows`` is
    ``reference``, so both are the same distance from it, and that distance is bfloat16's, not float32's."""
    import re

    from exo.engine.models.layers import GatedDeltaNet

    loaded = load_checkpoint(checkpoint("qwen3_5", layout="mlx_sidecar", head="trained", dtype="bfloat16"))
    layer = next(leaf for _, leaf in loaded.model.named_modules() if isinstance(leaf, GatedDeltaNet))
    passed, found = cuda_gdn.check(layer)
    assert passed, found
    kernel_y, kernel_state, ops_y, ops_state = map(float, re.search(
        r"the kernel y (\S+), state (\S+), mlx-lm's ops y (\S+), state (\S+)$", found).groups())
    assert (kernel_y, kernel_state) == (ops_y, ops_state)
    assert 1e-5 < ops_state < 2.0**-4 and 1e-5 < ops_y < 2.0**-4  # bfloat16's roundings: above float32's, small


def _prompt(engine: Engine) -> list[int]:
    return engine.loaded.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return fib")[:11]


def _plain(engine: Engine):
    return engine.complete(GenerationRequest(_prompt(engine), max_tokens=16, native_mtp="off"))


@pytest.mark.parametrize(("distances", "passes"), [
    # (y, state) from mlx-lm's ops; (y, state) of the kernel from float32 throughout; of mlx-lm's ops from it
    ((1e-3, 5e-5, 3e-3, 3e-3, 3e-3, 3e-3), True),  # near mlx-lm's ops
    # the H200's 9B layer: far from mlx-lm's ops, and closer than they are to the exact step
    ((4.31e-3, 7.51e-3, 4.26e-3, 4.67e-3, 4.95e-3, 7.48e-3), True),
    ((4.31e-3, 7.51e-3, 9e-3, 4.67e-3, 4.95e-3, 7.48e-3), False),  # its y further from exact than stock's
    ((4.31e-3, 7.51e-3, 4.26e-3, 1.2e-2, 4.95e-3, 7.48e-3), False),  # its states further
    ((5e-2, 5e-2, 4e-2, 4e-2, 4e-2, 4e-2), False),  # as far as a broken stock, beyond the cap
])
def test_the_kernel_passes_near_mlx_lm_or_no_further_than_it_from_the_exact_step(distances, passes):
    """``cuda_gdn.accepted``: within the tolerances of mlx-lm's ops, or (the two bfloat16 graphs rounding at other
    points) no further from the step in float32 throughout than mlx-lm's ops are, with ``STOCK_SLACK``'s margin and
    under ``EXACT_CAP``."""
    assert cuda_gdn.accepted(*distances) is passes


def test_the_kernels_scalars_are_made_once_per_head_size_and_dtype(checkpoint):
    """Every step of every layer passes the kernel q's and k's scales and the norms' eps: one evaluated array per
    head size and dtype, not two primitives a layer a step; its values are ``normalize_qk``'s, rounded as it
    rounds them."""
    layer = next(m for _, m in load_checkpoint(checkpoint("qwen3_5")).model.named_modules() if isinstance(m, GatedDeltaNet))
    first = cuda_gdn._scalars(layer, mx.bfloat16)
    assert cuda_gdn._scalars(layer, mx.bfloat16) is first
    inv = layer.head_k_dim**-0.5
    want = [float(mx.array(inv**2, dtype=mx.bfloat16).item()), float(mx.array(inv, dtype=mx.bfloat16).item()),
            1e-6 * inv**2]
    assert first.dtype == mx.float32 and first.tolist() == pytest.approx(want, rel=1e-6)


# -- a prompt's rows in one launch (``cuda_gdn.gdn_prompt``) ------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_prompts_run_the_prompt_kernel_and_decode_exactly_as_before(checkpoint, monkeypatch, arch):
    """With the kernels installed, every prompt chunk of more than one row goes through the prompt kernel's wiring
    (one call a layer a chunk), and greedy decoding gives the tokens it gave without any kernel; off
    ``gdn_prefill="auto"`` the chunk takes the chunked form instead."""
    path = checkpoint(arch, layout="mlx_sidecar", head="trained", dtype="bfloat16")
    before = _plain(Engine(dataclasses.replace(load_checkpoint(path), eos_token_ids=frozenset())))
    monkeypatch.setenv("EXO_GDN_KERNEL", "always")
    loaded = dataclasses.replace(load_checkpoint(path), eos_token_ids=frozenset())
    assert any(k.startswith("gdn prompt") and v.startswith("ok") for k, v in loaded.gdn.items()), loaded.gdn
    gdn = [m for _, m in loaded.model.named_modules() if isinstance(m, (GatedDeltaNet, NextGatedDeltaNet))]
    assert all(m.gdn_prompt_kernel for m in gdn)
    rows: list[int] = []
    prompt_rows = layers._prompt_rows
    monkeypatch.setattr(layers, "_prompt_rows", lambda *a: rows.append(a[1].shape[1]) or prompt_rows(*a))
    plain = _plain(Engine(loaded, EngineConfig(prefill_chunk=4)))
    assert plain.token_ids == before.token_ids
    assert rows and set(rows) == {4, 3} and len(rows) == 3 * len(gdn)  # 11 prompt tokens: chunks 4, 4, 3
    rows.clear()
    chunked = _plain(Engine(loaded, EngineConfig(prefill_chunk=4, gdn_prefill="chunked")))
    assert not rows and len(chunked.token_ids) == len(plain.token_ids)
    monkeypatch.setattr(layers, "PROMPT_KERNEL_MAX_ROWS", 3)  # a longer chunk takes the chunked form
    _plain(Engine(loaded, EngineConfig(prefill_chunk=4)))
    assert rows and set(rows) == {3} and len(rows) == len(gdn)


def _layer_and_rows(checkpoint, monkeypatch, n: int, seed: int):
    monkeypatch.setenv("EXO_GDN_KERNEL", "always")
    loaded = load_checkpoint(checkpoint("qwen3_5", layout="mlx_sidecar", head="trained", dtype="bfloat16"))
    layer = next(m for _, m in loaded.model.named_modules() if isinstance(m, GatedDeltaNet))
    assert layer.gdn_prompt_kernel
    x = (mx.random.normal((1, n, loaded.model.hidden_size), key=mx.random.key(seed)) * 0.5).astype(mx.bfloat16)
    return layer, x


def _stepped(layer, x: mx.array, first: int) -> tuple[mx.array, RollbackArraysCache]:
    """``first`` rows as one chunk, then the rest as decode steps of one row (the step kernel's wiring)."""
    cache = RollbackArraysCache()
    outs = [layer(x[:, :first], cache=cache)]
    outs += [layer(x[:, t : t + 1], cache=cache) for t in range(first, x.shape[1])]
    return mx.concatenate(outs, axis=1), cache


@pytest.mark.parametrize("lengths", [(1, 64), (2, 7, 2, 9), (20, 3), (3, 40)])
def test_a_prompt_in_chunks_equals_its_rows_as_decode_steps(checkpoint, monkeypatch, lengths):
    """Chunks of the given lengths through the prompt kernel's wiring leave the outputs, conv window and state that
    the same rows as decode steps leave, bit for bit: each chunk starts from the last one's window (across chunks
    shorter than the window too) and state."""
    layer, x = _layer_and_rows(checkpoint, monkeypatch, sum(lengths), 3)
    cache, outs, lo = RollbackArraysCache(), [], 0
    for n in lengths:
        outs.append(layer(x[:, lo : lo + n], cache=cache))
        lo += n
    want, steps = _stepped(layer, x, 1)
    assert mx.array_equal(mx.concatenate(outs, axis=1), want).item()
    assert mx.array_equal(cache[0], steps[0]).item() and mx.array_equal(cache[1], steps[1]).item()


def test_a_prompt_chunk_keeps_its_snapshots_at_the_armed_edges(checkpoint, monkeypatch):
    """A chunk armed at offsets inside it (the prefix cache's snapshot edges) keeps, at each, the window and state
    that the rows before it leave as decode steps; a chunk restored from such a snapshot continues as the whole."""
    layer, x = _layer_and_rows(checkpoint, monkeypatch, 30, 4)
    cache = RollbackArraysCache()
    cache.arm((2, 17))
    out = layer(x, cache=cache)
    assert sorted(cache.captured) == [2, 17]
    for edge in (2, 17):
        _, steps = _stepped(layer, x[:, :edge], 1)
        window, state = cache.captured[edge]
        assert mx.array_equal(window, steps[0]).item() and mx.array_equal(state, steps[1]).item()
        restored = RollbackArraysCache()
        restored[0], restored[1] = window, state
        rest = layer(x[:, edge:], cache=restored)
        assert mx.array_equal(rest, out[:, edge:]).item() and mx.array_equal(restored[1], cache[1]).item()


def test_the_prompt_kernel_s_check_refuses_rows_that_are_not_their_steps(checkpoint, monkeypatch):
    """``check_prompt`` passes the stand-in (its rows are the steps') and refuses a prompt kernel whose rows differ
    from the steps in the last bit, or whose last state does; the loader then leaves prompts to the chunked form."""
    layer, _ = _layer_and_rows(checkpoint, monkeypatch, 1, 5)
    assert cuda_gdn.check_prompt(layer)[0]
    good = cuda_gdn.gdn_prompt

    def off_by(y_bump: float, state_bump: float):
        def wrong(*args):
            y, state = good(*args)
            return y * mx.array(1 + y_bump, dtype=y.dtype), state * (1 + state_bump)
        return wrong

    for bumps in ((2.0**-6, 0.0), (0.0, 1e-6)):
        monkeypatch.setattr(cuda_gdn, "gdn_prompt", off_by(*bumps))
        passed, found = cuda_gdn.check_prompt(layer)
        assert not passed and "differ" in found, bumps
    loaded = load_checkpoint(checkpoint("qwen3_5", layout="mlx_sidecar", head="trained", dtype="bfloat16"))
    gdn = [m for _, m in loaded.model.named_modules() if isinstance(m, GatedDeltaNet)]
    assert gdn and all(m.gdn_kernel and not m.gdn_prompt_kernel for m in gdn)
    assert any(k.startswith("gdn prompt") and v.startswith("not used") for k, v in loaded.gdn.items())
