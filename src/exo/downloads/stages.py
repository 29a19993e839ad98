"""Which weight files a pipeline stage needs: pure functions over ``model.safetensors.index.json``.

A stage runs layers [start, end) of the model's N decoder layers. It needs those layers' tensors, and:
the first stage the token embedding; the last stage the final norm, the lm_head, the MTP head (``mtp.*``)
and the embedding table as well (the MTP head embeds the token it is given, and tied models read their
output projection from it). No stage needs a vision tower.

Tensor names as the three layouts spell them:

- raw Hugging Face Qwen3.5 / Qwen3.6: ``model.language_model.{embed_tokens,layers.i,norm}.*``,
  ``lm_head.*``, ``mtp.*``, ``model.visual.*``;
- MLX Qwen3.5 / Qwen3.6: ``language_model.model.{embed_tokens,layers.i,norm}.*``,
  ``language_model.lm_head.*``, ``language_model.mtp.*`` (when kept), ``vision_tower.*``;
- Qwen3-Next (raw and MLX): ``model.{embed_tokens,layers.i,norm}.*``, ``lm_head.*``, ``mtp.*``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from .errors import StageRangeError

TensorRole = Literal["layer", "embedding", "final_norm", "lm_head", "mtp", "vision", "other"]

_BACKBONE = r"(?:model\.language_model|language_model\.model|model)"
_LAYER = re.compile(rf"^{_BACKBONE}\.layers\.(\d+)\.")
_EMBEDDING = re.compile(rf"^{_BACKBONE}\.embed_tokens\.")
_FINAL_NORM = re.compile(rf"^{_BACKBONE}\.norm\.")
_LM_HEAD = re.compile(r"^(?:language_model\.)?lm_head\.")
_MTP = re.compile(r"^(?:language_model\.|model\.)?mtp\.")
_VISION = re.compile(r"^(?:model\.visual|visual|vision_tower|model\.vision_tower|vision_model)\.")


def tensor_role(name: str) -> tuple[TensorRole, int | None]:
    """What a tensor is for, and its decoder layer for layer tensors."""
    if _MTP.match(name):
        return "mtp", None
    if _VISION.match(name):
        return "vision", None
    match = _LAYER.match(name)
    if match:
        return "layer", int(match.group(1))
    if _EMBEDDING.match(name):
        return "embedding", None
    if _FINAL_NORM.match(name):
        return "final_norm", None
    if _LM_HEAD.match(name):
        return "lm_head", None
    return "other", None


@dataclass(frozen=True)
class Stage:
    start: int
    end: int
    n_layers: int
    first: bool
    last: bool

    @classmethod
    def of(cls, start: int, end: int, n_layers: int, *, first: bool | None = None, last: bool | None = None) -> Stage:
        if not 0 <= start < end <= n_layers:
            raise StageRangeError(
                f"a stage runs layers [start, end) with 0 <= start < end <= {n_layers}; got [{start}, {end})"
            )
        return cls(start, end, n_layers, start == 0 if first is None else first, end == n_layers if last is None else last)

    def needs(self, name: str) -> bool:
        role, layer = tensor_role(name)
        if role == "layer":
            assert layer is not None
            return self.start <= layer < self.end
        if role == "embedding":
            return self.first or self.last
        if role in ("final_norm", "lm_head", "mtp"):
            return self.last
        if role == "vision":
            return False
        return True  # a tensor exo cannot place: every stage takes it rather than miss it


def stage_tensors(weight_map: Mapping[str, str], stage: Stage) -> list[str]:
    """The tensors of ``weight_map`` (tensor -> file) that ``stage`` loads."""
    _check_layers(weight_map, stage)
    return sorted(name for name in weight_map if stage.needs(name))


def stage_files(
    weight_map: Mapping[str, str],
    start: int,
    end: int,
    n_layers: int,
    *,
    first: bool | None = None,
    last: bool | None = None,
) -> list[str]:
    """The weight files a stage running layers [start, end) of ``n_layers`` must have on disk.

    ``first`` / ``last`` default to ``start == 0`` / ``end == n_layers``.
    """
    stage = Stage.of(start, end, n_layers, first=first, last=last)
    return sorted({weight_map[name] for name in stage_tensors(weight_map, stage)})


def _check_layers(weight_map: Mapping[str, str], stage: Stage) -> None:
    layers = {layer for name in weight_map if (layer := tensor_role(name)[1]) is not None}
    if layers and max(layers) >= stage.n_layers:
        raise StageRangeError(
            f"the weights hold decoder layer {max(layers)} but the model has {stage.n_layers} layers; "
            "n_layers does not match this checkpoint"
        )
