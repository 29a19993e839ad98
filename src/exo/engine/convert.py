"""Convert a checkpoint to MLX layout (optionally quantized) KEEPING its MTP head.

Stock ``mlx_lm.convert`` drops ``mtp.*``; this writes the head either inside the shards (as
``language_model.mtp.*`` for Qwen3.5/3.6, ``mtp.*`` for Qwen3-Next, MLX norm convention) or as a
sidecar ``mtp.safetensors`` next to them. The head can stay in bf16 on a quantized backbone, or be
quantized like the backbone (MoE router gates at 8 bits, as mlx-lm does for the backbone).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Literal

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import quantize_model, save_config, save_model

from .loader import LoadedModel, load_checkpoint
from .models.fused_inputs import unfuse_inputs

HeadPlacement = Literal["in-shard", "sidecar", "drop"]
_NON_TOKENIZER_JSON = {"config.json", "model.safetensors.index.json"}


def _head_parent(model: nn.Module) -> nn.Module:
    """The module the head hangs off in MLX layout (its parameter prefix)."""
    return model.language_model if hasattr(model, "language_model") else model


def quantize_head(head: nn.Module, bits: int, group_size: int) -> None:
    def predicate(path: str, module: nn.Module):
        if not hasattr(module, "to_quantized") or module.weight.shape[-1] % group_size:
            return False
        if path.endswith("mlp.gate") or path.endswith("shared_expert_gate"):
            return {"group_size": 64, "bits": 8}
        return True

    nn.quantize(head, group_size=group_size, bits=bits, class_predicate=predicate)


def copy_tokenizer_files(src: Path, dst: Path) -> None:
    for file in src.iterdir():
        is_tokenizer_json = file.suffix == ".json" and file.name not in _NON_TOKENIZER_JSON
        if file.is_file() and (is_tokenizer_json or file.suffix in (".jinja", ".txt", ".model", ".tiktoken")):
            shutil.copy2(file, dst / file.name)


def convert_checkpoint(
    src: str | Path,
    dst: str | Path,
    *,
    bits: int | None = None,
    group_size: int = 64,
    head: HeadPlacement = "in-shard",
    quantize_head_too: bool = False,
    loaded: LoadedModel | None = None,
) -> Path:
    """Write an MLX-layout copy of ``src`` into ``dst`` (which must not exist yet)."""
    src, dst = Path(src), Path(dst)
    if dst.exists():
        raise FileExistsError(f"{dst} already exists")
    loaded = loaded or load_checkpoint(src)
    model, config = loaded.model, dict(loaded.config)
    unfuse_inputs(model)  # the checkpoint's own layout, projection by projection
    if bits is not None:
        model, config = quantize_model(
            model, config, group_size, bits, quant_predicate=getattr(model, "quant_predicate", None)
        )
    mtp = loaded.head if head != "drop" else None
    if mtp is not None:
        unfuse_inputs(mtp)
    if mtp is not None and quantize_head_too and bits is not None:
        quantize_head(mtp, bits, group_size)
    parent = _head_parent(model)
    if mtp is not None and head == "in-shard":
        parent.mtp = mtp
    try:
        save_model(dst, model)
    finally:
        if "mtp" in parent:
            parent.pop("mtp")
    if mtp is not None and head == "sidecar":
        weights = {f"mtp.{k}": v for k, v in tree_flatten(mtp.parameters())}
        mx.save_safetensors(
            str(dst / "mtp.safetensors"), weights, metadata={"format": "mlx", "exo.norm_convention": "mlx"}
        )
    save_config(config, dst / "config.json")
    copy_tokenizer_files(loaded.path, dst)
    return dst
