"""Qwen3.5 / Qwen3.6 MoE (mlx-lm ``qwen3_5_moe``) with speculative-verification layers."""

from __future__ import annotations

from mlx_lm.models import qwen3_5_moe

from .qwen3_5 import Qwen35Backbone

ModelArgs = qwen3_5_moe.ModelArgs


class Model(Qwen35Backbone, qwen3_5_moe.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self._install_speculative_layers()
