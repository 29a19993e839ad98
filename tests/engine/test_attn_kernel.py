"""exo's decode-attention kernel (engine/kernels/cuda_attn.py): the engine's wiring around it.

The kernel runs on MLX CUDA only (its load-time check compares a call's rows with the calls of one row, bit for
bit, and with attention in float32); with ``EXO_ATTN_KERNEL=always`` the CPU runs its stand-in (``cuda_attn.reference``:
mlx-lm's attention a row at a time over the keys up to itself) through the same wiring: the cache's buffers read in
place, one call per decode step and per verify call of each attention layer. These tests check that wiring: the
loader sets the layers up, decode steps and verify calls go through it, greedy MTP gives plain decoding's tokens.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from exo.engine import Engine, EngineConfig, GenerationRequest, load_checkpoint
from exo.engine.kernels import cuda_attn
from exo.engine.models import layers
from exo.engine.models.layers import Attention, use_attn_kernel


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_decode_steps_and_verify_calls_run_the_kernel_and_mtp_stays_exact(checkpoint, monkeypatch, arch):
    path = checkpoint(arch, layout="mlx_sidecar", head="trained", dtype="bfloat16")
    monkeypatch.setenv("EXO_ATTN_KERNEL", "always")
    loaded = dataclasses.replace(load_checkpoint(path), eos_token_ids=frozenset())
    assert loaded.attn and all(v.startswith("ok") for v in loaded.attn.values()), loaded.attn
    attention = [m for _, m in loaded.model.named_modules() if isinstance(m, Attention)]
    assert attention and all(m.attn_kernel for m in attention)
    # the MTP head's layer too: its drafts' attention through the kernel, its projections fused as the backbone's
    head_attention = loaded.head.layers[0].self_attn
    assert isinstance(head_attention, Attention) and head_attention.attn_kernel
    assert head_attention.fused_inputs is not None and "q_proj" not in head_attention
    rows: list[int] = []
    attend = cuda_attn.attend_rows
    monkeypatch.setattr(cuda_attn, "attend_rows", lambda q, *a: rows.append(q.shape[2]) or attend(q, *a))
    engine = Engine(loaded, EngineConfig(prefill_chunk=8))
    prompt = engine.loaded.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return fib")[:11]
    plain = engine.complete(GenerationRequest(prompt, max_tokens=16, native_mtp="off"))
    assert rows and 1 in rows  # every decode step of every attention layer (and a short prompt chunk)
    head_calls: list[int] = []  # per call of the head: the kernel's calls it made (its layer op by op or compiled)
    head = loaded.head
    head_call = type(head).__call__

    def counted(self, *a, **k):
        before = len(rows)
        out = head_call(self, *a, **k)
        if self is head:
            head_calls.append(len(rows) - before)
        return out

    monkeypatch.setattr(type(head), "__call__", counted)
    for depth in (1, 3):
        rows.clear()
        head_calls.clear()
        mtp = engine.complete(GenerationRequest(prompt, max_tokens=16, native_mtp="on", mtp_k=depth))
        assert mtp.token_ids == plain.token_ids, depth
        assert depth + 1 in rows, depth  # the verify calls' rows, one call each
        assert head_calls and set(head_calls) == {1}, depth  # each of the head's drafting calls through the kernel


def test_a_call_reads_the_cache_in_place_and_its_rows_equal_the_steps(checkpoint, monkeypatch):
    """A 4-row call through the wiring gives each row what a decode step at its position gives (bit for bit), and
    reads the cache's buffers: the keys past its last row are never seen."""
    monkeypatch.setenv("EXO_ATTN_KERNEL", "always")
    loaded = load_checkpoint(checkpoint("qwen3_5", layout="mlx_sidecar", head="trained", dtype="bfloat16"))
    layer = next(m for _, m in loaded.model.named_modules() if isinstance(m, Attention))
    assert layer.attn_kernel
    x = (mx.random.normal((1, 9, loaded.model.hidden_size), key=mx.random.key(2)) * 0.5).astype(mx.bfloat16)

    def primed() -> KVCache:
        cache = KVCache()
        layer(x[:, :5], mask="causal", cache=cache)
        return cache

    steps = primed()
    outs = [layer(x[:, t : t + 1], cache=steps) for t in range(5, 9)]
    cache = primed()
    together = layer(x[:, 5:], mask="causal", cache=cache)
    assert mx.array_equal(together, mx.concatenate(outs, axis=1)).item()
    assert cache.keys.shape[2] > cache.offset  # a buffer with room past the keys: read up to the offset only


def test_the_check_compares_rows_with_steps_and_float32(checkpoint, monkeypatch):
    """Off MLX CUDA the kernel is its reference, so the check passes; it reports the distance from attention in
    float32 throughout beside mlx-lm's."""
    loaded = load_checkpoint(checkpoint("qwen3_5", layout="mlx_sidecar", head="trained", dtype="bfloat16"))
    layer = next(m for _, m in loaded.model.named_modules() if isinstance(m, Attention))
    passed, found = cuda_attn.check(layer)
    assert passed and "from float32 throughout" in found and "mlx-lm's attention" in found, found


def test_exo_attn_kernel_is_on_by_default_on_mlx_cuda_only(checkpoint, monkeypatch):
    """On by default on MLX CUDA (measured there), nothing on other devices; ``0`` turns it off, ``always`` runs
    its reference anywhere."""
    loaded = load_checkpoint(checkpoint("qwen3_5", layout="mlx_sidecar", head="trained", dtype="bfloat16"))
    monkeypatch.delenv("EXO_ATTN_KERNEL", raising=False)
    assert cuda_attn.mode() == "cuda" and use_attn_kernel(loaded.model) == {}  # (this CPU)
    monkeypatch.setenv("EXO_ATTN_KERNEL", "0")
    assert cuda_attn.mode() == "off" and use_attn_kernel(loaded.model) == {}
    monkeypatch.setenv("EXO_ATTN_KERNEL", "1")
    assert cuda_attn.mode() == "cuda" and use_attn_kernel(loaded.model) == {}  # (this CPU)
    monkeypatch.setenv("EXO_ATTN_KERNEL", "always")
    assert use_attn_kernel(loaded.model)
    assert layers.ATTN_KERNEL_ON


def test_batch_invariant_steps_attend_each_sequence_through_the_kernel(checkpoint, monkeypatch):
    """EXO_BATCH_INVARIANT's batched steps attend each sequence as its solo step does: through the kernel where
    the solo step takes it (on an H200 the invariant mode's B = 8 differed from solo at its first tokens while its
    sequences attended through MLX's attention and their solo steps through the kernel), over the sequence's keys
    from its position 0 (the same chunks)."""
    monkeypatch.setenv("EXO_ATTN_KERNEL", "always")
    loaded = dataclasses.replace(load_checkpoint(checkpoint("qwen3_5", layout="mlx_sidecar", head="trained",
                                                            dtype="bfloat16")), eos_token_ids=frozenset())
    engine = Engine(loaded, EngineConfig(prefill_chunk=8, batch_invariant=True))
    calls: list[str] = []
    attend = cuda_attn.attend_rows

    def counted(q, *a):
        import sys

        calls.append(sys._getframe(1).f_code.co_name)  # noqa: SLF001
        return attend(q, *a)

    monkeypatch.setattr(cuda_attn, "attend_rows", counted)
    from tests.engine.test_batch import _request, _run_batch, _solo

    requests = [_request(engine, i, max_tokens=10, native_mtp="off") for i in range(3)]
    solo = [_solo(engine, request).token_ids for request in requests]
    calls.clear()
    got = _run_batch(engine, requests, join_at=[0, 0, 2])
    assert [g[0] for g in got.values()] == solo
    assert "_per_sequence" in calls  # the batched steps' attention, sequence by sequence, through the kernel
