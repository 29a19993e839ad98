"""Tensor sharding: every member of a tensor group holds a slice of every layer, joined by an all-reduce.

The rules, per layer kind (member r of N):

- full attention: query heads [r*h/N, (r+1)*h/N) (the gated ``q_proj`` of Qwen3.5/3.6/Next interleaves each
  head's query and output gate, so a head's rows move together), the key/value heads those queries use (a
  key/value head serves h/hkv query heads: with fewer key/value heads than members each member holds a copy of
  its one), ``o_proj``'s matching input columns; each member keeps its own heads' KV cache.
- GatedDeltaNet: value heads [r*nv/N, (r+1)*nv/N) and the key heads they read (copied when nk < N), the same
  channels of the fused input projections (Qwen3.5's ``in_proj_qkv`` / ``z`` / ``b`` / ``a``, Qwen3-Next's
  per-key-head ``in_proj_qkvz`` / ``in_proj_ba`` groups) and of the conv, ``A_log`` / ``dt_bias`` of those
  heads, ``out_proj``'s matching input columns; each member keeps its own heads' conv window and recurrent
  state (so its rollback is local).
- dense MLP and every expert of an MoE block (and the shared expert): intermediate columns [r*I/N, (r+1)*I/N)
  of ``gate_proj`` / ``up_proj``, the same input columns of ``down_proj``. The router and the shared expert's
  gate stay whole on every member (each computes the same routing from the same input).
- the embedding stays whole on every member (each embeds the step's ids itself); the final norm, ``lm_head``
  and the MTP head are the leader's alone (the decode loop, drafting and acceptance run there only).

A layer's attention (or GatedDeltaNet) output and its MLP output are partial sums on every member: the decoder
layer all-reduces each (``TensorLayer``), two collectives per layer, always the same two whatever the verify
or batch mode computes row by row, so every member runs the same collectives in the same order. The
collectives are live only while a tensor forward builds a step (``collectives``): anything else that runs a
layer (the verify probe, a cost measurement) computes this member's part alone.

Quantized layers split on group boundaries: a column split needs every member's columns to start on a
quantization group (``split_problem`` says which splits a checkpoint allows, and why not).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

MAX_TENSOR_NODES = 8  # the splits placement considers (a split of more members is allowed when asked for)


class TensorShardingError(ValueError):
    """A model that cannot be split this way (heads or columns that do not divide, quantization groups)."""


@dataclass
class TensorShare:
    """The group a model's sharded layers reduce over, and whether a tensor forward is building a step."""

    group: Any  # mx.distributed.Group
    rank: int
    size: int
    active: bool = False

    @property
    def leader(self) -> bool:
        return self.rank == self.size - 1


def member_process_settings(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """A tensor member's process-wide MLX settings, set before its first evaluation (MLX reads them once a process):
    MLX CUDA's graphs off (``MLX_USE_CUDA_GRAPHS=0``) unless the user set them. On 2 x H200 (MLX 0.32.4, NCCL) a
    9B group of 2 decoded 13.0 tok/s with them and 54.0 without (one GPU alone 95.2 without, 131 with): a step's
    ~130 all-reduces cut its graph into pieces that MLX captures and launches anew each step (bench/results/
    h200x2-mlx-cuda-compiled-pipeline-tensor-no-graphs-2026-11-30.txt). Returns what it set."""
    environ = os.environ if environ is None else environ
    wanted = {"MLX_USE_CUDA_GRAPHS": "0"}
    changed = {k: v for k, v in wanted.items() if k not in environ}
    environ.update(changed)
    return changed


def reduce_partial(share: TensorShare | None, x: mx.array) -> mx.array:
    """A sharded layer's partial sum ``x`` summed over the group while a tensor forward builds a step (else ``x``)."""
    if share is None or not share.active:
        return x
    return mx.distributed.all_sum(x, group=share.group)


class TensorLayer:
    """A decoder layer of a tensor-sharded model: its mixer's and its MLP's outputs are partial sums, each
    all-reduced before the residual add (mlx-lm's decoder layer ``__call__`` otherwise)."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        share = self.__dict__.get("_tensor_share")
        if self.is_linear:  # type: ignore[attr-defined]
            r = self.linear_attn(self.input_layernorm(x), mask, cache)  # type: ignore[attr-defined]
        else:
            r = self.self_attn(self.input_layernorm(x), mask, cache)  # type: ignore[attr-defined]
        h = x + reduce_partial(share, r)
        return h + reduce_partial(share, self.mlp(self.post_attention_layernorm(h)))  # type: ignore[attr-defined]


_TENSOR_CLASSES: dict[type, type] = {}


def _tensor_layer(layer: nn.Module, share: TensorShare) -> None:
    cls = type(layer)
    if not issubclass(cls, TensorLayer):
        if cls not in _TENSOR_CLASSES:
            _TENSOR_CLASSES[cls] = type(f"Tensor{cls.__name__}", (TensorLayer, cls), {})
        layer.__class__ = _TENSOR_CLASSES[cls]
    object.__setattr__(layer, "_tensor_share", share)  # not a child module: no parameters


@contextlib.contextmanager
def collectives(model: Any) -> Iterator[None]:
    """While a tensor forward builds a step: the sharded layers all-reduce (the graph keeps the collectives)."""
    share: TensorShare | None = getattr(model, "tensor_share", None)
    if share is None:
        yield
        return
    share.active = True
    try:
        yield
    finally:
        share.active = False


def broadcast_ids(model: Any, tokens: mx.array | None, shape: tuple[int, ...]) -> mx.array:
    """The step's token ids on every member, inside the step's graph: the leader's ``tokens`` summed with the
    others' zeros. The leader sends its header without waiting for its ids (the drafts, the last sampled
    token: lazy), and builds the step while they compute; its own step uses the broadcast too, so the
    collective is in its graph as in every member's."""
    share: TensorShare = model.tensor_share
    ids = tokens.astype(mx.int32) if tokens is not None else mx.zeros(shape, dtype=mx.int32)
    return mx.distributed.all_sum(ids, group=share.group).astype(mx.uint32)


# -- which splits a checkpoint allows ---------------------------------------------------------------------


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config", config)


def _group_size(config: dict[str, Any]) -> int | None:
    quant = config.get("quantization") or config.get("quantization_config")
    if isinstance(quant, dict) and "group_size" in quant:
        return int(quant["group_size"])
    return None


def _heads_split(kind: str, heads: int, shared: int, n: int) -> str | None:
    """``heads`` split n ways, each reading ``shared`` heads (key/value heads): n divides heads, and shared
    divides by n or n by shared."""
    if heads % n:
        return f"its {heads} {kind} heads do not divide among {n} nodes"
    if shared % n and n % shared:
        return f"its {shared} key heads ({kind}) neither divide among {n} nodes nor evenly into them"
    return None


def split_problem(config: dict[str, Any], n: int) -> str | None:
    """Why a checkpoint (its ``config.json``) cannot be split over ``n`` nodes by tensor, or None."""
    if n < 2:
        return None
    text = _text_config(config)
    gs = _group_size(config)
    problems = []
    h, hkv, d = (int(text.get(k) or 0) for k in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    if h:
        problems.append(_heads_split("attention", h, hkv or h, n))
        if gs and not problems[-1] and (h // n * d) % gs:
            problems.append(f"its attention output columns ({h // n * d} a node) do not start on {gs}-wide "
                            "quantization groups")
    nk, nv, dv = (int(text.get(k) or 0) for k in ("linear_num_key_heads", "linear_num_value_heads",
                                                  "linear_value_head_dim"))
    if nv:
        problems.append(_heads_split("GatedDeltaNet value", nv, nk or nv, n))
        if gs and not problems[-1] and (nv // n * dv) % gs:
            problems.append(f"its GatedDeltaNet output columns ({nv // n * dv} a node) do not start on "
                            f"{gs}-wide quantization groups")
    widths = {"intermediate_size": "MLP", "moe_intermediate_size": "expert",
              "shared_expert_intermediate_size": "shared expert"}
    experts = int(text.get("num_experts") or 0)
    for key, what in widths.items():
        width = int(text.get(key) or 0)
        if not width or (key == "intermediate_size" and experts and config.get("model_type") != "qwen3_next"):
            continue  # (Qwen3.5-MoE has no dense MLP; Qwen3-Next may keep dense layers)
        if width % n:
            problems.append(f"its {what} width {width} does not divide among {n} nodes")
        elif gs and (width // n) % gs:
            problems.append(f"its {what} columns ({width // n} a node) do not start on {gs}-wide quantization groups")
    problems = [p for p in problems if p]
    return "; ".join(problems) or None


def tensor_node_counts(config: dict[str, Any], most: int = MAX_TENSOR_NODES) -> list[int]:
    """The node counts (2..``most``) a checkpoint can be split over by tensor."""
    return [n for n in range(2, most + 1) if split_problem(config, n) is None]


# -- slicing a layer's parameters ---------------------------------------------------------------------------


def _take_rows(module: nn.Module, rows: Sequence[int]) -> None:
    """Keep these output rows of a linear (plain, quantized, or a switch layer's experts) or conv layer."""
    index = mx.array(list(rows), dtype=mx.uint32)
    update = {}
    for name in ("weight", "scales", "biases", "bias"):
        value = module.get(name) if hasattr(module, "get") else None
        if not isinstance(value, mx.array):
            continue
        if name == "bias":
            axis = value.ndim - 1
        elif isinstance(module, nn.Conv1d):
            axis = 0
        else:
            axis = value.ndim - 2
        update[name] = mx.take(value, index, axis=axis)
    module.update(update)


def _take_columns(module: nn.Module, lo: int, hi: int, what: str) -> None:
    """Keep input columns [lo, hi) of a linear (plain, quantized, or a switch layer's experts)."""
    weight = module["weight"]
    scales = module.get("scales")
    if isinstance(scales, mx.array):
        group = int(module.group_size)
        inputs = scales.shape[-1] * group
        if lo % group or hi % group:
            raise TensorShardingError(f"{what}: input columns [{lo}, {hi}) do not start on {group}-wide "
                                      "quantization groups")
        packed = weight.shape[-1]
        update = {"weight": weight[..., lo * packed // inputs : hi * packed // inputs],
                  "scales": scales[..., lo // group : hi // group]}
        biases = module.get("biases")
        if isinstance(biases, mx.array):
            update["biases"] = biases[..., lo // group : hi // group]
    else:
        update = {"weight": weight[..., lo:hi]}
    module.update({k: mx.contiguous(v) for k, v in update.items()})


def _span(total: int, rank: int, n: int) -> range:
    return range(rank * total // n, (rank + 1) * total // n)


def _read_heads(mine: range, heads: int, shared: int) -> list[int]:
    """The shared (key/value) heads that query heads ``mine`` read, ``heads`` of them sharing ``shared``."""
    per = heads // shared
    return sorted({i // per for i in mine})


def _channels(heads: Sequence[int], dim: int, offset: int = 0) -> list[int]:
    return [offset + head * dim + i for head in heads for i in range(dim)]


def shard_attention(attn: nn.Module, rank: int, n: int) -> None:
    h, hkv, d = attn.num_attention_heads, attn.num_key_value_heads, attn.head_dim
    problem = _heads_split("attention", h, hkv, n)
    if problem:
        raise TensorShardingError(f"attention: {problem}")
    queries = _span(h, rank, n)
    kv = _read_heads(queries, h, hkv)
    _take_rows(attn.q_proj, _channels(queries, 2 * d))  # each head's query and output gate, interleaved
    _take_rows(attn.k_proj, _channels(kv, d))
    _take_rows(attn.v_proj, _channels(kv, d))
    _take_columns(attn.o_proj, queries.start * d, queries.stop * d, "attention o_proj")
    attn.num_attention_heads, attn.num_key_value_heads = len(queries), len(kv)


def shard_gated_delta(gdn: nn.Module, rank: int, n: int) -> None:
    nk, nv, dk, dv = gdn.num_k_heads, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim
    problem = _heads_split("GatedDeltaNet value", nv, nk, n)
    if problem:
        raise TensorShardingError(f"GatedDeltaNet: {problem}")
    values = _span(nv, rank, n)
    keys = _read_heads(values, nv, nk)
    key_dim = nk * dk
    conv = _channels(keys, dk) + _channels(keys, dk, key_dim) + _channels(values, dv, 2 * key_dim)
    if hasattr(gdn, "in_proj_qkvz"):  # Qwen3-Next: per key head, [q, k, v of its value heads, z of them]
        per = nv // nk
        group = 2 * dk + 2 * per * dv
        qkvz: list[int] = []
        ba: list[int] = []
        for head in keys:
            own = [j - head * per for j in values if j // per == head]
            base = head * group
            qkvz += list(range(base, base + 2 * dk))
            qkvz += _channels(own, dv, base + 2 * dk)
            qkvz += _channels(own, dv, base + 2 * dk + per * dv)
            ba += [head * 2 * per + j for j in own] + [head * 2 * per + per + j for j in own]
        _take_rows(gdn.in_proj_qkvz, qkvz)
        _take_rows(gdn.in_proj_ba, ba)
    else:  # Qwen3.5 / 3.6: [q of every key head, k of every key head, v of every value head], z, b, a per value head
        _take_rows(gdn.in_proj_qkv, conv)
        _take_rows(gdn.in_proj_z, _channels(values, dv))
        _take_rows(gdn.in_proj_b, list(values))
        _take_rows(gdn.in_proj_a, list(values))
    _take_rows(gdn.conv1d, conv)
    index = mx.array(list(values), dtype=mx.uint32)
    gdn.A_log = mx.take(gdn.A_log, index)
    gdn.dt_bias = mx.take(gdn.dt_bias, index)
    _take_columns(gdn.out_proj, values.start * dv, values.stop * dv, "GatedDeltaNet out_proj")
    gdn.num_k_heads, gdn.num_v_heads = len(keys), len(values)
    gdn.key_dim, gdn.value_dim = len(keys) * dk, len(values) * dv
    gdn.conv_dim = 2 * gdn.key_dim + gdn.value_dim
    gdn.conv1d.groups = gdn.conv_dim


def _shard_glu(gate: nn.Module, up: nn.Module, down: nn.Module, width: int, rank: int, n: int, what: str) -> None:
    if width % n:
        raise TensorShardingError(f"{what}: width {width} does not divide among {n} nodes")
    mine = _span(width, rank, n)
    _take_rows(gate, list(mine))
    _take_rows(up, list(mine))
    _take_columns(down, mine.start, mine.stop, f"{what} down_proj")


def _output_width(module: nn.Module) -> int:
    return int(module["weight"].shape[-2])


def shard_mlp(mlp: nn.Module, rank: int, n: int) -> None:
    if hasattr(mlp, "switch_mlp"):  # a sparse MoE block: every expert's columns, the shared expert's
        switch = mlp.switch_mlp
        _shard_glu(switch.gate_proj, switch.up_proj, switch.down_proj, _output_width(switch.gate_proj), rank, n,
                   "MoE experts")
        shared = mlp.shared_expert
        _shard_glu(shared.gate_proj, shared.up_proj, shared.down_proj, _output_width(shared.gate_proj), rank, n,
                   "shared expert")
        return
    _shard_glu(mlp.gate_proj, mlp.up_proj, mlp.down_proj, _output_width(mlp.gate_proj), rank, n, "MLP")


def shard_model(model: Any, share: TensorShare) -> None:
    """Keep member ``share.rank``'s slice of every layer of ``model`` (lazily loaded: only the slices are
    evaluated afterwards); its layers then all-reduce over ``share.group`` inside ``collectives``. Raises
    ``TensorShardingError`` when the model does not split this way (before anything is changed)."""
    problem = split_problem_of(model, share.size)
    if problem:
        raise TensorShardingError(f"this model cannot be split over {share.size} nodes by tensor: {problem}")
    for layer in model.text_model.layers:
        if layer.is_linear:
            shard_gated_delta(layer.linear_attn, share.rank, share.size)
        else:
            shard_attention(layer.self_attn, share.rank, share.size)
        shard_mlp(layer.mlp, share.rank, share.size)
        _tensor_layer(layer, share)
    object.__setattr__(model, "tensor_share", share)  # not a child module: no parameters


def split_problem_of(model: Any, n: int) -> str | None:
    """``split_problem`` from a loaded model's own layers (heads and widths as built, quantization groups as
    its layers are quantized)."""
    args = model.text_args
    config: dict[str, Any] = {
        "num_attention_heads": args.num_attention_heads, "num_key_value_heads": args.num_key_value_heads,
        "head_dim": getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads,
        "linear_num_key_heads": args.linear_num_key_heads, "linear_num_value_heads": args.linear_num_value_heads,
        "linear_value_head_dim": args.linear_value_head_dim,
    }
    groups = {int(m.group_size) for layer in model.text_model.layers for _, m in layer.named_modules()
              if isinstance(m, nn.QuantizedLinear)}
    if groups:
        config["quantization"] = {"group_size": max(groups)}
    problem = split_problem(config, n)
    if problem:
        return problem
    for layer in model.text_model.layers:
        mlp = layer.mlp
        parts = ([mlp.switch_mlp.gate_proj, mlp.shared_expert.gate_proj] if hasattr(mlp, "switch_mlp")
                 else [mlp.gate_proj])
        for part in parts:
            width = _output_width(part)
            if width % n:
                return f"an MLP width {width} does not divide among {n} nodes"
            group = getattr(part, "group_size", None)
            if group and (width // n) % group:
                return f"MLP columns ({width // n} a node) do not start on {group}-wide quantization groups"
    return None
