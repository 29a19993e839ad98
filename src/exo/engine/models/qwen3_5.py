"""Qwen3.5 / Qwen3.6 dense (mlx-lm ``qwen3_5``) with speculative-verification layers."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5
from mlx_lm.models.qwen3_5 import DecoderLayer
from mlx_lm.models.qwen3_next import Qwen3NextMLP

from .backbone import SpeculativeBackbone, head_mlp
from .layers import Attention

ModelArgs = qwen3_5.ModelArgs


class Qwen35Backbone(SpeculativeBackbone):
    language_model: nn.Module

    @property
    def text_args(self):
        return self.language_model.args

    @property
    def text_model(self):
        return self.language_model.model

    def logits(self, hidden: mx.array) -> mx.array:
        lm = self.language_model
        if lm.args.tie_word_embeddings:
            return lm.model.embed_tokens.as_linear(hidden)
        return lm.lm_head(hidden)

    def output_projection(self) -> nn.Module:
        lm = self.language_model
        return lm.model.embed_tokens if lm.args.tie_word_embeddings else lm.lm_head

    def _drop_output_head(self) -> None:
        if "lm_head" in self.language_model:
            del self.language_model["lm_head"]

    def make_head_layer(self, moe: bool) -> nn.Module:
        layer = DecoderLayer(self.text_args, self.full_attention_index)
        layer.self_attn = Attention(self.text_args)  # exo's (fused projections, the decode-attention kernel)
        layer.mlp = head_mlp(self.text_args, moe, Qwen3NextMLP)
        return layer


class Model(Qwen35Backbone, qwen3_5.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self._install_speculative_layers()
