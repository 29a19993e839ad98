"""Quantized linear layers whose calls of few rows are padded to ``pad`` rows (engine/models/padded_rows.py).

The point on MLX CUDA is speed (a tiled product instead of one ``qmv`` read per row: bench/qmm_rows.py measures
it there); what these tests hold on the CPU is the wiring and the exactness that padding must keep: the
setting, the check that refuses a shape whose rows depend on their companions, padded calls that return the
rows' own products, and a model whose layers pad decoding plainly, with native MTP and in a batch exactly as
it decodes unpadded (MLX's CPU product computes each row alone, so padding changes no bit here).
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn
import pytest

from exo.engine import Engine, EngineConfig, GenerationRequest, load_checkpoint
from exo.engine.models.padded_rows import PaddedRowsLinear, check, setting, use_padded_rows
from tests.engine.quantized import quantized_linear
from tests.engine.test_batch import _request, _run_batch


@pytest.mark.parametrize(("value", "want"), [(None, ("off", 0)), ("0", ("off", 0)), ("1", ("off", 0)),
                                             ("8", ("cuda", 8)), ("16", ("cuda", 16)), ("always:8", ("always", 8)),
                                             (" ALWAYS:4 ", ("always", 4))])
def test_the_setting(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv("EXO_PAD_ROWS", raising=False)
    else:
        monkeypatch.setenv("EXO_PAD_ROWS", value)
    assert setting() == want


@pytest.mark.parametrize("value", ["yes", "sometimes:8", "always:x"])
def test_a_bad_setting_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("EXO_PAD_ROWS", value)
    with pytest.raises(ValueError, match="EXO_PAD_ROWS must be"):
        setting()


def _layer(n: int = 96, k: int = 128, bits: int = 4) -> nn.QuantizedLinear:
    return quantized_linear(n, k, bits)


def test_a_padded_call_returns_each_row_s_own_product(monkeypatch):
    layer = _layer()
    x = (mx.random.normal((2, 3, 128), key=mx.random.key(1)) * 0.5).astype(mx.bfloat16)
    want = layer(x)
    seen = []
    product = nn.QuantizedLinear.__call__
    monkeypatch.setattr(nn.QuantizedLinear, "__call__", lambda self, v: seen.append(v.shape) or product(self, v))
    layer.__class__ = PaddedRowsLinear
    layer.pad = 8
    got = layer(x)
    big = layer(mx.concatenate([x] * 2, axis=1))  # 12 rows: no padding
    assert seen == [(8, 128), (2, 6, 128)]  # 6 rows padded to 8; 12 rows as they are
    assert got.shape == want.shape and mx.array_equal(got, want).item()
    assert big.shape == (2, 6, 96)


def test_the_check_passes_mlx_s_cpu_product_and_refuses_rows_that_depend_on_their_companions(monkeypatch):
    layer = _layer()
    ok, what = check(layer, 8, timed=False)
    assert ok and what == "rows independent of their companions"
    product = nn.QuantizedLinear.__call__

    def mixing(self, x):  # a product whose rows see the others (a reduction across rows, as a bad kernel might)
        out = product(self, x)
        return out + 1e-2 * out.sum(axis=0, keepdims=True)

    monkeypatch.setattr(nn.QuantizedLinear, "__call__", mixing)
    ok, what = check(layer, 8, timed=False)
    assert not ok and what == "a row's bits change with the rows beside it (1 of 8)"


def test_use_padded_rows_is_off_by_default_and_only_on_mlx_cuda_with_a_row_count(monkeypatch):
    layer = _layer()
    monkeypatch.delenv("EXO_PAD_ROWS", raising=False)
    assert use_padded_rows([layer]) == {} and type(layer) is nn.QuantizedLinear
    monkeypatch.setenv("EXO_PAD_ROWS", "8")  # MLX CUDA only: not this CPU
    assert use_padded_rows([layer]) == {} and type(layer) is nn.QuantizedLinear
    monkeypatch.setenv("EXO_PAD_ROWS", "always:8")
    assert use_padded_rows([layer]) == {"pad 8: 128->96 4-bit g64": "ok: rows independent of their companions"}
    assert type(layer) is PaddedRowsLinear and layer.pad == 8


@pytest.mark.parametrize(("arch", "layout"), [("qwen3_5", "mlx_q4_sidecar"), ("qwen3_5_moe", "mlx_q4_sidecar")])
def test_a_model_with_padded_layers_decodes_as_unpadded_plain_mtp_and_batched(checkpoint, monkeypatch, arch,
                                                                              layout):
    """``EXO_PAD_ROWS=always:8``: every plain quantized layer of the backbone and the head pads; greedy plain
    decoding gives the unpadded model's tokens, native MTP at every depth gives plain's, and a batch gives each
    member its solo tokens."""
    path = checkpoint(arch, layout=layout, head="trained", dtype="bfloat16")
    unpadded = dataclasses.replace(load_checkpoint(path), eos_token_ids=frozenset())
    assert unpadded.padded == {}
    monkeypatch.setenv("EXO_PAD_ROWS", "always:8")
    loaded = dataclasses.replace(load_checkpoint(path), eos_token_ids=frozenset())
    assert loaded.padded and all(v.startswith("ok") for v in loaded.padded.values()), loaded.padded
    layers = [m for tree in (loaded.model, loaded.head) for _, m in tree.named_modules()
              if isinstance(m, nn.QuantizedLinear) and m.weight.ndim == 2]
    assert layers and all(type(m) is PaddedRowsLinear for m in layers)
    rows = []
    call = PaddedRowsLinear.__call__
    monkeypatch.setattr(PaddedRowsLinear, "__call__", lambda self, x: rows.append(x.size // x.shape[-1]) or call(self, x))

    before = Engine(unpadded, EngineConfig(prefill_chunk=8))
    engine = Engine(loaded, EngineConfig(prefill_chunk=8))
    prompt = loaded.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return fib")[:11]
    plain = engine.complete(GenerationRequest(prompt, max_tokens=16, native_mtp="off"))
    assert rows and min(rows) == 1  # decode steps went through the padded layers
    assert plain.token_ids == before.complete(GenerationRequest(prompt, max_tokens=16, native_mtp="off")).token_ids
    for depth in (1, 2, 3):
        rows.clear()
        mtp = engine.complete(GenerationRequest(prompt, max_tokens=16, native_mtp="on", mtp_k=depth))
        assert mtp.token_ids == plain.token_ids, depth
        assert depth + 1 in rows, depth  # the verify calls' rows padded too
    requests = [_request(engine, i, max_tokens=m, native_mtp="off") for i, m in enumerate((12, 7, 10))]
    got = _run_batch(engine, requests, join_at=[0, 0, 2])
    for i, request in enumerate(requests):
        assert got[i][0] == engine.complete(request).token_ids, i
