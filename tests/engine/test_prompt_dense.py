"""A prompt chunk's quantized products on dequantized weights (engine/models/prompt_dense.py).

The point on MLX CUDA is speed (cuBLAS on bfloat16 weights instead of MLX's quantized tiles: bench/prefill_linears.py
and bench/moe_experts.py measure it there). What these tests hold on the CPU (``EXO_PROMPT_DENSE=on:ROWS``): the
setting, a layer that runs dense from its row count on and exactly as before below it, MoE experts whose dense
path agrees with the quantized one (and a check that refuses one that does not), and a model whose prompts run
dense while its decode steps and verify calls do not: greedy native MTP still gives plain decoding's tokens and a
batch gives each member its solo tokens.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn
import pytest

from exo.engine import Engine, EngineConfig, GenerationRequest, load_checkpoint
from exo.engine.models import prompt_dense
from exo.engine.models.layers import SparseMoeBlock, experts_unsorted
from exo.engine.models.prompt_dense import (
    check_experts,
    dense_weight,
    experts_dense,
    make_dense_rows,
    setting,
    use_prompt_dense,
)
from tests.engine.quantized import quantized_linear
from tests.engine.test_batch import _request, _run_batch


@pytest.mark.parametrize(("value", "want"), [(None, ("cuda", 512)), ("auto", ("cuda", 512)), ("off", ("off", 0)),
                                             ("0", ("off", 0)), ("on", ("always", 512)), (" ON:16 ", ("always", 16))])
def test_the_setting(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv("EXO_PROMPT_DENSE", raising=False)
    else:
        monkeypatch.setenv("EXO_PROMPT_DENSE", value)
    assert setting() == want


@pytest.mark.parametrize("value", ["yes", "on:0", "on:x", "always:8"])
def test_a_bad_setting_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("EXO_PROMPT_DENSE", value)
    with pytest.raises(ValueError, match="EXO_PROMPT_DENSE must be"):
        setting()


def _layer(n: int = 96, k: int = 128, bits: int = 4) -> nn.QuantizedLinear:
    return quantized_linear(n, k, bits)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_layer_runs_dense_from_its_row_count_and_as_before_below_it(bits):
    layer = _layer(bits=bits)
    x = (mx.random.normal((2, 12, 128), key=mx.random.key(1)) * 0.5).astype(mx.bfloat16)
    quantized = layer(x)
    few = layer(x[:, :7])
    make_dense_rows(layer, min_rows=16, min_work=0)
    assert type(layer).__name__ == "DenseRowsQuantizedLinear" and isinstance(layer, nn.QuantizedLinear)
    dense = layer(x)  # 24 rows: dense
    want = x @ mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=64, bits=bits).astype(x.dtype).T
    assert dense.dtype == x.dtype and mx.array_equal(dense, want).item()
    assert mx.array_equal(layer(x[:, :7]), few).item()  # 7 rows: MLX's quantized product, bit for bit
    scale = mx.abs(quantized.astype(mx.float32)).max()
    assert (mx.abs(dense.astype(mx.float32) - quantized.astype(mx.float32)).max() / scale).item() < 2e-2
    with prompt_dense.suspended():
        assert mx.array_equal(layer(x), quantized).item()
    make_dense_rows(layer, min_rows=16, min_work=10**9)  # too little work at 24 rows x 96 x 128
    assert mx.array_equal(layer(x), quantized).item()


def test_dense_weight_keeps_the_layer_s_mode_and_dtype():
    layer = _layer(bits=4)
    w = dense_weight(layer, mx.float16)
    assert w.dtype == mx.float16 and w.shape == (96, 128)
    assert mx.array_equal(w, mx.dequantize(layer.weight, layer.scales, layer.biases, 64, 4).astype(mx.float16)).item()


def test_use_prompt_dense_follows_the_setting(monkeypatch):
    layer = _layer()
    monkeypatch.delenv("EXO_PROMPT_DENSE", raising=False)  # auto: MLX CUDA only, not this CPU
    assert use_prompt_dense([layer], []) == {} and type(layer) is nn.QuantizedLinear
    monkeypatch.setenv("EXO_PROMPT_DENSE", "off")
    assert use_prompt_dense([layer], []) == {} and type(layer) is nn.QuantizedLinear
    monkeypatch.setenv("EXO_PROMPT_DENSE", "on:32")
    assert use_prompt_dense([layer], []) == {"dense 128->96 4-bit g64": "ok: from 32 rows"}
    assert layer.dense_min_rows == 32


def _moe_block(checkpoint) -> tuple[SparseMoeBlock, object]:
    loaded = load_checkpoint(checkpoint("qwen3_5_moe", layout="mlx_q4_sidecar", head="trained", dtype="bfloat16"))
    return next(iter(loaded.model.moe_blocks())), loaded


def test_dense_experts_agree_with_the_quantized_ones_and_the_check_refuses_wrong_ones(checkpoint, monkeypatch):
    block, _ = _moe_block(checkpoint)
    switch = block.switch_mlp
    x = (mx.random.normal((1, 40, switch.up_proj.input_dims), key=mx.random.key(5)) * 0.5).astype(mx.bfloat16)
    experts = switch.down_proj.num_experts
    order = mx.argsort(mx.random.uniform(shape=(1, 40, experts), key=mx.random.key(6)), axis=-1)
    indices = order[..., : block.top_k].astype(mx.uint32)
    dense, reference = experts_dense(switch, x, indices), experts_unsorted(switch, x, indices)
    assert dense.shape == reference.shape
    scale = mx.abs(reference.astype(mx.float32)).max()
    assert (mx.abs(dense.astype(mx.float32) - reference.astype(mx.float32)).max() / scale).item() < 2e-2
    ok, what = check_experts(block, 64, experts_unsorted)
    assert ok and what.startswith("relative difference"), what
    real = mx.gather_mm

    def wrong(a, b, **kw):  # a sorted gather that returns the wrong experts' products (as MLX CUDA's once did)
        return real(a, b, rhs_indices=(kw["rhs_indices"] + 1) % experts, sorted_indices=False)

    monkeypatch.setattr(mx, "gather_mm", wrong)
    ok, what = check_experts(block, 64, experts_unsorted)
    assert not ok and what.startswith("the dense experts differ from the quantized ones"), what


def test_a_moe_block_runs_dense_experts_from_its_pair_count(checkpoint, monkeypatch):
    block, _ = _moe_block(checkpoint)
    calls = []
    real = prompt_dense.experts_dense
    monkeypatch.setattr("exo.engine.models.layers.experts_dense",
                        lambda *a: calls.append(a[2].size) or real(*a))
    block.dense_experts_from = 64
    dim = block.switch_mlp.up_proj.input_dims
    x = (mx.random.normal((1, 40, dim), key=mx.random.key(7)) * 0.5).astype(mx.bfloat16)
    got = block(x)
    assert calls == [40 * block.top_k]
    block(x[:, :2])  # a decode-sized call: the quantized experts
    assert calls == [40 * block.top_k]
    with prompt_dense.suspended():
        quantized = block(x)
    assert calls == [40 * block.top_k]
    scale = mx.abs(quantized.astype(mx.float32)).max()
    assert (mx.abs(got.astype(mx.float32) - quantized.astype(mx.float32)).max() / scale).item() < 2e-2


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_prompts_run_dense_while_decoding_mtp_and_batches_keep_their_identities(checkpoint, monkeypatch, arch):
    """``EXO_PROMPT_DENSE=on:16``: a prompt of 24 tokens runs dense (every quantized layer, and the experts), its
    decode steps and verify calls do not; greedy native MTP at every depth gives plain decoding's tokens, and a
    batch gives each member its solo tokens."""
    path = checkpoint(arch, layout="mlx_q4_sidecar", head="trained", dtype="bfloat16")
    monkeypatch.setenv("EXO_PROMPT_DENSE", "on:16")
    loaded = dataclasses.replace(load_checkpoint(path), eos_token_ids=frozenset())
    assert loaded.dense and all(v.startswith("ok") for v in loaded.dense.values()), loaded.dense
    assert any(k.startswith("dense experts") for k in loaded.dense) == (arch == "qwen3_5_moe")
    rows = []
    real = prompt_dense.dense_weight
    monkeypatch.setattr(prompt_dense, "dense_weight", lambda m, d: rows.append(m["weight"].shape) or real(m, d))
    engine = Engine(loaded, EngineConfig())
    prompt = (loaded.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return fib(n - 1)") * 3)[:24]
    plain = engine.complete(GenerationRequest(prompt, max_tokens=12, native_mtp="off"))
    assert rows  # the prompt ran dense
    rows.clear()
    engine.complete(GenerationRequest(prompt[:8], max_tokens=12, native_mtp="off"))
    assert not rows  # 8 rows of prompt and one-row steps: MLX's quantized products
    for depth in (1, 2, 3):
        mtp = engine.complete(GenerationRequest(prompt, max_tokens=12, native_mtp="on", mtp_k=depth))
        assert mtp.token_ids == plain.token_ids, depth
    requests = [_request(engine, i, max_tokens=m, native_mtp="off") for i, m in enumerate((10, 6, 8))]
    got = _run_batch(engine, requests, join_at=[0, 0, 2])
    for i, request in enumerate(requests):
        assert got[i][0] == engine.complete(request).token_ids, i


def test_a_pipeline_with_dense_prompts_gives_the_single_node_s_tokens(checkpoint, monkeypatch):
    """Stages loaded with ``EXO_PROMPT_DENSE=on:16`` (dense prompt calls and experts in each stage's part) run a
    24-token prompt, plain and drafting, and give the single dense node's tokens. What this holds is that the
    pipeline's stage loop runs with the dense classes (a stage's calls are not observed from here, and on this
    fixture the dense and the quantized products give the same tokens)."""
    from exo.runner.local_pipeline import run_local_pipeline

    path = checkpoint("qwen3_5_moe", layout="mlx_q4_sidecar", head="trained", dtype="bfloat16")
    monkeypatch.setenv("EXO_PROMPT_DENSE", "on:16")
    loaded = dataclasses.replace(load_checkpoint(path), eos_token_ids=frozenset())
    assert "dense experts from 16 rows" in loaded.dense
    engine = Engine(loaded, EngineConfig())
    prompt = (loaded.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return fib(n - 1)") * 3)[:24]
    plain = engine.complete(GenerationRequest(prompt, max_tokens=10, native_mtp="off"))
    requests = [{"prompt": prompt, "max_tokens": 10, "ignore_eos": True, "native_mtp": "off"},
                {"prompt": prompt, "max_tokens": 10, "ignore_eos": True, "native_mtp": "on", "mtp_k": 2}]
    out = run_local_pipeline(path, [(0, 2), (2, 4)], requests, timeout_s=240)
    for request, result in zip(requests, out["results"], strict=True):
        assert result["token_ids"] == plain.token_ids, request["native_mtp"]
        assert result["stats"]["mode"] == "pipeline", request["native_mtp"]
