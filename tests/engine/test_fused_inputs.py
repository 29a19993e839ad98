"""A layer's input projections as one product (``models.fused_inputs``: a GatedDeltaNet layer's, an attention layer's
q / k / v, a dense MLP's gate / up): fused by the loader where its check finds the same bits, the hiddens of a prompt, a decode step and a verify call bit for bit those of the
separate products, greedy plain and native-MTP decoding the same tokens; a device whose wide product rounds
otherwise keeps the separate products; ``EXO_FUSED_INPUTS=0`` keeps them too."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.qwen3_next import Qwen3NextMLP

from exo.engine import Engine, EngineConfig, GenerationRequest, load_checkpoint
from exo.engine.models import fused_inputs
from exo.engine.models.layers import (
    Attention,
    CpuMLP,
    FusedCpuMLP,
    FusedMLP,
    GatedDeltaNet,
    NextGatedDeltaNet,
    SparseMoeBlock,
)

from .quantized import quantized_linear

CASES = [("qwen3_5", None), ("qwen3_next", None), ("qwen3_5", "mlx_q4_sidecar"), ("qwen3_next", "mlx_q8_sidecar")]
IDS = ["qwen3_5-bf16", "qwen3_next-bf16", "qwen3_5-q4", "qwen3_next-q8"]


def _path(checkpoint, arch: str, layout: str | None):
    if layout is None:
        return checkpoint(arch, head="trained", dtype="bfloat16")
    return checkpoint(arch, layout=layout, head="trained", dtype="bfloat16")


def _load(path, monkeypatch, on: bool):
    monkeypatch.setenv("EXO_FUSED_INPUTS", "1" if on else "0")
    return dataclasses.replace(load_checkpoint(path), eos_token_ids=frozenset())


def _gdn_layers(model) -> list[nn.Module]:
    return [m for _, m in model.named_modules() if isinstance(m, (GatedDeltaNet, NextGatedDeltaNet))]


def _fused_modules(model) -> list[nn.Module]:
    return [m for _, m in model.named_modules() if getattr(m, "fused_inputs", None)]


def _hiddens(model, prompt: list[int]) -> list[mx.array]:
    """A prompt's hiddens (two chunks), a decode step's, then a 3-row call's, on one cache."""
    cache = model.make_cache()
    ids = mx.array(prompt)[None]
    out = [model.hidden(ids[:, :7], cache), model.hidden(ids[:, 7:], cache)]
    out.append(model.hidden(mx.array([[5]]), cache))
    out.append(model.hidden(mx.array([[7, 11, 13]]), cache))
    mx.eval(out)
    return out


@pytest.mark.parametrize(("arch", "layout"), CASES, ids=IDS)
def test_fused_inputs_compute_the_separate_products_bits_and_decode_the_same_tokens(checkpoint, monkeypatch, arch,
                                                                                  layout):
    path = _path(checkpoint, arch, layout)
    fused, separate = _load(path, monkeypatch, True), _load(path, monkeypatch, False)
    assert separate.fused == {} and fused.fused and all(v.startswith("ok: ") for v in fused.fused.values()), fused.fused
    names = fused_inputs.PROJECTIONS[type(_gdn_layers(fused.model)[0])]
    for layer in _gdn_layers(fused.model):  # one product each, the separate ones gone (no weights twice)
        assert layer.fused_inputs is not None and "in_proj_fused" in layer and not any(n in layer for n in names)
    for layer in _gdn_layers(separate.model):
        assert layer.fused_inputs is None and "in_proj_fused" not in layer and all(n in layer for n in names)
    attention = [m for _, m in fused.model.named_modules() if isinstance(m, Attention)]
    mlps = [m for _, m in fused.model.named_modules() if isinstance(m, (FusedMLP, FusedCpuMLP))]
    assert attention and all(m.fused_inputs and "qkv_proj" in m and "q_proj" not in m for m in attention)
    assert mlps and all("gate_up_proj" in m and "up_proj" not in m for m in mlps)
    assert not [m for _, m in fused.model.named_modules() if type(m) in (Qwen3NextMLP, CpuMLP)]
    moe = any(isinstance(m, SparseMoeBlock) for _, m in fused.head.named_modules())
    # the MTP head's attention and MLP (a MoE head: its shared expert's gate / up, its router with the shared gate)
    assert fused.head is not None and len(_fused_modules(fused.head)) == (3 if moe else 2)
    blocks = [m for _, m in fused.model.named_modules() if isinstance(m, SparseMoeBlock)]
    assert all(m.fused_inputs and "gates_fused" in m and "gate" not in m for m in blocks)
    sizes = [sum(v.size for _, v in tree_flatten(m.model.parameters())) for m in (fused, separate)]
    assert sizes[0] == sizes[1]

    prompt = fused.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return fib")[:13]
    for a, b in zip(_hiddens(fused.model, prompt), _hiddens(separate.model, prompt), strict=True):
        assert a.shape == b.shape and bool(mx.array_equal(a, b))

    engines = [Engine(m, EngineConfig(prefill_chunk=8)) for m in (fused, separate)]
    plain = [e.complete(GenerationRequest(prompt, max_tokens=12, native_mtp="off")).token_ids for e in engines]
    assert plain[0] == plain[1]
    for depth in (1, 3):
        drafted = engines[0].complete(GenerationRequest(prompt, max_tokens=12, native_mtp="on", mtp_k=depth))
        assert drafted.token_ids == plain[0] and drafted.stats.rounds > 0, depth


class _WideRoundsOtherwise(nn.Linear):
    """A device whose wide product rounds otherwise than the narrow ones (exaggerated: it changes the values)."""

    def __call__(self, x: mx.array) -> mx.array:
        return super().__call__(x) * 1.05


def test_a_shape_whose_fused_product_differs_keeps_its_separate_products(checkpoint, monkeypatch):
    path = _path(checkpoint, "qwen3_5", None)
    real = fused_inputs.fused_linear

    def rounding_otherwise(parts):
        fused = real(parts)
        fused.__class__ = _WideRoundsOtherwise
        return fused

    monkeypatch.setattr(fused_inputs, "fused_linear", rounding_otherwise)
    loaded = _load(path, monkeypatch, True)
    assert {name.split(" ")[1] for name in loaded.fused} == {"in_proj_qkv+in_proj_z+in_proj_b+in_proj_a",
                                                              "q_proj+k_proj+v_proj", "gate_proj+up_proj"}
    assert set(loaded.fused.values()) == {"not used: its columns differ from the separate products at 1 rows"}
    assert all(layer.fused_inputs is None and "in_proj_qkv" in layer for layer in _gdn_layers(loaded.model))
    assert not [m for _, m in loaded.model.named_modules() if getattr(m, "fused_inputs", None)]
    monkeypatch.undo()
    separate = _load(path, monkeypatch, False)
    prompt = list(range(3, 16))
    for a, b in zip(_hiddens(loaded.model, prompt), _hiddens(separate.model, prompt), strict=True):
        assert bool(mx.array_equal(a, b))


def test_the_check_compares_every_column_of_every_part_at_each_row_count():
    parts = [quantized_linear(n, 128, key=mx.random.key(i)) for i, n in enumerate((96, 64, 32, 32))]
    fused = fused_inputs.fused_linear(parts)
    assert isinstance(fused, nn.QuantizedLinear) and fused.weight.shape[0] == 224
    assert fused_inputs.widths(parts) == (96, 160, 192)
    passed, what = fused_inputs.check(parts, fused, rows=(1, 4, 9))
    assert passed and what == "one product of 224 outputs for 4, equal at 3 row counts", what
    # one output column of the last part off by a unit of its scale: found at the first row count
    fused.scales = mx.concatenate([fused.scales[:-1], fused.scales[-1:] * 1.5])
    passed, what = fused_inputs.check(parts, fused, rows=(1, 4, 9))
    assert not passed and what == "its columns differ from the separate products at 1 rows"


def test_projections_of_unlike_kinds_stay_apart(checkpoint, monkeypatch):
    loaded = _load(_path(checkpoint, "qwen3_5", None), monkeypatch, False)
    layer = _gdn_layers(loaded.model)[0]
    assert fused_inputs.projections(layer) is not None
    layer.in_proj_a = quantized_linear(int(layer.in_proj_a.weight.shape[0]), int(layer.in_proj_a.weight.shape[1]))
    assert fused_inputs.projections(layer) is None  # a quantized part beside unquantized ones


@pytest.mark.parametrize(("arch", "layout"), [CASES[0], CASES[3]], ids=[IDS[0], IDS[3]])
def test_unfused_the_model_has_the_checkpoint_s_parameters_again(checkpoint, monkeypatch, arch, layout):
    """What ``exo convert`` saves: every parameter by its checkpoint name, the same values."""
    path = _path(checkpoint, arch, layout)
    fused, separate = _load(path, monkeypatch, True), _load(path, monkeypatch, False)
    count = len(_fused_modules(fused.model))
    assert count > len(_gdn_layers(fused.model)) and fused_inputs.unfuse_inputs(fused.model) == count
    assert not _fused_modules(fused.model)
    count = len(_fused_modules(fused.head))
    assert count >= 2 and fused_inputs.unfuse_inputs(fused.head) == count and not _fused_modules(fused.head)
    mine, theirs = dict(tree_flatten(fused.head.parameters())), dict(tree_flatten(separate.head.parameters()))
    assert sorted(mine) == sorted(theirs) and all(bool(mx.array_equal(mine[k], theirs[k])) for k in mine)
    assert ({n: type(m) for n, m in fused.head.named_modules()} == {n: type(m) for n, m in separate.head.named_modules()})
    mine, theirs = dict(tree_flatten(fused.model.parameters())), dict(tree_flatten(separate.model.parameters()))
    assert sorted(mine) == sorted(theirs)
    assert all(mine[k].dtype == theirs[k].dtype and bool(mx.array_equal(mine[k], theirs[k])) for k in mine)
    prompt = list(range(3, 16))
    for a, b in zip(_hiddens(fused.model, prompt), _hiddens(separate.model, prompt), strict=True):
        assert bool(mx.array_equal(a, b))


def test_a_microscaled_format_fuses_too():
    """mxfp4 (integer scales, no biases): the check's rows are bfloat16, the fused layer keeps the mode."""
    parts = []
    for i, n in enumerate((64, 32)):
        linear = nn.Linear(128, n, bias=False)
        linear.weight = (mx.random.normal((n, 128), key=mx.random.key(i)) * 0.05).astype(mx.bfloat16)
        parts.append(nn.QuantizedLinear.from_linear(linear, group_size=32, bits=4, mode="mxfp4"))
    fused = fused_inputs.fused_linear(parts)
    assert fused.mode == "mxfp4" and "biases" not in fused
    assert fused_inputs.check(parts, fused, rows=(1, 3, 9)) == (True, "one product of 96 outputs for 2, equal at 3 row counts")
