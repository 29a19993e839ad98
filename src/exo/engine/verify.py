"""How a verify call computes its K+1 rows so that each row rounds as a decode step would.

Greedy speculative decoding reproduces plain decoding token for token only if every row of a verify call
computes exactly what the one-row decode step at that position computes. Which operations do depends on
the backend and on the shapes: measured with bench/op_invariance.py@3c719fd, every operation of these models gives
the same bits for one row and for a block of rows on the CPU, while on MLX's CUDA backend attention over a
cache does not (a query block and a single query take different kernels) and a matmul may not (the
lm_head of one demo model: the library picks another kernel for more rows). So this is measured, not
assumed: ``probe`` runs the model's own layers, on this device, both ways, and the verify call then
computes per row exactly the operations that need it (attention, logits), the rest batched:

- GatedDeltaNet layers always run their conv and recurrence per row in a verify call (they record the
  state after every row for the rollback anyway: ``models.layers``);
- MoE routing is locked to decode's routes (``moe``);
- ``per_row_attention``: each row attends to the keys up to itself, a decode step's shape;
- ``per_row_logits``: the lm_head runs per row;
- ``per_row_linears``: the linear layers of a shape whose matmul rounds a block of rows differently from
  one row (MLX CUDA picks another bf16 GEMM kernel for one row than for several: for exo-demo only
  ``mlp.up_proj`` and the lm_head, bench/results/h100-mlx-cuda-row-count.txt) run per row, every other
  matmul of the call stays batched. Each distinct linear shape is probed once, on random rows; they run
  per row only when that makes the layers' probes exact (on an H100 the exo-demo GatedDeltaNet layer
  still differed with its one flagged shape per row, so there nothing runs per row).

- quantized linear layers on MLX CUDA run exo's kernel (``kernels.cuda_qgemv``, set at load) for the decode
  step and the verify rows alike, every row summed alone by construction: the probe finds their blocks equal;
- the MoE experts: ``moe`` becomes ``safe`` (the whole block row by row) where the experts' batched rows
  differ from their rows alone with the same routes.

Attention is probed after a short context and after one as long as a decode step's (``PROBE_CONTEXTS``): MLX
CUDA's fused attention kernels lack Qwen3.5's head dimension of 256, and its unfused path multiplies a block of
queries by the keys with cuBLAS, whose kernels for one query row and for several may agree over 10 keys and
not over 250.

When even that leaves a difference, ``exact`` is False and the engine re-decodes near ties plainly
(``EngineConfig.greedy_tie_margin``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from .models import layers as model_layers
from .models.backbone import SpeculativeBackbone
from .models.layers import MoEVerifyMode, RollbackArraysCache, experts_unsorted, make_rowwise

VerifyRows = Literal["auto", "per_row", "batched"]
PROBE_ROWS = 4
PROBE_PREFIX = 6
PROBE_CONTEXTS = (PROBE_PREFIX, 250)  # cached positions before the probed rows of an attention layer


@dataclass(frozen=True)
class VerifyMode:
    moe: MoEVerifyMode = "route_locked"
    per_row_attention: bool = False
    per_row_logits: bool = False
    exact: bool = True  # every verify row equals its decode step (measured by ``probe``)
    per_row_linears: int = 0  # linear layers computed row by row in a verify call (``probe``)
    logits_as_vectors: bool = False  # per-row logits in one call (``models.layers.vector_matmul``), measured equal

    @classmethod
    def forced(cls, moe: MoEVerifyMode, rows: VerifyRows) -> VerifyMode:
        per_row = rows == "per_row"
        return cls(moe, per_row, per_row)


def verify_logits(model: SpeculativeBackbone, hidden: mx.array, mode: VerifyMode) -> mx.array:
    """Logits [1, T, V] of a verify call's hiddens, per row when this device needs it."""
    if hidden.shape[1] == 1:
        return model.logits(hidden)
    if not mode.per_row_logits:
        return model.logits(hidden)
    if mode.logits_as_vectors:
        weight = model.output_weight()
        assert weight is not None
        return model_layers.vector_matmul(hidden, weight)
    return mx.concatenate([model.logits(hidden[:, t : t + 1]) for t in range(hidden.shape[1])], axis=1)


def probe(model: SpeculativeBackbone, moe: MoEVerifyMode) -> tuple[VerifyMode, dict[str, bool]]:
    """Which parts of a verify call must run per row on this device, from the model's own layers: each
    layer kind of this stage (GatedDeltaNet, full attention) and the lm_head, a block of rows against
    one-row decode steps on the same cache. Returns the mode and what was found (name -> rows equal)."""
    layers = model.stage_layers
    dtype = layers[0].input_layernorm.weight.dtype
    key = mx.random.key(20261123)
    prefix = (mx.random.normal((1, PROBE_PREFIX, model.hidden_size), key=key) * 0.5).astype(dtype)
    rows = (mx.random.normal((1, PROBE_ROWS, model.hidden_size), key=mx.random.split(key)[0]) * 0.5).astype(dtype)
    found: dict[str, bool] = {}
    per_row_logits = logits_as_vectors = False
    if model.last_stage:
        single = mx.concatenate([model.logits(rows[:, t : t + 1]) for t in range(PROBE_ROWS)], axis=1)
        found["logits_batched"] = _rows_equal(model.logits, rows, single)
        per_row_logits = not found["logits_batched"]
        weight = model.output_weight()
        if per_row_logits and weight is not None:
            vectors = model_layers.vector_matmul(rows, weight)
            found["logits rows as vectors"] = logits_as_vectors = bool(mx.array_equal(vectors, single).item())
    # A device whose lm_head rounds a block of rows unlike one row rounds other matmuls so too, on other
    # values than the probe's (exo-demo-moe on an H100: every linear shape equal on random rows, one
    # greedy run in twelve apart): then every linear layer goes as one-row products where it can.
    sensitive, linears_found = _row_count_sensitive_linears(
        layers, dtype, key, matmul_rounds_by_rows=per_row_logits or not found.get("logits_batched", True))
    found.update(linears_found)
    model.set_rowwise_linears(sensitive)
    experts_same = _experts_row_invariant(model, dtype, key)
    if experts_same is not None:
        found["experts_batched"] = experts_same
        if not experts_same and moe == "route_locked":
            moe = "safe"  # the experts' rows as alone too: the whole block row by row

    def same_as_decode(layer: Any, per_row_attention: bool, context: int = PROBE_PREFIX) -> bool:
        decode, verify = _layer_cache(layer), _layer_cache(layer)
        before = prefix if context == PROBE_PREFIX else (
            mx.random.normal((1, context, model.hidden_size), key=mx.random.split(key, 3)[2]) * 0.5).astype(dtype)
        for cache in (decode, verify):
            layer(before, mask="causal" if not layer.is_linear else None, cache=cache)
        stepwise = mx.concatenate([layer(rows[:, t : t + 1], mask=None, cache=decode) for t in range(PROBE_ROWS)],
                                  axis=1)
        if isinstance(verify, RollbackArraysCache):
            verify.recording = True
        model.set_verify_mode(moe, per_row_attention)
        try:
            block = layer(rows, mask=None if layer.is_linear else "causal", cache=verify)
        finally:
            model.set_verify_mode(None, False)
            if isinstance(verify, RollbackArraysCache):
                verify.recording = False
        mx.eval(stepwise, block)
        return bool(mx.array_equal(stepwise, block).item())

    linear = next((layer for layer in layers if layer.is_linear), None)
    attention = next((layer for layer in layers if not layer.is_linear), None)
    exact = True
    if linear is not None:
        found["gated_delta_layer"] = same_as_decode(linear, False)
        exact &= found["gated_delta_layer"]
    per_row_attention = False
    if attention is not None:
        for context in PROBE_CONTEXTS:
            suffix = "" if context == PROBE_PREFIX else f" after {context}"
            found["attention_layer_batched" + suffix] = same_as_decode(attention, False, context)
            per_row_attention |= not found["attention_layer_batched" + suffix]
        if per_row_attention:
            for context in PROBE_CONTEXTS:
                suffix = "" if context == PROBE_PREFIX else f" after {context}"
                found["attention_layer_per_row" + suffix] = same_as_decode(attention, True, context)
                exact &= found["attention_layer_per_row" + suffix]
    if sensitive and not exact:
        # Even so the layers differ from decode steps: linears computed one call per row would cost time
        # and buy no guarantee (the near-tie fallback covers what is left), so only the one-call batches
        # of one-row products stay (they cost about what the block of rows costs).
        sensitive = [linear for linear in sensitive if linear.as_vectors]
        model.set_rowwise_linears(sensitive)
    return VerifyMode(moe, per_row_attention, per_row_logits, exact, len(sensitive), logits_as_vectors), found


def _row_count_sensitive_linears(
    layers: list[Any], dtype: mx.Dtype, key: mx.array, *, matmul_rounds_by_rows: bool = False
) -> tuple[list[nn.Module], dict[str, bool]]:
    """The linear layers (of ``layers``) a verify call computes row by row, and per shape what was found
    (``"linear 256->1024 bfloat16": True`` when a block of rows equals the same rows one at a time).

    When no shape differs (and ``matmul_rounds_by_rows`` does not say otherwise), none. When one does, the device's matmul rounds by row
    count, and on random rows a probe sees only part of it (on MLX CUDA other shapes differ on other values), so
    every shape whose rows can go as one-row products in one call (``models.layers.vector_matmul``: checked equal
    to the one-row calls here) goes that way, and the shapes found to differ that cannot, go one call per row."""
    shapes: dict[tuple[Any, ...], list[nn.Module]] = {}
    for layer in layers:
        for _, module in layer.named_modules():
            if isinstance(module, (nn.Linear, nn.QuantizedLinear)):
                bits = getattr(module, "bits", None)
                signature = (tuple(module.weight.shape), bits, getattr(module, "group_size", None), "bias" in module)
                shapes.setdefault(signature, []).append(module)
    found: dict[str, bool] = {}
    probed: list[tuple[str, list[nn.Module], mx.array, mx.array, bool]] = []
    for signature, modules in shapes.items():
        module = modules[0]
        out_dims, in_dims = module.weight.shape
        if signature[1] is not None:
            in_dims = in_dims * 32 // signature[1]
        rows = (mx.random.normal((1, PROBE_ROWS, in_dims), key=key) * 0.5).astype(dtype)
        single = mx.concatenate([module(rows[:, t : t + 1]) for t in range(PROBE_ROWS)], axis=1)
        same = _rows_equal(module, rows, single)
        quantized = f" {signature[1]}-bit" if signature[1] is not None else ""
        name = f"linear {in_dims}->{out_dims} {dtype}{quantized}".replace("mlx.core.", "")
        found[name] = same
        probed.append((name, modules, rows, single, same))
    differs = matmul_rounds_by_rows or not all(same for *_, same in probed)
    chosen: list[nn.Module] = []
    for name, modules, rows, single, same in probed:
        module = modules[0]
        if not differs:
            continue
        if model_layers.vectors_apply(module):
            vectors = model_layers.vector_matmul(rows, modules[0].weight)
            found[f"{name} rows as vectors"] = bool(mx.array_equal(vectors, single).item())
        if found.get(f"{name} rows as vectors"):
            for each in modules:
                make_rowwise(each)
                each.as_vectors = True
            chosen.extend(modules)
        elif not same:
            chosen.extend(modules)
    return chosen, found


def _layer_cache(layer: Any) -> Any:
    return RollbackArraysCache() if layer.is_linear else KVCache()


def _rows_equal(fn: Any, rows: mx.array, single: mx.array) -> bool:
    """Whether ``fn`` of the first r rows equals ``single`` (the rows one at a time) there, for every r from 2 to
    all of them: a verify call has K + 1 rows, and a library may take another kernel at another row count."""
    blocks = [fn(rows[:, :r]) for r in range(2, rows.shape[1] + 1)]
    mx.eval(single, blocks)
    return all(bool(mx.array_equal(b, single[:, : b.shape[1]]).item()) for b in blocks)


def _experts_row_invariant(model: SpeculativeBackbone, dtype: mx.Dtype, key: mx.array) -> bool | None:
    """Whether the first MoE block's experts compute a block of rows (each with its own routes) as each row alone,
    the path a verify call's routed rows take; None without MoE blocks. On MLX CUDA a few (row, expert) pairs go
    through ``gather_qmv`` and from 8 on through ``qmm_sm80`` (a one-row step of a top-2 model takes the first, its
    4-row verify the second), and from 64 on mlx-lm sorts the pairs by expert."""
    block = next(model.moe_blocks(), None)
    if block is None:
        return None
    switch = block.switch_mlp
    experts = switch.down_proj.num_experts
    top_k = min(block.top_k, experts)
    k1, k2 = mx.random.split(mx.random.split(key, 4)[3])
    x = (mx.random.normal((1, PROBE_ROWS, switch.up_proj.input_dims), key=k1) * 0.5).astype(dtype)
    inds = mx.argsort(mx.random.uniform(shape=(1, PROBE_ROWS, experts), key=k2), axis=-1)[..., :top_k]
    inds = inds.astype(mx.uint32)

    def run(x: mx.array, inds: mx.array) -> mx.array:
        if block.sort_experts and not block.unsorted_in_batch:
            return switch(x, inds)
        return experts_unsorted(switch, x, inds)

    single = mx.concatenate([run(x[:, t : t + 1], inds[:, t : t + 1]) for t in range(PROBE_ROWS)], axis=1)
    blocks = [run(x[:, :r], inds[:, :r]) for r in range(2, PROBE_ROWS + 1)]
    mx.eval(single, blocks)
    return all(bool(mx.array_equal(b, single[:, : b.shape[1]]).item()) for b in blocks)

