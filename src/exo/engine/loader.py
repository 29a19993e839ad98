"""Loading checkpoints from disk: the backbone through mlx-lm, the MTP head by exo.

Layouts handled (as users have them on disk):
- raw Hugging Face (the official Qwen files): ``model-*.safetensors`` + index, head as ``mtp.*`` in the
  last shard, zero-centred norms, experts per expert or fused;
- MLX (mlx-lm conversions, quantized or not): head as ``language_model.mtp.*`` (Qwen3.5/3.6) or ``mtp.*``
  (Qwen3-Next) inside the shards, or a sidecar ``mtp.safetensors`` kept outside mlx-lm's
  ``model*.safetensors`` glob; stock conversions (mlx-community) have no head at all.

Whether the head's norms need the ``+1`` shift is decided by provenance, never by weight values:
a head inside the shards follows the backbone (mlx-lm's own signal: an unsanitized ``conv1d`` weight
means raw Hugging Face); a sidecar follows its safetensors metadata (``exo.norm_convention`` if set,
else ``format: mlx`` means MLX convention and anything else means raw Hugging Face).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import infer_quant_config, load_tokenizer
from mlx_lm.utils import load_model as mlx_load_model
from safetensors import safe_open

from .models import SUPPORTED_MODEL_TYPES, UnsupportedModelError, get_model_classes, stage_model_classes
from .models.backbone import SpeculativeBackbone
from .models.fused_inputs import use_fused_inputs
from .models.layers import (
    SparseMoeBlock,
    check_expert_sort,
    experts_unsorted,
    use_attn_kernel,
    use_gdn_kernel,
    use_long_attention,
    use_qgemv,
)
from .models.mtp import HEAD_NORM_SUFFIXES, MTPHead
from .models.padded_rows import use_padded_rows
from .models.prompt_dense import use_prompt_dense
from .sharding import TensorShardingError, TensorShare, shard_model

SIDECAR_NAMES = ("mtp.safetensors",)
# Written next to the weights by head recovery (exo.downloads.heads) when it refused a head: the reason.
HEAD_RECOVERY_NOTE = "mtp_recovery.json"
HEAD_PREFIXES = ("language_model.mtp.", "model.mtp.", "mtp.")
NormConvention = Literal["hf", "mlx"]


class CheckpointError(ValueError):
    """A checkpoint directory is missing, incomplete or malformed."""


class MTPHeadError(CheckpointError):
    """The checkpoint's MTP head tensors are incomplete or do not fit the backbone."""


@dataclass(frozen=True)
class HeadInfo:
    """Where a checkpoint's MTP head is and what it looks like (before loading it)."""

    declared_layers: int  # mtp_num_hidden_layers / num_nextn_predict_layers in config.json (0: none)
    files: tuple[Path, ...] = ()  # files holding the head tensors
    keys: tuple[str, ...] = ()  # full tensor names in those files
    prefix: str = ""
    source: Literal["in-shard", "sidecar"] | None = None
    norm_convention: NormConvention = "hf"

    @property
    def present(self) -> bool:
        return bool(self.keys)


@dataclass
class HeadStatus:
    """Whether native MTP can run on a loaded checkpoint, and why not."""

    available: bool
    reason: str | None = None
    source: str | None = None
    norm_convention: NormConvention | None = None
    quantized: bool = False
    moe: bool = False
    expert_layout: str | None = None  # per_expert | fused | stacked


@dataclass
class LoadedModel:
    """A backbone, its tokenizer and (when usable) its MTP head, ready for the engine."""

    path: Path
    model_id: str
    model: Any  # an exo.engine.models.* Model (mlx-lm Model + SpeculativeBackbone)
    tokenizer: Any  # mlx_lm TokenizerWrapper
    config: dict[str, Any]
    head: MTPHead | None
    head_status: HeadStatus
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    # Per quantized layer shape, whether its decode-sized products run exo's kernel (``layers.use_qgemv``)
    qgemv: dict[str, str] = field(default_factory=dict)
    # Per quantized layer shape, whether its calls of few rows are padded to MLX's tiled product
    # (``models.padded_rows``, ``EXO_PAD_ROWS``; off by default)
    padded: dict[str, str] = field(default_factory=dict)
    # Per quantized layer shape (and the MoE experts), from how many rows a call runs on the weights dequantized
    # (``models.prompt_dense``, ``EXO_PROMPT_DENSE``: on MLX CUDA by default)
    dense: dict[str, str] = field(default_factory=dict)
    # Per GatedDeltaNet layer shape, whether its decode steps and verify rows run exo's kernel (``use_gdn_kernel``)
    gdn: dict[str, str] = field(default_factory=dict)
    # Per GatedDeltaNet layer shape, whether its input projections run as one product (``models.fused_inputs``,
    # ``EXO_FUSED_INPUTS``: on wherever its check finds the same bits)
    fused: dict[str, str] = field(default_factory=dict)
    # Per attention layer shape, whether its decode steps and verify rows run exo's attention kernel
    # (``use_attn_kernel``, ``EXO_ATTN_KERNEL``: on by default on MLX CUDA)
    attn: dict[str, str] = field(default_factory=dict)
    # Seconds the load spent per part ("weights", then each device check: on MLX CUDA a first load on a machine
    # spends most of it compiling kernels, kept under MLX_PTX_CACHE_DIR for later loads)
    load_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def backbone(self) -> SpeculativeBackbone:
        return self.model

    def kernels(self) -> str:
        """What the load's device checks chose, one line (a runner logs it: two loads of one model that run at
        different speeds show here whether a check chose differently): per kind, the shapes whose check passed
        of those checked, e.g. "qgemv 6/6, dense 6/6, gdn 2/2, fused 1/1, attn 1/1"."""
        kinds = {"qgemv": self.qgemv, "padded": self.padded, "dense": self.dense, "gdn": self.gdn,
                 "fused": self.fused, "attn": self.attn}
        parts = [f"{kind} {sum(v.startswith('ok') for v in found.values())}/{len(found)}"
                 for kind, found in kinds.items() if found]
        return ", ".join(parts) or "no device checks (none apply here)"

    @property
    def context_length(self) -> int | None:
        text = self.config.get("text_config", self.config)
        value = text.get("max_position_embeddings") or self.config.get("max_position_embeddings")
        return int(value) if value else None


# ---------------------------------------------------------------------------------------------------
# Inspection (headers only, nothing loaded)


def read_config(path: Path) -> dict[str, Any]:
    config_file = path / "config.json"
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory")
    if not config_file.is_file():
        raise CheckpointError(f"{path} has no config.json: not a Hugging Face / MLX checkpoint directory")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{config_file} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file} must hold a JSON object")
    if config.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{path}: model_type {config.get('model_type')!r} is not supported; exo runs "
            f"{', '.join(SUPPORTED_MODEL_TYPES)} (Qwen3.5 / Qwen3.6 dense and MoE, Qwen3-Next)"
        )
    return config


def declared_head_layers(config: dict[str, Any]) -> int:
    text = config.get("text_config") or {}
    for source in (text, config):
        for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
            if source.get(key):
                return int(source[key])
    return 0


def weight_files(path: Path) -> list[Path]:
    """The backbone's shards (mlx-lm's glob), checked against the index when there is one."""
    files = sorted(path.glob("model*.safetensors"))
    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text()).get("weight_map", {})
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{index_file} is not valid JSON: {e}") from e
        missing = sorted({name for name in weight_map.values() if not (path / name).is_file()})
        if missing:
            raise CheckpointError(
                f"{path}: model.safetensors.index.json lists shards that are not on disk: "
                f"{', '.join(missing)} (incomplete download? fetch the missing files again)"
            )
    if not files:
        raise CheckpointError(f"{path} has no model*.safetensors weight files")
    return files


def stage_weight_files(path: Path, start: int, end: int, config: dict[str, Any]) -> tuple[list[Path], bool]:
    """The shards a pipeline stage running layers [start, end) loads, and whether the checkpoint is partial.

    A stage's download (``exo.downloads.stages``) fetches only the shards that hold the stage's tensors, so
    shards the index lists for other stages may be absent: that is a partial checkpoint, loadable for this
    stage only. A shard the stage needs that is absent is a ``CheckpointError`` naming it.
    """
    index_file = path / "model.safetensors.index.json"
    if not index_file.is_file():
        return weight_files(path), False
    try:
        weight_map = json.loads(index_file.read_text()).get("weight_map", {})
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{index_file} is not valid JSON: {e}") from e
    absent = {name for name in weight_map.values() if not (path / name).is_file()}
    if not absent:
        return weight_files(path), False
    text = config.get("text_config") or config
    n_layers = int(text.get("num_hidden_layers") or 0)
    first, last = start == 0, end == n_layers
    needed = sorted({file for tensor, file in weight_map.items()
                     if file in absent and _stage_needs(tensor, start, end, first, last)})
    if needed:
        raise CheckpointError(
            f"{path}: layers [{start}, {end}) need {', '.join(needed)}, which model.safetensors.index.json "
            "lists but is not on disk (incomplete download? fetch the stage's files again)"
        )
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} has no model*.safetensors weight files")
    raw = any(name.startswith("model.language_model.") for name in weight_map)
    if raw and config.get("model_type") in ("qwen3_5", "qwen3_5_moe") and not _has_conv1d(files):
        # mlx-lm tells raw norms (zero-centred, shifted +1 when loaded) from MLX ones by the conv1d weights'
        # layout; a stage of full-attention layers only, without the other shards, has none to look at.
        raise CheckpointError(
            f"{path}: layers [{start}, {end}) of a raw checkpoint hold no linear-attention layer, and the "
            "shards of the others are not on disk: download the whole model for this stage"
        )
    return files, True


def _stage_needs(tensor: str, start: int, end: int, first: bool, last: bool) -> bool:
    """Whether a stage loads ``tensor`` (as ``load_checkpoint(layers=...)`` and ``keep_stage`` keep it)."""
    if "visual" in tensor or "vision" in tensor:
        return False
    if tensor.startswith(HEAD_PREFIXES) or ".mtp." in tensor:
        return last
    if (match := _LAYER_RE.search(tensor)) is not None:
        return start <= int(match.group(1)) < end
    if "embed_tokens" in tensor:
        return first or last  # the last stage's MTP head embeds tokens
    if "lm_head" in tensor or _FINAL_NORM_RE.search(tensor):
        return last
    return True  # a tensor exo cannot place: required rather than silently missing


def _has_conv1d(files: list[Path]) -> bool:
    return any(key.endswith("conv1d.weight") for file in files for key in _header(file)[0])


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_FINAL_NORM_RE = re.compile(r"(?:^|\.)norm\.(?:weight|bias)$")
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class CheckpointParts:
    """Bytes of what a pipeline stage holds, from the shards' headers (nothing is loaded)."""

    layer_bytes: tuple[int, ...]
    embed_bytes: int
    output_bytes: int  # final norm + lm_head
    mtp_bytes: int
    expert_bytes: int = 0  # of the layers' bytes, their MoE experts' (a token reads top_k of them)


def checkpoint_parts(path: Path, n_layers: int) -> CheckpointParts:
    """Sizes of the backbone's layers, its embedding table, its output (final norm, lm_head) and its MTP
    head, summed over every file mlx-lm or exo would load (a vision tower does not count)."""
    layers = [0] * n_layers
    embed = output = mtp = experts = 0
    files = weight_files(path) + [path / n for n in SIDECAR_NAMES if (path / n).is_file()]
    for file in files:
        keys, _, handle = _header(file)
        for key in keys:
            tensor = handle.get_slice(key)
            size = _DTYPE_BYTES.get(tensor.get_dtype(), 2)
            for dim in tensor.get_shape():
                size *= dim
            if "visual" in key or "vision" in key:
                continue
            if key.startswith(HEAD_PREFIXES) or ".mtp." in key:
                mtp += size
            elif (match := _LAYER_RE.search(key)) is not None:
                index = int(match.group(1))
                if index < n_layers:
                    layers[index] += size
                    if ".experts." in key or ".switch_mlp." in key:
                        experts += size
            elif "embed_tokens" in key:
                embed += size
            else:  # lm_head, the final norm
                output += size
    return CheckpointParts(tuple(layers), embed, output, mtp, experts)


def _header(file: Path) -> tuple[list[str], dict[str, str], Any]:
    try:
        handle = safe_open(str(file), framework="numpy")
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"{file} is not a readable safetensors file: {e}") from e
    return list(handle.keys()), handle.metadata() or {}, handle


def _is_raw_hf(files: list[Path]) -> bool:
    """mlx-lm's provenance signal: raw checkpoints keep conv1d weights as [C, 1, K], MLX as [C, K, 1]."""
    for file in files:
        keys, _, handle = _header(file)
        for key in keys:
            if key.endswith("conv1d.weight"):
                return handle.get_slice(key).get_shape()[-1] != 1
    return False


def inspect_head(path: Path, files: list[Path] | None = None) -> HeadInfo:
    """Find the MTP head's tensors (in the shards or a sidecar) without loading anything."""
    config = read_config(path)
    declared = declared_head_layers(config)
    files = files if files is not None else weight_files(path)
    for file in reversed(files):  # official checkpoints keep the head in the last shard
        keys, _, _ = _header(file)
        for prefix in HEAD_PREFIXES:
            head_keys = [k for k in keys if k.startswith(prefix)]
            if head_keys:
                owners = _files_with_prefix(files, prefix)
                all_keys = tuple(k for f in owners for k in _header(f)[0] if k.startswith(prefix))
                convention: NormConvention = "hf" if _is_raw_hf(files) else "mlx"
                return HeadInfo(declared, tuple(owners), all_keys, prefix, "in-shard", convention)
    for name in SIDECAR_NAMES:
        sidecar = path / name
        if sidecar.is_file():
            keys, metadata, _ = _header(sidecar)
            for prefix in HEAD_PREFIXES:
                head_keys = tuple(k for k in keys if k.startswith(prefix))
                if head_keys:
                    return HeadInfo(
                        declared, (sidecar,), head_keys, prefix, "sidecar", _sidecar_convention(metadata)
                    )
            raise MTPHeadError(f"{sidecar} holds no mtp.* tensors")
    return HeadInfo(declared)


def _files_with_prefix(files: list[Path], prefix: str) -> list[Path]:
    return [f for f in files if any(k.startswith(prefix) for k in _header(f)[0])]


def _sidecar_convention(metadata: dict[str, str]) -> NormConvention:
    explicit = metadata.get("exo.norm_convention")
    if explicit in ("hf", "mlx"):
        return explicit  # type: ignore[return-value]
    return "mlx" if metadata.get("format") == "mlx" else "hf"


def cpu_compatible(module: nn.Module) -> None:
    """MLX's CPU backend multiplies gathered experts (unquantized ``gather_mm``) in float32 only; it has no
    RMSNorm kernel, so norms run fused (``models.layers.fuse_norms``); its bfloat16 matmul is a scalar loop on
    x86-64, so linear layers run on exo's kernel where it is built, and GatedDeltaNet layers their recurrence
    (mlx-lm's runs ~10 small ops per row there) on another (``models.layers.use_cpu_kernels``)."""
    if mx.default_device() != mx.cpu:
        return
    from mlx_lm.models.switch_layers import SwitchLinear

    from .models.layers import fuse_norms, use_cpu_kernels

    fuse_norms(module)
    use_cpu_kernels(module)

    for _, leaf in module.named_modules():
        if isinstance(leaf, SwitchLinear) and leaf.weight.dtype in (mx.bfloat16, mx.float16):
            leaf.weight = leaf.weight.astype(mx.float32)


# ---------------------------------------------------------------------------------------------------
# Head weights -> MLX module


_EXPERT_RE = re.compile(r"^layers\.0\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def sanitize_head_weights(
    weights: dict[str, mx.array], convention: NormConvention
) -> tuple[dict[str, mx.array], str | None]:
    """Head tensors (names relative to the head) -> the MLX module's names and conventions.

    Per-expert and fused experts become mlx-lm's stacked ``switch_mlp``; zero-centred norms of raw
    Hugging Face files get the ``+1`` MLX's RMSNorm expects. Returns (weights, expert layout).
    """
    out: dict[str, mx.array] = {}
    per_expert: dict[str, dict[int, mx.array]] = {}
    layout: str | None = None
    for name, value in weights.items():
        match = _EXPERT_RE.match(name)
        if match:
            per_expert.setdefault(match.group(2), {})[int(match.group(1))] = value
            layout = "per_expert"
        elif name == "layers.0.mlp.experts.gate_up_proj":
            mid = value.shape[-2] // 2
            out["layers.0.mlp.switch_mlp.gate_proj.weight"] = value[..., :mid, :]
            out["layers.0.mlp.switch_mlp.up_proj.weight"] = value[..., mid:, :]
            layout = "fused"
        elif name == "layers.0.mlp.experts.down_proj":
            out["layers.0.mlp.switch_mlp.down_proj.weight"] = value
        else:
            if ".switch_mlp." in name:
                layout = "stacked"
            out[name] = value
    for proj, experts in per_expert.items():
        if sorted(experts) != list(range(len(experts))):
            raise MTPHeadError(f"MTP head experts for {proj} are not numbered 0..{len(experts) - 1}")
        out[f"layers.0.mlp.switch_mlp.{proj}.weight"] = mx.stack([experts[e] for e in range(len(experts))])
    if convention == "hf":
        for name, value in out.items():
            if name.endswith(HEAD_NORM_SUFFIXES) and value.ndim == 1:
                out[name] = value + 1.0
    return out, layout


def build_head(
    model: SpeculativeBackbone, weights: dict[str, mx.array], convention: NormConvention, source: str,
    fuse: bool = True,
) -> tuple[MTPHead, HeadStatus]:
    """An MTPHead for ``model`` from its tensors (names relative to the head), validated and loaded; ``fuse``: its
    layers' input projections as one product each (``models.fused_inputs``: to run it, not to save it)."""
    weights, layout = sanitize_head_weights(weights, convention)
    moe = any(".mlp.switch_mlp." in k or k == "layers.0.mlp.gate.weight" for k in weights)
    args = model.text_args
    layer_ids = {int(k.split(".")[1]) for k in weights if k.startswith("layers.")}
    if layer_ids - {0}:
        raise MTPHeadError(
            f"MTP head in {source} has {len(layer_ids)} layers; exo supports heads of one layer "
            "(every published Qwen3.5 / Qwen3.6 / Qwen3-Next head has one)"
        )
    head = MTPHead(args.hidden_size, args.rms_norm_eps, model.make_head_layer(moe))
    quantized = any(k.endswith(".scales") for k in weights)
    if quantized:

        def predicate(path: str, module: nn.Module):
            if f"{path}.scales" not in weights or not hasattr(module, "to_quantized"):
                return False
            return infer_quant_config(path, module, weights)

        nn.quantize(head, class_predicate=predicate)
    expected = dict(tree_flatten(head.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {', '.join('mtp.' + k for k in missing[:6])}")
        if unexpected:
            parts.append(f"unexpected {', '.join('mtp.' + k for k in unexpected[:6])}")
        raise MTPHeadError(f"MTP head in {source} does not match the backbone: {'; '.join(parts)}")
    for name, value in weights.items():
        if tuple(value.shape) != tuple(expected[name].shape):
            raise MTPHeadError(
                f"MTP head in {source}: mtp.{name} has shape {tuple(value.shape)}, "
                f"the backbone needs {tuple(expected[name].shape)}"
            )
    head.load_weights(list(weights.items()))
    cpu_compatible(head)
    head.eval()
    mx.eval(head.parameters())
    if fuse:
        use_fused_inputs(head)  # its attention's and MLP's projections, as the backbone's (the same shapes: its report)
    status = HeadStatus(
        available=True,
        source=source,
        norm_convention=convention,
        quantized=quantized,
        moe=moe,
        expert_layout=layout,
    )
    return head, status


def load_head_tensors(info: HeadInfo) -> dict[str, mx.array]:
    tensors: dict[str, mx.array] = {}
    wanted = set(info.keys)
    for file in info.files:
        try:
            arrays = mx.load(str(file))
        except Exception as e:
            raise CheckpointError(f"{file} could not be read: {e}") from e
        for key, value in arrays.items():
            if key in wanted:
                tensors[key[len(info.prefix) :]] = value
    return tensors


def missing_head_reason(path: Path, declared: int, source_repo: str | None) -> str:
    where = f"the official checkpoint {source_repo} (its last shard holds mtp.*)" if source_repo else (
        "the model's official Hugging Face checkpoint (its last shard holds mtp.*)"
    )
    note = recovery_note_reason(path)
    if note is not None:
        return note
    return (
        f"{path.name} declares an MTP head ({declared} layer) but its weights have no mtp.* tensors: "
        "stock mlx-lm conversions (e.g. every mlx-community/* repo) drop them. `exo pull` on this model "
        f"recovers it when its card names a source_repo; or get the head from {where} and save those "
        f"tensors as mtp.safetensors in {path}, or use a conversion that keeps the head. Running plain decoding."
    )


def recovery_note_reason(path: Path) -> str | None:
    """Why head recovery refused this checkpoint's head (its note), if it did."""
    try:
        note = json.loads((path / HEAD_RECOVERY_NOTE).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    reason = note.get("reason") if isinstance(note, dict) else None
    return f"{reason} Running plain decoding." if isinstance(reason, str) and reason else None


# ---------------------------------------------------------------------------------------------------
# Entry point


def eos_token_ids(path: Path, config: dict[str, Any], tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))

    add(config.get("eos_token_id"))
    add((config.get("text_config") or {}).get("eos_token_id"))
    generation_config = path / "generation_config.json"
    if generation_config.is_file():
        try:
            add(json.loads(generation_config.read_text()).get("eos_token_id"))
        except json.JSONDecodeError:
            pass
    ids.update(getattr(tokenizer, "eos_token_ids", ()) or ())
    return frozenset(ids)


def load_checkpoint(
    path: str | Path,
    *,
    model_id: str | None = None,
    load_head: bool = True,
    head_source_repo: str | None = None,
    lazy: bool = False,
    layers: tuple[int, int] | None = None,
    tensor: TensorShare | None = None,
) -> LoadedModel:
    """Load a local checkpoint directory (raw Hugging Face or MLX layout) with its MTP head.

    A head the config declares but the weights lack, or a malformed head, does not stop the load:
    ``head_status`` says why MTP is unavailable and the model runs plain decoding.

    ``layers=(start, end)``: only a pipeline stage's part (``SpeculativeBackbone.keep_stage``), read from
    disk and nothing else: the embedding on the first stage; the final norm, lm_head, the embedding
    table, the tokenizer and the MTP head on the last. A middle or first stage has no tokenizer (None).
    The directory may hold only the shards the stage needs (``stage_weight_files``).

    ``tensor``: member ``tensor.rank`` of a tensor group (``engine/sharding.py``): its slice of every layer
    (only the slices are read into memory), the embedding whole; the leader (the last member) also the final
    norm, lm_head, the tokenizer and the MTP head, which the others do without.
    """
    path = Path(path).expanduser().resolve()
    seconds: dict[str, float] = {}
    mark = _timer(seconds)
    config = read_config(path)
    # A stage may load from a partial checkpoint (only its shards downloaded): its model drops the other
    # stages' layers before the weights arrive, so mlx-lm's strict check covers what the stage keeps.
    if layers is not None and tensor is not None:
        raise ValueError("a model is split by layers or by tensor, not both")
    if layers is None:
        files, partial = weight_files(path), False
    else:
        files, partial = stage_weight_files(path, *layers, config)
    for file in files:
        _header(file)  # a corrupt shard fails here with the file's name, not deep inside mlx
    try:
        classes = stage_model_classes(*layers) if layers is not None and partial else get_model_classes
        model, config = mlx_load_model(path, lazy=lazy or layers is not None or tensor is not None,
                                       get_model_classes=classes)
        last = True
        if tensor is not None:
            shard_model(model, tensor)  # (TensorShardingError: a ValueError, the message says why)
            last = tensor.leader
            if not last:
                model.drop_output()  # the leader alone computes logits (a tied table stays: it embeds)
            if not lazy:
                mx.eval(model.parameters())  # only this member's slices are read
        if layers is not None:
            start, end = layers
            last = end == model.num_layers
            if not partial:  # a partial checkpoint's model kept its stage while loading
                model.keep_stage(start, end, first=start == 0, last=last)
            if not lazy:
                mx.eval(model.parameters())  # only this stage's weights are read
    except (UnsupportedModelError, TensorShardingError):
        raise
    except (ValueError, KeyError, FileNotFoundError, RuntimeError) as e:
        raise CheckpointError(f"{path}: the weights do not match config.json: {e}") from e
    cpu_compatible(model)
    mark("weights")
    # measured on the CPU kernels' classes; before qgemv's, padded rows', dense's (a tensor member: mlx-lm's calls)
    fused = use_fused_inputs(model) if tensor is None else {}
    mark("fused inputs")
    tokenizer = None
    if last:
        try:
            tokenizer = load_tokenizer(path)
        except Exception as e:
            raise CheckpointError(f"{path}: tokenizer files could not be loaded: {e}") from e

    head: MTPHead | None = None
    info = inspect_head(path, files)
    if not last:
        where = "the tensor group's leader" if tensor is not None else "the pipeline's last stage"
        status = HeadStatus(available=False, reason=f"the MTP head runs on {where}")
    elif not load_head:
        status = HeadStatus(available=False, reason="native MTP is disabled (the head was not loaded)")
    elif info.present:
        try:
            head, status = build_head(
                model, load_head_tensors(info), info.norm_convention, f"{path.name} ({info.source})"
            )
        except MTPHeadError as e:
            status = HeadStatus(available=False, reason=f"{e}. Running plain decoding.")
    elif info.declared_layers:
        status = HeadStatus(
            available=False, reason=missing_head_reason(path, info.declared_layers, head_source_repo)
        )
    else:
        status = HeadStatus(available=False, reason=f"{path.name} has no MTP head")
    mark("tokenizer and head")
    blocks = list(model.moe_blocks())
    if head is not None:
        blocks += [layer.mlp for layer in head.layers if isinstance(layer.mlp, SparseMoeBlock)]
    check_expert_sort(blocks)  # before any prefill: a device whose sorted expert kernels are wrong goes unsorted
    mark("expert sort")
    qgemv = use_qgemv([model] + ([head] if head is not None else []))
    mark("qgemv")
    padded = use_padded_rows([model] + ([head] if head is not None else []))  # shapes the kernel left to MLX
    mark("padded rows")
    dense = use_prompt_dense([model] + ([head] if head is not None else []), blocks, experts_unsorted,
                             lazy=lazy)  # prompt-sized calls (and batch steps: EXO_BATCH_DENSE)
    mark("prompt dense")
    gdn = use_gdn_kernel(model)
    mark("gdn kernel")
    attn = use_attn_kernel([model] + ([head] if head is not None else [])) if tensor is None else {}
    mark("attention kernel")
    use_long_attention([model] + ([head] if head is not None else []))  # (EXO_LONG_ATTENTION: off by default)
    return LoadedModel(
        path=path,
        model_id=model_id or path.name,
        model=model,
        tokenizer=tokenizer,
        config=config,
        head=head,
        head_status=status,
        eos_token_ids=eos_token_ids(path, config, tokenizer) if tokenizer is not None else frozenset(),
        qgemv=qgemv,
        padded=padded,
        dense=dense,
        gdn=gdn,
        fused=fused,
        attn=attn,
        load_seconds=seconds,
    )


def _timer(seconds: dict[str, float]) -> Any:
    """``mark(name)``: the seconds since the previous mark (or since this call) go to ``seconds[name]``."""
    last = [time.perf_counter()]

    def mark(name: str) -> None:
        now = time.perf_counter()
        seconds[name] = seconds.get(name, 0.0) + now - last[0]
        last[0] = now

    return mark
