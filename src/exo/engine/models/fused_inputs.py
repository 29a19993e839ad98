"""A layer's input projections as one product. Projections that read the same rows (a GatedDeltaNet layer's:
Qwen3.5's ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, Qwen3-Next's ``in_proj_qkvz`` and
``in_proj_ba``; an attention layer's ``q_proj``, ``k_proj``, ``v_proj``; a dense MLP's ``gate_proj`` and
``up_proj``; a MoE block's router ``gate`` and ``shared_expert_gate``) become one linear layer holding their weights one after another, its output split after it (views).

Why: on MLX CUDA a decode step is the host's work, about 14 us per quantized product (graph building plus
evaluation) whatever its size (docs/performance.md, the H200 launch costs): of a 9B step's 249 products, 72 are a
GatedDeltaNet layer's extra three, 16 an attention layer's extra two, 32 an MLP's extra one (120 in all). On Apple
GPUs each is a dispatch too.

Exact: a product's output column is its weight row against the input row, the same sums whichever rows sit
beside it in the weight, on every backend measured so far; ``check`` measures it on this device, per shape,
before a layer is fused (the first layer of a shape, on random rows, at the row counts of decode steps, verify
calls, batch steps and prompt chunks: each kernel MLX CUDA picks by rows): a shape whose fused columns are not bit
for bit its separate products stays as it is. So plain decoding still computes what stock mlx-lm computes; it is
not one of exo's own ops.

``use_fused_inputs`` (the loader, after the CPU kernels' classes, so that the check measures the products that will
run, and before qgemv, padded rows, dense prompts and verify rows, which then apply to the fused layer as to any
other, each with its own check) fuses wherever ``check`` passes; ``unfuse_inputs`` puts the checkpoint's layout back
(``exo convert`` saves the model's parameters by name); ``EXO_FUSED_INPUTS=0`` keeps the separate products. Not for
a tensor-sharded model: its projections are sliced per member by name (``engine/sharding.py``), and its layers run
mlx-lm's calls. The MTP head's layer fuses too (``loader.build_head``; its attention takes exo's call, the same
ops).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3_next import Qwen3NextAttention, Qwen3NextMLP

from .layers import (
    Attention,
    CpuLinear,
    CpuMLP,
    FusedCpuMLP,
    FusedMLP,
    GatedDeltaNet,
    NextGatedDeltaNet,
    SparseMoeBlock,
    _Packed,
)

# Rows the check compares at: a decode step, verify calls of K + 1 = 2-5 rows, batch steps, prompt chunks
CHECK_ROWS = (1, 2, 3, 4, 5, 8, 17, 33)  # (MLX CUDA: one-row qmv to 7 rows, then its 16-, 32- and 64-row tiles)


@dataclass(frozen=True)
class Kind:
    """A module whose input projections can be one product: their names, the fused layer's name, and the class the
    module takes once fused (None: it keeps its own, which reads ``fused_inputs``)."""

    parts: tuple[str, ...]
    fused: str
    becomes: type | None = None


KINDS: dict[type, Kind] = {
    GatedDeltaNet: Kind(("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), "in_proj_fused"),
    NextGatedDeltaNet: Kind(("in_proj_qkvz", "in_proj_ba"), "in_proj_fused"),
    Attention: Kind(("q_proj", "k_proj", "v_proj"), "qkv_proj"),
    # the MTP head's attention layer is mlx-lm's (exo's call is the same ops: the CPU kernels give it that one too)
    Qwen3NextAttention: Kind(("q_proj", "k_proj", "v_proj"), "qkv_proj", Attention),
    # a MoE block's router and its shared expert's gate (both 8-bit in mlx-lm's conversions: the experts' 4 bits
    # keep them apart from the shared expert's own gate / up, fused as a dense MLP's)
    SparseMoeBlock: Kind(("gate", "shared_expert_gate"), "gates_fused"),
    Qwen3NextMLP: Kind(("gate_proj", "up_proj"), "gate_up_proj", FusedMLP),
    CpuMLP: Kind(("gate_proj", "up_proj"), "gate_up_proj", FusedCpuMLP),
}
PROJECTIONS = {cls: kind.parts for cls, kind in KINDS.items()}


def enabled() -> bool:
    """``EXO_FUSED_INPUTS``: on (where ``check`` passes) unless 0 / off / false / no."""
    return os.environ.get("EXO_FUSED_INPUTS", "1").strip().lower() not in ("0", "off", "false", "no")


def projections(layer: nn.Module) -> list[nn.Module] | None:
    """The layer's input projections, when they can be one layer: ``nn.Linear`` (or its CPU kernel's class) without
    bias or ``nn.QuantizedLinear``, all alike (one class, input width, dtype, quantization)."""
    names = PROJECTIONS.get(type(layer))
    if names is None or getattr(layer, "fused_inputs", None) is not None or getattr(layer, "sharding_group", None):
        return None
    parts = [layer[name] for name in names if name in layer]
    if len(parts) != len(names):
        return None
    kind = type(parts[0])
    if kind not in (nn.Linear, CpuLinear, nn.QuantizedLinear) or any(type(p) is not kind or "bias" in p for p in parts):
        return None
    first = parts[0]
    same = [(p.weight.shape[1], p.weight.dtype, getattr(p, "group_size", None), getattr(p, "bits", None),
             getattr(p, "mode", None), "biases" in p, p.scales.dtype if "scales" in p else None) for p in parts]
    return parts if all(s == same[0] for s in same) and first.weight.ndim == 2 else None


def fused_linear(parts: list[nn.Module]) -> nn.Module:
    """One linear layer whose output is ``parts``' outputs one after another (their weights stacked by rows)."""
    keys = [key for key in ("weight", "scales", "biases") if key in parts[0]]
    return _linear_like(parts[0], {key: mx.concatenate([p[key] for p in parts]) for key in keys})


def _linear_like(like: nn.Module, arrays: dict[str, mx.array]) -> nn.Module:
    """A linear layer of ``like``'s class and quantization holding ``arrays`` (weight, scales, biases), evaluated;
    a CPU kernel's layer with its packed weight, as ``use_cpu_kernels`` leaves one."""
    linear = type(like).__new__(type(like))
    nn.Module.__init__(linear)
    for attr in ("group_size", "bits", "mode"):
        if hasattr(like, attr):
            setattr(linear, attr, getattr(like, attr))
    for key, value in arrays.items():
        linear[key] = value
    if isinstance(linear, nn.QuantizedLinear):
        linear.freeze()  # as nn.QuantizedLinear is
    mx.eval(linear.parameters())
    if isinstance(linear, CpuLinear) and linear.weight.dtype == mx.bfloat16:
        object.__setattr__(linear, "_exo_packed", _Packed(linear.weight))  # packed now, not in a step
    return linear


def widths(parts: list[nn.Module]) -> tuple[int, ...]:
    """The split points of the fused output: each part's first column."""
    points, at = [], 0
    for p in parts[:-1]:
        at += _outputs(p)
        points.append(at)
    return tuple(points)


def _outputs(linear: nn.Module) -> int:
    return int(linear.weight.shape[0])


def _inputs(linear: nn.Module) -> int:
    packed = int(linear.weight.shape[1])
    return packed * 32 // linear.bits if isinstance(linear, nn.QuantizedLinear) else packed


def check(parts: list[nn.Module], fused: nn.Module, rows: tuple[int, ...] = CHECK_ROWS) -> tuple[bool, str]:
    """Whether ``fused``'s columns are bit for bit ``parts``' outputs on this device, on random rows at each of
    ``rows`` row counts; what was found."""
    width = _inputs(parts[0])
    dtype = parts[0].scales.dtype if isinstance(parts[0], nn.QuantizedLinear) else parts[0].weight.dtype
    if not mx.issubdtype(dtype, mx.floating):
        dtype = mx.bfloat16  # (a microscaled format's scales are integers)
    points = widths(parts)
    for i, n in enumerate(rows):
        x = (mx.random.normal((1, n, width), key=mx.random.key(17 + i)) * 0.5).astype(dtype)
        together = mx.split(fused(x), points, axis=-1)
        alone = [p(x) for p in parts]
        mx.eval(together, alone)
        for t, a in zip(together, alone, strict=True):
            if t.shape != a.shape or not bool(mx.array_equal(t, a)):
                return False, f"its columns differ from the separate products at {n} rows"
    return True, f"one product of {sum(_outputs(p) for p in parts)} outputs for {len(parts)}, equal at {len(rows)} row counts"


def use_fused_inputs(model: nn.Module) -> dict[str, str]:
    """Fuse the input projections of ``model``'s layers of every kind in ``KINDS`` (GatedDeltaNet, attention, dense
    MLPs, MoE routers) wherever ``check`` passes (the first layer of each shape checked); what was found per shape.
    Nothing where ``EXO_FUSED_INPUTS=0``."""
    if not enabled():
        return {}
    found: dict[str, str] = {}
    verdicts: dict[tuple[Any, ...], bool] = {}
    for _, layer in model.named_modules():
        parts = projections(layer)
        if parts is None:
            continue
        first = parts[0]
        signature = (type(layer).__name__, type(first).__name__, tuple(_outputs(p) for p in parts),
                     _inputs(first), str(first.weight.dtype), getattr(first, "bits", None))
        if verdicts.get(signature) is False:
            continue
        fused = fused_linear(parts)
        if signature not in verdicts:
            passed, what = check(parts, fused)
            verdicts[signature] = passed
            name = (f"{signature[0]} {'+'.join(PROJECTIONS[type(layer)])} {'x'.join(map(str, signature[2]))} "
                    f"{signature[1]} {signature[4].replace('mlx.core.', '')}"
                    + (f" {signature[5]}-bit" if signature[5] else ""))
            found[name] = ("ok: " if passed else "not used: ") + what
        if not verdicts[signature]:
            continue
        kind = KINDS[type(layer)]
        for name in kind.parts:
            delattr(layer, name)
        setattr(layer, kind.fused, fused)
        object.__setattr__(layer, "_unfused_class", type(layer))  # (``unfuse_inputs`` gives it back)
        if kind.becomes is not None:
            layer.__class__ = kind.becomes
        object.__setattr__(layer, "fused_inputs", widths(parts))  # an attribute, not a parameter of the tree
    return found


def unfuse_inputs(model: nn.Module) -> int:
    """Put back every fused layer's separate projections (their weights split by rows: the same values), as the
    checkpoint names them, for whatever saves the parameters; the number of layers unfused."""
    count = 0
    for _, layer in model.named_modules():
        points = getattr(layer, "fused_inputs", None)
        cls = layer.__dict__.get("_unfused_class", type(layer))
        if not points or cls not in KINDS or KINDS[cls].fused not in layer:
            continue
        fused = layer[KINDS[cls].fused]
        names = KINDS[cls].parts
        pieces = {key: mx.split(fused[key], points, axis=0) for key in ("weight", "scales", "biases") if key in fused}
        for i, name in enumerate(names):
            setattr(layer, name, _linear_like(fused, {key: mx.contiguous(split[i]) for key, split in pieces.items()}))
        delattr(layer, KINDS[cls].fused)
        layer.__class__ = cls
        object.__setattr__(layer, "fused_inputs", None)
        del layer.__dict__["_unfused_class"]
        count += 1
    return count
