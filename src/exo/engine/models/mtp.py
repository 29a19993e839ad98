"""The native multi-token-prediction head in MLX (Qwen3.5 / Qwen3.6 / Qwen3-Next).

Forward (per the published head; docs/architecture.md "MTP head"):

    e = pre_fc_norm_embedding(embed_tokens(token[p+1]))
    h = pre_fc_norm_hidden(hidden[p])           # the backbone's post-final-norm hidden
    x = fc(concat([e, h], -1))                  # embedding first
    x = layers[0](x, own KV cache)              # a full-attention decoder layer (never GatedDeltaNet)
    out = norm(x); logits = lm_head(out)        # embeddings and lm_head are the backbone's

The decoder layer runs through ``compiled_layers`` where they apply (MLX CUDA by default): its drafts' host work is
on a speculative round's serial path (a K = 1 round's drafts were 73 primitives op by op, ``bench/round_phases.py
--census``).

Head cache entry p consumes (hidden[p], token[p+1]) at RoPE position p and predicts token[p+2]. For
depth > 1 the head's own ``out`` stands in for the next hidden.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from . import compiled_layers


class MTPHead(nn.Module):
    def __init__(self, hidden_size: int, eps: float, layer: nn.Module):
        super().__init__()
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden_size, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden_size, eps=eps)
        self.layers = [layer]
        self.norm = nn.RMSNorm(hidden_size, eps=eps)

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache=None) -> mx.array:
        x = mx.concatenate(
            [self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        x = self.fc(x)
        mask = create_attention_mask(x, cache)
        key = compiled_layers.head_key()
        layer = self.layers[0]
        x = layer(x, mask=mask, cache=cache) if key is None else compiled_layers.call(layer, x, mask, cache, key)
        return self.norm(x)


# Norms of the head stored zero-centred in raw Hugging Face files (applied as 1 + w there).
HEAD_NORM_SUFFIXES = (
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
    "norm.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
)
