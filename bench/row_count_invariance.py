"""Which matmuls of a model give a row a different result depending on how many rows the call has.

    python bench/row_count_invariance.py [MODEL ...]      (default: exo-demo)

For each linear of one GatedDeltaNet layer, one attention layer and the lm_head (the model's own weights,
random inputs), computes calls of M = 1..8 rows and prints, per M, whether row 0 equals row 0 of the 8-row
call and of the 2-row call ('=' equal bit for bit, 'x' not). A pattern 'x=======' means one-row calls
(decode steps) take another kernel than multi-row calls (verify rows), which all agree with each other.
Equal on random inputs does not prove two kernels round alike; different proves they do not.
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from exo.engine import load

MAX_ROWS = 8


def linears(model: Any) -> dict[str, Any]:
    layers = model.stage_layers
    gdn_layer = next(layer for layer in layers if layer.is_linear)
    attention_layer = next(layer for layer in layers if not layer.is_linear)
    gdn = gdn_layer.linear_attn
    out = {"gdn.in_proj_qkv": gdn.in_proj_qkv, "gdn.in_proj_z": getattr(gdn, "in_proj_z", None),
           "gdn.out_proj": gdn.out_proj}
    mlp = gdn_layer.mlp
    for name in ("gate_proj", "up_proj", "down_proj"):
        if hasattr(mlp, name):
            out["mlp." + name] = getattr(mlp, name)
        if hasattr(mlp, "shared_expert"):
            out["shared." + name] = getattr(mlp.shared_expert, name)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        out["attn." + name] = getattr(attention_layer.self_attn, name)
    return {k: v for k, v in out.items() if v is not None}


def in_features(linear: Any) -> int:
    if isinstance(linear, nn.QuantizedLinear):
        return linear.weight.shape[1] * 32 // linear.bits
    return linear.weight.shape[1]


def main(names: list[str]) -> None:
    for name in names or [None]:
        model = load(name).model
        dtype = model.stage_layers[0].input_layernorm.weight.dtype
        print("==", name or "exo-demo", dtype)
        mods: dict[str, Any] = {**linears(model), "lm_head": model.logits}
        for key, fn in mods.items():
            width = model.hidden_size if key == "lm_head" else in_features(fn)
            x = (mx.random.normal((1, MAX_ROWS, width), key=mx.random.key(1)) * 0.5).astype(dtype)
            outs = {m: fn(x[:, :m]) for m in range(1, MAX_ROWS + 1)}
            mx.eval(list(outs.values()))

            def row0(ref: int, outs: dict[int, mx.array] = outs) -> str:
                return "".join("=" if mx.array_equal(outs[m][:, :1], outs[ref][:, :1]).item() else "x"
                               for m in range(1, MAX_ROWS + 1))

            print(f"  {key:18s} row0 vs M={MAX_ROWS}: {row0(MAX_ROWS)}   row0 vs M=2: {row0(2)}   (M=1..{MAX_ROWS})")


if __name__ == "__main__":
    main(sys.argv[1:])
