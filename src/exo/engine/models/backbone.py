"""What the engine needs from a backbone, on top of mlx-lm's model classes.

Each architecture module subclasses mlx-lm's ``Model`` together with ``SpeculativeBackbone``; the mixin
swaps in the rollback-capable GatedDeltaNet and route-lockable MoE layers (same parameter names) and
gives the engine one interface: post-norm hiddens, logits from hiddens, caches, and the MTP head's
decoder layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from .layers import GatedDeltaNet, MoEVerifyMode, RollbackArraysCache, SparseMoeBlock


class SpeculativeBackbone:
    """Mixin for an mlx-lm ``Model``: call ``_install_speculative_layers`` at the end of ``__init__``."""

    # Provided by the architecture module.
    text_args: Any
    text_model: nn.Module
    gdn_class: type = GatedDeltaNet

    def _install_speculative_layers(self) -> None:
        for layer in self.text_model.layers:
            if layer.is_linear:
                layer.linear_attn = self.gdn_class(self.text_args)
            if isinstance(layer.mlp, nn.Module) and hasattr(layer.mlp, "switch_mlp"):
                layer.mlp = SparseMoeBlock(self.text_args)

    # -- forward pieces --------------------------------------------------------------------------
    def hidden(self, tokens: mx.array, cache: list[Any] | None = None) -> mx.array:
        """Post-final-norm hidden states [B, T, H] (what lm_head sees, and what the MTP head wants)."""
        return self.text_model(tokens, cache)

    def embed(self, tokens: mx.array) -> mx.array:
        return self.text_model.embed_tokens(tokens)

    def logits(self, hidden: mx.array) -> mx.array:
        raise NotImplementedError

    def make_cache(self) -> list[Any]:
        return [RollbackArraysCache() if layer.is_linear else KVCache() for layer in self.text_model.layers]

    # -- speculative verification ------------------------------------------------------------------
    def moe_blocks(self) -> Iterator[SparseMoeBlock]:
        for layer in self.text_model.layers:
            if isinstance(layer.mlp, SparseMoeBlock):
                yield layer.mlp

    @property
    def is_moe(self) -> bool:
        return any(True for _ in self.moe_blocks())

    def set_moe_verify_mode(self, mode: MoEVerifyMode | None) -> None:
        for block in self.moe_blocks():
            block.verify_mode = mode

    # -- MTP head ------------------------------------------------------------------------------------
    @property
    def full_attention_index(self) -> int:
        return self.text_args.full_attention_interval - 1

    def make_head_layer(self, moe: bool) -> nn.Module:
        """A full-attention decoder layer of this architecture with a dense or MoE MLP."""
        raise NotImplementedError


def head_mlp(args: Any, moe: bool, dense_cls: type) -> nn.Module:
    if moe:
        return SparseMoeBlock(args)
    return dense_cls(args.hidden_size, args.intermediate_size)
