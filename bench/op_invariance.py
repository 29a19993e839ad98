"""Which operations of a decode step round differently when they process several rows at once.

    python bench/op_invariance.py [MODEL] [--rows 4]

A speculative verify call runs K+1 rows through every layer where plain decoding runs one; greedy output
is identical only if every row of the verify call computes what a decode step would. For each kind of
operation in the model's layers (its own weights, random inputs), this prints whether every row of an
R-row call equals that row computed alone, bit for bit, and the largest difference; and the same for
whole decoder layers as the engine's verify probe runs them (engine/verify.py). Run it on
each device: CPU matmuls do not depend on the row count; GPU kernels may.
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from exo.engine import load
from exo.engine.costs import device_name


def compare(one: mx.array, many: mx.array) -> dict:
    a, b = one.astype(mx.float32), many.astype(mx.float32)
    diff = mx.max(mx.abs(a - b)).item()
    scale = max(mx.max(mx.abs(a)).item(), 1e-30)
    return {"equal": bool(mx.array_equal(one, many).item()), "max_abs": diff, "max_rel": diff / scale}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    engine = load(args.model)
    model = engine.model
    layers = model.stage_layers
    hidden = model.hidden_size
    R = args.rows
    mx.random.seed(0)
    x = (mx.random.normal((1, R, hidden)) * 0.5).astype(layers[0].input_layernorm.weight.dtype)
    results: dict[str, dict] = {}

    def check(name: str, fn, inputs: mx.array | None = None) -> None:
        t = x if inputs is None else inputs
        single = mx.concatenate([fn(t[:, r : r + 1]) for r in range(R)], axis=1)  # every row alone
        many = fn(t)
        mx.eval(single, many)
        results[name] = compare(single, many)

    def check_linear(name: str, linear: nn.Module) -> None:
        check(name, linear, (mx.random.normal((1, R, _in(linear))) * 0.5).astype(x.dtype))

    linear = next(layer for layer in layers if layer.is_linear)
    attention = next(layer for layer in layers if not layer.is_linear)
    check("rms_norm", linear.input_layernorm)
    gdn = linear.linear_attn
    check_linear("in_proj_qkv (matmul)", gdn.in_proj_qkv)
    check_linear("in_proj_b (matmul, few outputs)", gdn.in_proj_b)
    check_linear("out_proj (matmul)", gdn.out_proj)
    mlp = linear.mlp
    if hasattr(mlp, "gate_proj"):
        check("mlp (gate/up/down matmuls)", mlp)
    else:
        check("moe block (router, experts, shared expert)", mlp)
    check("lm_head / logits", lambda t: model.logits(t))
    # The conv of a GatedDeltaNet layer: decode convolves a window of kernel_size rows; a block R+3 rows.
    taps = gdn.conv_kernel_size
    conv_in = mx.random.normal((1, taps - 1 + R, gdn.conv_dim)).astype(x.dtype)
    single = mx.concatenate([gdn.conv1d(conv_in[:, r : r + taps]) for r in range(R)], axis=1)
    many = gdn.conv1d(conv_in)
    mx.eval(single, many)
    results["conv1d (nn.Conv1d)"] = compare(single, many)
    # The gated delta recurrence: R rows in one call vs the first row alone (stock mlx-lm and MLX's fused op).
    from mlx_lm.models.gated_delta import compute_g, gated_delta_update

    B, Hk, Dk = 1, gdn.num_k_heads, gdn.head_k_dim
    Hv, Dv = gdn.num_v_heads, gdn.head_v_dim
    q = mx.random.normal((B, R, Hk, Dk)).astype(x.dtype)
    k = mx.random.normal((B, R, Hk, Dk)).astype(x.dtype)
    v = mx.random.normal((B, R, Hv, Dv)).astype(x.dtype)
    a = mx.random.normal((B, R, Hv)).astype(x.dtype)
    b = mx.random.normal((B, R, Hv)).astype(x.dtype)
    state = mx.random.normal((B, Hv, Dv, Dk)) * 0.1
    def stepwise(fn):
        outs, st = [], state
        for r in range(R):
            y, st = fn(r, st)
            outs.append(y)
        return mx.concatenate(outs, axis=1)

    single = stepwise(lambda r, st: gated_delta_update(q[:, r:r+1], k[:, r:r+1], v[:, r:r+1], a[:, r:r+1],
                                                       b[:, r:r+1], gdn.A_log, gdn.dt_bias, st))
    many, _ = gated_delta_update(q, k, v, a, b, gdn.A_log, gdn.dt_bias, state)
    mx.eval(single, many)
    results["gated delta (mlx-lm gated_delta_update)"] = compare(single, many)
    g = compute_g(gdn.A_log, a, gdn.dt_bias)
    single = stepwise(lambda r, st: mx.fast.gated_delta_update(q[:, r:r+1], k[:, r:r+1], v[:, r:r+1], g[:, r:r+1],
                                                               mx.sigmoid(b[:, r:r+1]), st, None))
    many, _ = mx.fast.gated_delta_update(q, k, v, g, mx.sigmoid(b), state, None)
    mx.eval(single, many)
    results["gated delta (mx.fast.gated_delta_update)"] = compare(single, many)
    # Attention over a cache: R decode steps vs one R-row call (causal), batched and per row (verify).
    prefix = mx.random.normal((1, 24, hidden)).astype(x.dtype)

    def attend(per_row: bool | None) -> mx.array:
        cache = KVCache()
        attention.self_attn(prefix, mask="causal", cache=cache)
        if per_row is None:
            return mx.concatenate([attention.self_attn(x[:, r : r + 1], mask=None, cache=cache) for r in range(R)], axis=1)
        attention.self_attn.per_row = per_row
        try:
            return attention.self_attn(x, mask="causal", cache=cache)
        finally:
            attention.self_attn.per_row = False

    steps = attend(None)
    for label, per_row in (("attention over a cache (sdpa)", False), ("attention over a cache, per row (verify)", True)):
        block = attend(per_row)
        mx.eval(steps, block)
        results[label] = compare(steps, block)
    # Whole decoder layers, as the engine's probe runs them, and what the engine concludes.
    from exo.engine.verify import probe

    mode, found = probe(model, "route_locked")
    results.update({f"probe: {name}": {"equal": equal, "max_abs": 0.0, "max_rel": 0.0} for name, equal in found.items()})
    results["probe: verify mode"] = {"equal": mode.exact, "max_abs": float(mode.per_row_attention),
                                     "max_rel": float(mode.per_row_logits)}
    out = {"model": engine.loaded.model_id, "device": device_name(), "rows": R, "ops": results}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"{out['model']} on {out['device']}: every row of a {R}-row call vs that row alone")
        for name, r in results.items():
            print(f"  {name:<40} {'equal' if r['equal'] else 'DIFFERS'}  max|d| {r['max_abs']:.3e}  rel {r['max_rel']:.2e}")
    return out


def _in(linear: nn.Module) -> int:
    w = linear.weight
    return w.shape[-1] * (32 // linear.bits) if hasattr(linear, "bits") else w.shape[-1]


if __name__ == "__main__":
    main()
