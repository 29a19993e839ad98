"""Qwen3-Next (mlx-lm ``qwen3_next``) with speculative-verification layers."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_next
from mlx_lm.models.qwen3_next import Qwen3NextDecoderLayer, Qwen3NextMLP

from .backbone import SpeculativeBackbone, head_mlp
from .layers import Attention, NextGatedDeltaNet


class ModelArgs(qwen3_next.ModelArgs):
    @classmethod
    def from_dict(cls, params):
        # Configs written by transformers >= 5 nest RoPE settings in ``rope_parameters``; the official
        # Qwen3-Next files (and mlx-lm) keep them top-level.
        rope = params.get("rope_parameters") or {}
        params = dict(params)
        params.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
        params.setdefault("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
        return super().from_dict(params)


class Model(SpeculativeBackbone, qwen3_next.Model):
    gdn_class = NextGatedDeltaNet

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self._install_speculative_layers()

    def sanitize(self, weights):
        # mlx-lm only drops mtp.* from raw checkpoints; an MLX conversion that kept the head has them
        # too. exo loads the head itself (engine/loader.py).
        return super().sanitize({k: v for k, v in weights.items() if not k.startswith("mtp.")})

    @property
    def text_args(self):
        return self.args

    @property
    def text_model(self):
        return self.model

    def logits(self, hidden: mx.array) -> mx.array:
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    def output_projection(self) -> nn.Module:
        return self.model.embed_tokens if self.args.tie_word_embeddings else self.lm_head

    def _drop_output_head(self) -> None:
        if "lm_head" in self:
            del self["lm_head"]

    def make_head_layer(self, moe: bool) -> nn.Module:
        layer = Qwen3NextDecoderLayer(self.args, self.full_attention_index)
        layer.self_attn = Attention(self.args)  # exo's (fused projections, the decode-attention kernel)
        layer.mlp = head_mlp(self.args, moe, Qwen3NextMLP)
        return layer
