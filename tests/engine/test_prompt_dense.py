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


# -- a batch step's products dense (EXO_BATCH_DENSE) ------------------------------------------------------------


@pytest.mark.parametrize(("value", "want"), [(None, ("auto", prompt_dense.KEEP_MIN_ROWS, True)),
                                             ("auto", ("auto", prompt_dense.KEEP_MIN_ROWS, True)),
                                             ("off", ("off", 0, False)), ("0", ("off", 0, False)),
                                             ("on", ("cuda", prompt_dense.BATCH_MIN_ROWS, False)),
                                             (" ON:4 ", ("always", 4, False)),
                                             ("keep", ("cuda", prompt_dense.KEEP_MIN_ROWS, True)),
                                             ("Keep:3", ("always", 3, True))])
def test_the_batch_setting(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv("EXO_BATCH_DENSE", raising=False)
    else:
        monkeypatch.setenv("EXO_BATCH_DENSE", value)
    assert prompt_dense.batch_setting() == want


@pytest.mark.parametrize("value", ["yes", "on:0", "on:-2", "autos", "keep:0", "keeps", "keep:x"])
def test_a_bad_batch_setting_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("EXO_BATCH_DENSE", value)
    with pytest.raises(ValueError, match="EXO_BATCH_DENSE must be"):
        prompt_dense.batch_setting()


def test_a_batch_step_runs_dense_and_nothing_else_does():
    """From ``batch_rows`` sequences a batch's plain step (x [B, 1, D]) runs on the dequantized weight; fewer
    sequences, a prompt's rows, a verify call's rows ([B, K + 1, D]), a batch-invariant step's rows and a layer under
    ``batch_weights`` keep the layer's own product, bit for bit."""
    layer = _layer(bits=4)
    key = mx.random.key(3)
    step = (mx.random.normal((6, 1, 128), key=key) * 0.5).astype(mx.bfloat16)
    others = {"3 sequences": step[:3], "a prompt of 6 rows": step.reshape(1, 6, 128),
              "a verify call of 2 x 3 rows": step.reshape(2, 3, 128)}
    before = {name: layer(x) for name, x in [("step", step), *others.items()]}
    make_dense_rows(layer, prompt_dense.NEVER, 0, batch_rows=4, batch_weights=0)
    want = step @ dense_weight(layer, step.dtype).T
    assert mx.array_equal(layer(step), want).item() and not mx.array_equal(want, before["step"]).item()
    for name, x in others.items():
        assert mx.array_equal(layer(x), before[name]).item(), name
    for flag in ("exact_batch", "exact_verify", "batch_vectors"):  # batch-invariant steps, verify calls
        setattr(layer, flag, True)
        assert mx.array_equal(layer(step), before["step"]).item(), flag
        setattr(layer, flag, False)
    with prompt_dense.suspended():
        assert mx.array_equal(layer(step), before["step"]).item()
    make_dense_rows(layer, prompt_dense.NEVER, 0, batch_rows=4, batch_weights=96 * 128 + 1)  # too small a layer
    assert mx.array_equal(layer(step), before["step"]).item()


def test_use_prompt_dense_gives_batches_alone_the_dense_path(monkeypatch):
    """``EXO_BATCH_DENSE`` installs the dense class with prompts off (prompts then never dense); ``on`` is MLX
    CUDA's alone, so on this CPU nothing changes."""
    monkeypatch.setenv("EXO_PROMPT_DENSE", "off")
    monkeypatch.setenv("EXO_BATCH_DENSE", "on")
    layer = _layer()
    assert use_prompt_dense([layer], []) == {} and type(layer) is nn.QuantizedLinear
    monkeypatch.setenv("EXO_BATCH_DENSE", "on:4")
    assert use_prompt_dense([layer], []) == {"dense batch 128->96 4-bit g64": "ok: from 4 sequences"}
    x = (mx.random.normal((1, 600, 128), key=mx.random.key(4)) * 0.5).astype(mx.bfloat16)
    assert layer.dense_min_rows == prompt_dense.NEVER and layer.dense_batch_rows == 4
    with prompt_dense.suspended():
        quantized = layer(x)
    assert mx.array_equal(layer(x), quantized).item()  # a prompt of 600 rows: not dense with prompts off


def test_held_dense_weights_compute_what_dequantizing_per_call_does_and_are_no_parameters(monkeypatch):
    """``EXO_BATCH_DENSE=keep:4``: the batch rule's layers hold their weight dequantized at load (reported, in the
    scales' type, outside the parameters), and a batch step and a prompt read it: bit for bit what dequantizing for
    the call computes (``transient``), never dequantizing again (the size rule is MLX CUDA's: both layers hold here)."""
    monkeypatch.setenv("EXO_PROMPT_DENSE", "on:8")
    monkeypatch.setenv("EXO_BATCH_DENSE", "keep:4")
    layer, small = quantized_linear(96, 128, 4, dtype=mx.bfloat16), _layer(n=32, k=64)
    parameters = [sorted(k for k, _ in nn.utils.tree_flatten(m.parameters())) for m in (layer, small)]
    found = use_prompt_dense([layer, small], [])
    assert found["dense batch 128->96 4-bit g64"] == "ok: from 4 sequences, held", found
    assert found["dense weights held"] == f"ok: {(96 * 128 * 2 + 32 * 64 * 4) / 2**30:.2f} GiB in 2 layers", found
    assert layer.dense_kept is not None and layer.dense_kept.dtype == layer.scales.dtype
    assert [sorted(k for k, _ in nn.utils.tree_flatten(m.parameters())) for m in (layer, small)] == parameters
    assert mx.array_equal(layer.dense_kept, dense_weight(layer, layer.scales.dtype)).item()
    key = mx.random.key(5)
    step = (mx.random.normal((6, 1, 128), key=key) * 0.5).astype(mx.bfloat16)
    prompt = (mx.random.normal((1, 12, 128), key=key) * 0.5).astype(mx.bfloat16)
    with prompt_dense.transient():
        want = [layer(step), layer(prompt)]
    calls: list[int] = []
    real = prompt_dense.dense_weight
    monkeypatch.setattr(prompt_dense, "dense_weight", lambda m, d: calls.append(1) or real(m, d))
    assert mx.array_equal(layer(step), want[0]).item() and mx.array_equal(layer(prompt), want[1]).item()
    assert not calls  # read, never dequantized again
    with prompt_dense.transient():
        layer(step)
    assert calls == [1]
    assert prompt_dense.state() == (True, True)
    # a weight replaced after the load (load_weights): the held copy is stale and never read again
    calls.clear()
    layer.weight = mx.array(layer.weight)
    layer.scales = layer.scales * 2
    assert mx.array_equal(layer(step), step @ real(layer, step.dtype).T).item() and calls == [1]
    with prompt_dense.transient():
        assert prompt_dense.state() == (True, False)
    monkeypatch.setenv("EXO_BATCH_DENSE", "on:4")  # not kept: nothing held
    fresh = _layer()
    assert "dense weights held" not in use_prompt_dense([fresh], []) and fresh.dense_kept is None


def test_auto_holds_dense_weights_on_mlx_cuda_where_they_fit_and_nowhere_else(monkeypatch):
    """The default (``auto``): nothing off MLX CUDA; on it (the device and its memory are what is stood in for
    here) the batch rule's layers hold their dense weights from ``KEEP_MIN_ROWS`` sequences, the largest first while
    they take at most ``HOLD_SHARE`` of the memory left; a layer not held keeps its own product in batch steps (said
    why), and where none fits no batch step runs dense."""
    monkeypatch.setenv("EXO_PROMPT_DENSE", "off")
    monkeypatch.delenv("EXO_BATCH_DENSE", raising=False)
    big, small = quantized_linear(192, 128, 4, dtype=mx.bfloat16), quantized_linear(96, 128, 4, dtype=mx.bfloat16)
    assert use_prompt_dense([big, small], []) == {} and type(big) is nn.QuantizedLinear  # this CPU
    monkeypatch.setattr(prompt_dense, "on_cuda", lambda: True)
    monkeypatch.setattr(prompt_dense, "BATCH_MIN_WEIGHTS", 96 * 128)
    both = (192 + 96) * 128 * 2  # bytes of both dense weights
    memory = {"left": 5 * both}
    monkeypatch.setattr(prompt_dense, "device_memory_bytes", lambda: mx.get_active_memory() + memory["left"])
    rows = prompt_dense.KEEP_MIN_ROWS
    found = use_prompt_dense([big, small], [])
    assert found["dense batch 128->192 4-bit g64"] == found["dense batch 128->96 4-bit g64"] == \
        f"ok: from {rows} sequences, held", found
    assert found["dense weights held"] == f"ok: {both / 2**30:.2f} GiB in 2 layers", found
    assert big.dense_kept is not None and small.dense_batch_rows == rows
    # room for the larger alone: it is held, the smaller keeps the quantized product in batch steps
    big, small = quantized_linear(192, 128, 4, dtype=mx.bfloat16), quantized_linear(96, 128, 4, dtype=mx.bfloat16)
    memory["left"] = 4 * 192 * 128 * 2 + 100
    found = use_prompt_dense([big, small], [])
    assert found["dense batch 128->192 4-bit g64"] == f"ok: from {rows} sequences, held", found
    assert found["dense batch 128->96 4-bit g64"] == "not used: not held (no room)", found
    assert "1 of 2 layers not held" in found["dense weights held"] and "25% of the memory left" in found["dense weights held"]
    assert big.dense_kept is not None and type(small) is nn.QuantizedLinear
    # room for neither: no batch step runs dense
    tight = quantized_linear(96, 128, 4, dtype=mx.bfloat16)
    memory["left"] = 3 * 96 * 128 * 2
    found = use_prompt_dense([tight], [])
    assert found["dense batch 128->96 4-bit g64"] == "not used: not held (no room)", found
    assert "1 of 1 layers not held" in found["dense batch"] and type(tight) is nn.QuantizedLinear


def test_a_batch_decodes_dense_and_a_batch_invariant_one_keeps_its_solo_tokens(checkpoint, monkeypatch):
    """``EXO_BATCH_DENSE=on:2`` on a real model: a batch of three runs its plain steps dense (the lm_head's and the
    layers' weights dequantized while it decodes, never while a request decodes alone), each member to its length,
    its first step's logits within bfloat16 rounding of the quantized product's; a batch-invariant engine's batch
    never runs dense and gives each member its solo tokens."""
    path = checkpoint("qwen3_5", layout="mlx_q4_sidecar", head="trained", dtype="bfloat16")
    monkeypatch.setenv("EXO_BATCH_DENSE", "on:2")
    loaded = dataclasses.replace(load_checkpoint(path), eos_token_ids=frozenset())
    assert loaded.dense and all(k.startswith("dense batch") for k in loaded.dense), loaded.dense
    shapes: list[tuple[int, ...]] = []
    real = prompt_dense.dense_weight
    monkeypatch.setattr(prompt_dense, "dense_weight", lambda m, d: shapes.append(m["weight"].shape) or real(m, d))
    engine = Engine(loaded, EngineConfig())
    requests = [_request(engine, i, max_tokens=m, native_mtp="off") for i, m in enumerate((8, 5, 7))]
    solo = [engine.complete(r).token_ids for r in requests]
    assert not shapes  # alone: one row a step
    got = _run_batch(engine, requests)
    heads = [m.weight.shape for name, m in loaded.model.named_modules() if name.endswith("lm_head")]
    assert shapes and heads and heads[0] in shapes
    assert [len(got[i][0]) for i in range(3)] == [8, 5, 7]
    # one step of three sequences from fresh caches, dense against the quantized products
    tokens = mx.array([[r.prompt_tokens[-1]] for r in requests])
    dense = engine.model.logits(engine.forward.hidden(tokens, engine.forward.new_cache())).astype(mx.float32)
    with prompt_dense.suspended():
        quantized = engine.model.logits(engine.forward.hidden(tokens, engine.forward.new_cache())).astype(mx.float32)
    assert (mx.abs(dense - quantized).max() / mx.abs(quantized).max()).item() < 2e-2
    invariant = Engine(loaded, EngineConfig(batch_invariant=True))
    shapes.clear()
    got = _run_batch(invariant, requests)
    assert not shapes
    for i in range(3):
        assert got[i][0] == solo[i], i


def test_a_batch_on_held_dense_weights_decodes_what_dequantizing_per_step_does(checkpoint, monkeypatch):
    """``EXO_BATCH_DENSE=keep:2`` on a real model: a batch of three decodes the tokens ``on:2`` decodes (the same
    dense products, the weight read instead of dequantized every step), and every step reads the held weights."""
    path = checkpoint("qwen3_5", layout="mlx_q4_sidecar", head="trained", dtype="bfloat16")
    got = {}
    for value in ("on:2", "keep:2"):
        monkeypatch.setenv("EXO_BATCH_DENSE", value)
        loaded = dataclasses.replace(load_checkpoint(path), eos_token_ids=frozenset())
        assert ("dense weights held" in loaded.dense) == (value == "keep:2"), loaded.dense
        engine = Engine(loaded, EngineConfig())
        requests = [_request(engine, i, max_tokens=m, native_mtp="off") for i, m in enumerate((8, 5, 7))]
        calls: list[int] = []
        real = prompt_dense.dense_weight
        monkeypatch.setattr(prompt_dense, "dense_weight", lambda m, d, calls=calls, real=real: calls.append(1) or real(m, d))
        got[value] = [_run_batch(engine, requests)[i][0] for i in range(3)]
        monkeypatch.setattr(prompt_dense, "dense_weight", real)
        assert bool(calls) == (value == "on:2")
    assert got["keep:2"] == got["on:2"] and [len(t) for t in got["on:2"]] == [8, 5, 7]
