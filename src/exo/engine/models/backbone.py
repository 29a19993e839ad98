"""What the engine needs from a backbone, on top of mlx-lm's model classes.

Each architecture module subclasses mlx-lm's ``Model`` together with ``SpeculativeBackbone``; the mixin
swaps in the rollback-capable GatedDeltaNet and route-lockable MoE layers (same parameter names) and
gives the engine one interface: a stage's forward (post-norm hiddens on the last stage), logits from
hiddens, caches, and the MTP head's decoder layer.

A model may hold only a stage of a pipeline: layers [stage_start, stage_end), the embedding on the first
stage, the final norm, lm_head (and the engine's MTP head, which embeds tokens too) on the last. One stage
holding everything is the whole model, on a single node; both run the same ``stage_hidden``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import KVCache

from . import compiled_layers, prompt_dense
from .layers import (
    Attention,
    GatedDeltaNet,
    GdnPrefill,
    MoEVerifyMode,
    QGemvEmbedding,
    QGemvLinear,
    RollbackArraysCache,
    SparseMoeBlock,
    make_rowwise,
    vectors_apply,
)


class SpeculativeBackbone:
    """Mixin for an mlx-lm ``Model``: call ``_install_speculative_layers`` at the end of ``__init__``."""

    # Provided by the architecture module.
    text_args: Any
    text_model: nn.Module
    gdn_class: type = GatedDeltaNet

    # The stage this model holds (see keep_stage); by default all of it.
    stage_start: int = 0
    stage_end: int | None = None
    first_stage: bool = True
    last_stage: bool = True

    def _install_speculative_layers(self) -> None:
        for layer in self.text_model.layers:
            if layer.is_linear:
                layer.linear_attn = self.gdn_class(self.text_args)
            else:
                layer.self_attn = Attention(self.text_args)
            if isinstance(layer.mlp, nn.Module) and hasattr(layer.mlp, "switch_mlp"):
                layer.mlp = SparseMoeBlock(self.text_args)

    # -- pipeline stages -------------------------------------------------------------------------------
    # Set on a class made by ``stage_model_classes``: the stage to keep while loading a partial checkpoint.
    load_stage: tuple[int, int] | None = None

    def load_weights(self, file_or_weights: Any, strict: bool = True) -> Any:
        """mlx-lm hands every weight it found; a model that loads one stage of a partial checkpoint
        (``load_stage``) first drops the other stages' parts, and their weights that came along in shared
        shards, so the strict check (every parameter, every shape) covers exactly what the stage keeps."""
        if self.load_stage is None:
            return super().load_weights(file_or_weights, strict=strict)  # type: ignore[misc]
        start, end = self.load_stage
        before = set(tree_flatten(self.parameters(), destination={}))  # type: ignore[attr-defined]
        self.keep_stage(start, end, first=start == 0, last=end == self.num_layers)
        dropped = before - set(tree_flatten(self.parameters(), destination={}))  # type: ignore[attr-defined]
        weights = [(k, v) for k, v in file_or_weights if k not in dropped]
        return super().load_weights(weights, strict=strict)  # type: ignore[misc]

    def keep_stage(self, start: int, end: int, *, first: bool, last: bool) -> None:
        """Keep only what a stage runs (call on a lazily loaded model, before evaluating its weights): drop
        the other stages' layers, the embedding on a middle stage, the final norm and lm_head before the
        last. Layer numbers stay (``text_model.layers`` keeps None where another stage's layers were)."""
        text = self.text_model
        n = len(text.layers)
        if not 0 <= start < end <= n:
            raise ValueError(f"layers [{start}, {end}) are outside the model's {n} layers")
        if first != (start == 0) or last != (end == n):
            raise ValueError(f"layers [{start}, {end}) of {n}: first/last stage flags do not match")
        text.layers = [layer if start <= i < end else None for i, layer in enumerate(text.layers)]
        self.stage_start, self.stage_end, self.first_stage, self.last_stage = start, end, first, last
        if not first and not last:  # the last stage keeps the table: the MTP head embeds tokens
            del text["embed_tokens"]
        if not last:
            del text["norm"]
            self._drop_output_head()

    def drop_output(self) -> None:
        """Drop the final norm and lm_head (a tensor group's member that does not lead: it computes every layer's
        slice on the embedded ids, and the leader the output). The embedding table stays."""
        del self.text_model["norm"]
        self._drop_output_head()
        self.last_stage = False

    def _drop_output_head(self) -> None:
        """Remove lm_head (each architecture module knows where it is)."""
        raise NotImplementedError

    @property
    def stage_layers(self) -> list[nn.Module]:
        return [layer for layer in self.text_model.layers if layer is not None]

    @property
    def num_layers(self) -> int:
        return len(self.text_model.layers)

    @property
    def hidden_size(self) -> int:
        return int(self.text_args.hidden_size)

    def stage_hidden(self, inputs: mx.array, cache: list[Any], *, eval_every: int = 0) -> mx.array:
        """This stage's forward: token ids [B, T] (first stage) or the previous stage's hidden [B, T, H]
        in; hidden states out, post-final-norm on the last stage (what lm_head and the MTP head see).

        The computation of mlx-lm's text model ``__call__`` (embedding; attention and SSM masks from the
        first cache of each kind; the layers; the final norm), restricted to this stage's layers.
        ``eval_every``: start evaluating the hidden states after every that many layers while the rest is
        built (the same graph, so the same values; see ``forward.VERIFY_EVAL_EVERY``).
        """
        text = self.text_model
        h = text.embed_tokens(inputs) if self.first_stage else inputs
        layers = self.stage_layers
        fa = next((i for i, layer in enumerate(layers) if not layer.is_linear), None)
        ssm = next((i for i, layer in enumerate(layers) if layer.is_linear), None)
        fa_mask = create_attention_mask(h, cache[fa]) if fa is not None else None
        ssm_mask = create_ssm_mask(h, cache[ssm]) if ssm is not None else None
        compiled = compiled_layers.mode_key(self)  # None: every layer op by op (``models.compiled_layers``)
        for i, (layer, c) in enumerate(zip(layers, cache, strict=True)):
            mask = ssm_mask if layer.is_linear else fa_mask
            h = layer(h, mask=mask, cache=c) if compiled is None else compiled_layers.call(layer, h, mask, c, compiled)
            if eval_every and (i + 1) % eval_every == 0 and i + 1 < len(layers):
                mx.async_eval(h)
        return text.norm(h) if self.last_stage else h

    # -- forward pieces (the last stage, or the whole model) -----------------------------------------
    def hidden(self, tokens: mx.array, cache: list[Any]) -> mx.array:
        """Post-final-norm hidden states [B, T, H] of the whole model (a model that holds every layer)."""
        if not (self.first_stage and self.last_stage):
            raise RuntimeError("this model holds one stage of a pipeline: run it through its PipelineForward")
        return self.stage_hidden(tokens, cache)

    def embed(self, tokens: mx.array) -> mx.array:
        return self.text_model.embed_tokens(tokens)

    def logits(self, hidden: mx.array) -> mx.array:
        raise NotImplementedError

    def output_projection(self) -> nn.Module:
        """What ``logits`` applies: the lm_head, or the tied embedding table."""
        raise NotImplementedError

    def output_weight(self) -> mx.array | None:
        """The output projection's [V, H] matrix when it is a plain (unquantized, bias-free) one, for
        ``layers.vector_matmul``; None otherwise."""
        head = self.output_projection()
        if isinstance(head, nn.Embedding):  # (a QuantizedEmbedding is not one)
            return head.weight
        return head.weight if vectors_apply(head) else None

    def make_cache(self) -> list[Any]:
        """Caches of this stage's layers (all layers of a whole model)."""
        return [RollbackArraysCache() if layer.is_linear else KVCache() for layer in self.stage_layers]

    # -- speculative verification ------------------------------------------------------------------
    def moe_blocks(self) -> Iterator[SparseMoeBlock]:
        for layer in self.stage_layers:
            if isinstance(layer.mlp, SparseMoeBlock):
                yield layer.mlp

    def set_rowwise_linears(self, linears: list[nn.Module]) -> None:
        """The linear layers whose verify rows are computed one at a time (``verify.probe``)."""
        for linear in linears:
            make_rowwise(linear)
        object.__setattr__(self, "_rowwise_linears", tuple(linears))  # not a child module: no parameters
        for linear in linears:
            linear.per_row = self.__dict__.get("_verify_state", (None,))[0] is not None

    def set_batch_invariant(self, on: bool) -> None:
        """Around a batch's step (``EngineConfig.batch_invariant``): every bias-free linear layer computes each
        row as a one-row product, attention runs per sequence, MoE experts unsorted: each sequence's rows
        round as its solo steps do, whatever else runs in the batch."""
        parts = self.__dict__.get("_batch_invariant_parts")
        if parts is None:
            linears = [m for layer in self.stage_layers for _, m in layer.named_modules() if vectors_apply(m)]
            for linear in linears:
                make_rowwise(linear)
            attention = [layer.self_attn for layer in self.stage_layers
                         if isinstance(getattr(layer, "self_attn", None), Attention)]
            parts = (linears, attention, list(self.moe_blocks()))
            object.__setattr__(self, "_batch_invariant_parts", parts)  # not child modules: no parameters
        linears, attention, blocks = parts
        object.__setattr__(self, "_batch_invariant_on", on)  # (``compiled_layers``: nothing compiled then)
        for linear in linears:
            linear.batch_vectors = on
        for linear in self._qgemv_linears():
            linear.exact_batch = on
        for layer in attention:
            layer.per_sequence = on
        for block in blocks:
            block.unsorted_in_batch = on

    def _qgemv_linears(self) -> tuple[nn.Module, ...]:
        """This stage's layers and output projection on exo's quantized kernel (``layers.use_qgemv``, at load) or
        with the dense path (``prompt_dense``: ``exact_batch`` keeps a batch-invariant step's rows off it)."""
        found = self.__dict__.get("_qgemv_found")
        if found is None:
            parts = list(self.stage_layers) + ([self.output_projection()] if self.last_stage else [])
            found = tuple(m for part in parts for _, m in part.named_modules()
                          if isinstance(m, (QGemvLinear, QGemvEmbedding, prompt_dense.DenseRows)))
            object.__setattr__(self, "_qgemv_found", found)  # not child modules: no parameters
        return found

    def set_gdn_prefill(self, mode: GdnPrefill) -> None:
        """How this stage's GatedDeltaNet layers run a prompt chunk's rows (``layers.GdnPrefill``)."""
        for layer in self.stage_layers:
            if layer.is_linear:
                layer.linear_attn.gdn_prefill = mode

    @property
    def is_moe(self) -> bool:
        return any(True for _ in self.moe_blocks())

    def set_verify_mode(self, moe: MoEVerifyMode | None, per_row_attention: bool = False,
                        rows: int | None = None) -> None:
        """Around a verify call: lock MoE routing (``moe``), attend row by row (``per_row_attention``), and
        run the linear layers that ``verify.probe`` found row-count-sensitive row by row (``moe`` set: a
        verify call is on; None: it is over). ``rows``: the call's rows (None: unknown); exo's quantized kernel
        takes every row of a call anyway up to ``cuda_qgemv.CALL_ROWS``, so only a larger call flags its layers.

        Only what changes is set: a round sets the mode and clears it, and at 9B a pass over every flag of
        every layer cost ~0.45 ms of the host's time each way on an H200 (``bench/build_profile.py``), serial
        in each round where a plain step pays nothing. The flags are the models' own (set only here; a test
        that sets one by hand puts it back)."""
        from ..kernels.cuda_qgemv import CALL_ROWS

        on = moe is not None
        want = (moe, on and per_row_attention, on and (rows is None or rows > CALL_ROWS))
        had = self.__dict__.get("_verify_state", (None, False, False))
        if want == had:
            return
        if want[0] != had[0]:
            for block in self._moe_blocks():
                block.verify_mode = moe
            for linear in self.__dict__.get("_rowwise_linears", ()):
                linear.per_row = on
        if want[2] != had[2]:
            for linear in self._qgemv_linears():
                linear.exact_verify = want[2]
        if want[1] != had[1]:
            for attention in self._attention_layers():
                attention.per_row = want[1]
        object.__setattr__(self, "_verify_state", want)  # (not a child module)

    def _moe_blocks(self) -> tuple[SparseMoeBlock, ...]:
        found = self.__dict__.get("_moe_found")
        if found is None:
            found = tuple(self.moe_blocks())
            object.__setattr__(self, "_moe_found", found)
        return found

    def _attention_layers(self) -> tuple[Attention, ...]:
        found = self.__dict__.get("_attention_found")
        if found is None:
            found = tuple(layer.self_attn for layer in self.stage_layers
                          if isinstance(getattr(layer, "self_attn", None), Attention))
            object.__setattr__(self, "_attention_found", found)
        return found

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
