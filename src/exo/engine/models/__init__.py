"""Architectures the engine runs: mlx-lm's classes extended for speculative verification."""

from __future__ import annotations

import importlib
from typing import Any

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


class UnsupportedModelError(ValueError):
    """The checkpoint's model_type is not one exo runs."""


def get_model_classes(config: dict[str, Any]):
    """``get_model_classes`` for ``mlx_lm.utils.load_model``: exo's subclass of mlx-lm's Model."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; exo runs {', '.join(SUPPORTED_MODEL_TYPES)} "
            "(Qwen3.5 / Qwen3.6 dense and MoE, Qwen3-Next)"
        )
    module = importlib.import_module(f"{__name__}.{model_type}")
    return module.Model, module.ModelArgs


def stage_model_classes(start: int, end: int):
    """``get_model_classes`` for one pipeline stage of a partial checkpoint (only the stage's shards on
    disk): the model keeps layers [start, end) as its weights arrive (``SpeculativeBackbone.load_weights``)."""

    def classes(config: dict[str, Any]):
        model_class, args_class = get_model_classes(config)
        return type(model_class.__name__, (model_class,), {"load_stage": (start, end)}), args_class

    return classes
