"""The Qwen3.5 / Qwen3.6 / Qwen3-Next multi-token-prediction head in PyTorch, in the official layout.

The forward follows the published head (see docs/architecture.md, "MTP head"):

    e = pre_fc_norm_embedding(embed_tokens(token[t+1]))
    h = pre_fc_norm_hidden(hidden[t])          # the backbone's post-final-norm hidden
    x = fc(concat([e, h], -1))                 # embedding first
    x = decoder_layer(x)                       # one full-attention layer of the backbone's kind
    logits = lm_head(norm(x))                  # lm_head and embeddings are shared with the backbone

Parameter names match the official checkpoints once prefixed with ``mtp.`` (``mtp.fc.weight``,
``mtp.layers.0.self_attn.q_proj.weight``, ...). Norm weights are zero-centred (applied as ``1 + w``)
exactly like the backbone's, because the norm classes are the backbone's own.
"""

from __future__ import annotations

import torch
from torch import nn


def _text_config(model: nn.Module):
    config = model.config
    return getattr(config, "text_config", None) or config


def _text_model(model: nn.Module) -> nn.Module:
    """The module holding ``embed_tokens``, ``layers``, ``norm`` and ``rotary_emb``."""
    inner = model.model
    return getattr(inner, "language_model", inner)


def _decoder_layer_class(model: nn.Module):
    return type(_text_model(model).layers[0])


def _norm_class(model: nn.Module):
    return type(_text_model(model).norm)


class MTPHead(nn.Module):
    """One MTP layer on top of a transformers Qwen3.5 / Qwen3.5-MoE / Qwen3-Next backbone."""

    def __init__(self, backbone: nn.Module):
        super().__init__()
        config = _text_config(backbone)
        hidden = config.hidden_size
        layer_types = getattr(config, "layer_types", None)
        if layer_types:
            full_index = layer_types.index("full_attention")
        else:
            full_index = config.full_attention_interval - 1
        norm_cls = _norm_class(backbone)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = norm_cls(hidden, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = norm_cls(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([_decoder_layer_class(backbone)(config, full_index)])
        self.norm = norm_cls(hidden, eps=config.rms_norm_eps)
        self._full_index = full_index
        # Initialise like the backbone's own modules (zero-centred norms, N(0, initializer_range) linears,
        # router and experts): without this the MoE experts keep torch.empty's uninitialised memory.
        # The text model's own method: its config (the text config) has initializer_range.
        init_weights = getattr(_text_model(backbone), "_init_weights", None)
        if init_weights is not None:
            self.apply(init_weights)

    def forward(
        self,
        backbone: nn.Module,
        hidden: torch.Tensor,
        next_tokens: torch.Tensor,
        position_offset: int = 0,
    ) -> torch.Tensor:
        """Head output (after ``mtp.norm``) for rows (hidden[p], next_tokens[p]), causal over p.

        hidden: [B, T, H] post-norm backbone hiddens; next_tokens: [B, T] the token after each.
        """
        text = _text_model(backbone)
        e = self.pre_fc_norm_embedding(text.embed_tokens(next_tokens))
        h = self.pre_fc_norm_hidden(hidden)
        x = self.fc(torch.cat([e, h], dim=-1))
        batch, length = next_tokens.shape
        position_ids = torch.arange(position_offset, position_offset + length, device=x.device)
        position_ids = position_ids.unsqueeze(0).expand(batch, -1)
        rotary_ids = position_ids
        if getattr(text.rotary_emb, "mrope_section", None) is not None:
            rotary_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
        position_embeddings = text.rotary_emb(x, rotary_ids)
        # An explicit causal mask: with none, only SDPA is causal (it falls back to is_causal); eager
        # attention would let every row attend to later rows.
        mask = torch.full((length, length), torch.finfo(x.dtype).min, dtype=x.dtype, device=x.device)
        mask = mask.triu(1)[None, None].expand(batch, 1, -1, -1)
        for layer in self.layers:
            x = layer(x, attention_mask=mask, position_embeddings=position_embeddings, position_ids=position_ids)
        return self.norm(x)

    def logits(self, backbone: nn.Module, out: torch.Tensor) -> torch.Tensor:
        return backbone.lm_head(out)


def mtp_state_dict(head: MTPHead, per_expert: bool) -> dict[str, torch.Tensor]:
    """The head's tensors named as in the official checkpoints (``mtp.*``).

    transformers keeps MoE experts fused in memory (``experts.gate_up_proj`` [E, 2I, H],
    ``experts.down_proj`` [E, H, I]). Qwen3.6-MoE files store them fused like that; Qwen3.5-MoE and
    Qwen3-Next heads store them per expert (``experts.{e}.{gate,up,down}_proj.weight``):
    ``per_expert=True`` writes that layout.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in head.state_dict().items():
        tensor = tensor.detach().contiguous()
        if per_expert and name.endswith("experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            mid = tensor.shape[-2] // 2
            for e in range(tensor.shape[0]):
                out[f"mtp.{prefix}{e}.gate_proj.weight"] = tensor[e, :mid].contiguous()
                out[f"mtp.{prefix}{e}.up_proj.weight"] = tensor[e, mid:].contiguous()
        elif per_expert and name.endswith("experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(tensor.shape[0]):
                out[f"mtp.{prefix}{e}.down_proj.weight"] = tensor[e].contiguous()
        else:
            out[f"mtp.{name}"] = tensor
    return out
