"""Train the demo model that ships with exo: a tiny Qwen3.5-shaped model with a genuinely trained MTP head.

Everything is reproducible from what a Python install already holds, with no download:

* corpus: the ``.py`` files of the running interpreter's standard library (sorted, a fixed exclusion rule,
  a fixed held-out split by file);
* tokenizer: byte-level BPE trained on that corpus, with Qwen's ChatML special tokens and chat template;
* model: transformers' own ``qwen3_5`` (or ``qwen3_5_moe``) modeling code (GatedDeltaNet layers with full
  attention every 4th layer, tied embeddings) plus ``exo.training.mtp_torch.MTPHead``, trained together on
  next-token loss + the head's next-next-token loss;
* export: the raw Hugging Face layout of the official Qwen3.5 checkpoints (nested ``text_config``,
  ``model.language_model.*`` + ``mtp.*`` in bf16, two shards, the head in the last one).

Usage (from the repository root, ``PYTHONPATH=src``)::

    python scripts/train_demo_model.py --preset tiny --out-dir out/exo-tiny --records-dir out  # ~30 s, CPU
    python scripts/train_demo_model.py --preset demo --max-minutes 6.8 \\
        --out-dir src/exo/assets/models/exo-demo                                        # GPU, ~5 min
    python scripts/train_demo_model.py --preset demo-moe --max-minutes 6.8 \\
        --out-dir src/exo/assets/models/exo-demo-moe

``scripts/demo_model/README.md`` says how the shipped checkpoints were made and selected.
``scripts/demo_model/check_export.py`` checks an export against transformers and mlx-lm.

The run writes ``<records-dir>/<name>.json`` and ``<name>.md`` (corpus, config, losses over time,
held-out losses, head agreement, acceptance per draft position at K = 1..3, greedy samples).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import json
import math
import os
import platform
import random
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from torch import nn

from exo.training.mtp_torch import MTPHead, mtp_state_dict

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ENDOFTEXT, IM_START, IM_END = SPECIAL_TOKENS

# Qwen2/3's pre-tokenizer split (words, single digits, punctuation runs, newlines, runs of spaces that keep
# Python indentation whole), except that a punctuation run never swallows the newline after it: Qwen's
# `[\r\n]*` there makes "):" and "):\n" different tokens, so a raw prompt ending in "def f(n):" would end
# on a token the model only ever saw before <|im_end|>.
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen-style ChatML. No default system message; add_generation_prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Directories never used as corpus: test suites, third-party packages, generated codec tables.
EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "encodings"}
)
MAX_FILE_BYTES = 300_000  # larger stdlib files are generated data (pydoc_data/topics.py), not code
HELDOUT_PERCENT = 5

SAMPLE_PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:"]
CHAT_SAMPLE_PROMPTS = ["def fibonacci(n):", "Return the greatest common divisor of a and b."]


@dataclass(frozen=True)
class Preset:
    name: str
    arch: str  # "dense" or "moe"
    vocab_size: int
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    linear_key_heads: int
    linear_value_heads: int
    linear_head_dim: int
    seq_len: int
    batch_size: int
    lr: float
    steps: int | None  # None: from epochs, else run until the time budget is spent
    max_minutes: float
    reserve_seconds: float  # budget kept for the final evaluation and export
    max_files: int | None = None  # the first N corpus files (sorted), to keep the tiny preset fast
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    rope_theta: float = 10_000.0
    max_position_embeddings: int = 4096
    epochs: float | None = None  # passes over the training tokens; sets steps when steps is None
    dropout: float = 0.0  # on every residual branch (token mixer and MLP outputs), backbone and head
    head_weight: float = 0.7
    router_aux_weight: float = 0.01
    weight_decay: float = 0.1
    warmup_fraction: float = 0.03
    log_interval: int = 25
    eval_interval: int = 200
    eval_windows_during: int = 32
    eval_windows_final: int = 128
    accept_prompts: int = 32
    accept_prompt_len: int = 96
    accept_gen_len: int = 64
    sample_tokens: int = 120


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        name="exo-tiny",
        arch="dense",
        vocab_size=512,
        hidden_size=64,
        num_layers=4,
        intermediate_size=128,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        linear_key_heads=1,
        linear_value_heads=2,
        linear_head_dim=32,
        seq_len=64,
        batch_size=4,
        lr=3e-3,
        steps=None,
        epochs=0.012,  # 30 steps
        dropout=0.1,
        max_minutes=2.0,
        reserve_seconds=5.0,
        max_files=60,
        log_interval=10,
        eval_interval=15,
        eval_windows_during=4,
        eval_windows_final=8,
        accept_prompts=3,
        accept_prompt_len=24,
        accept_gen_len=12,
        sample_tokens=16,
    ),
    "tiny-moe": Preset(
        name="exo-tiny-moe",
        arch="moe",
        vocab_size=512,
        hidden_size=64,
        num_layers=4,
        intermediate_size=0,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        linear_key_heads=1,
        linear_value_heads=2,
        linear_head_dim=32,
        seq_len=64,
        batch_size=4,
        lr=3e-3,
        steps=None,
        epochs=0.012,  # 30 steps
        dropout=0.1,
        max_minutes=2.0,
        reserve_seconds=5.0,
        max_files=60,
        num_experts=4,
        experts_per_token=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        log_interval=10,
        eval_interval=15,
        eval_windows_during=4,
        eval_windows_final=8,
        accept_prompts=3,
        accept_prompt_len=24,
        accept_gen_len=12,
        sample_tokens=16,
    ),
    # ~8.9M parameters, ~17.7 MB in bf16 (see parameter_count in the records).
    "demo": Preset(
        name="exo-demo",
        arch="dense",
        vocab_size=4096,
        hidden_size=256,
        num_layers=8,
        intermediate_size=768,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        linear_key_heads=2,
        linear_value_heads=4,
        linear_head_dim=64,
        seq_len=512,
        batch_size=64,
        lr=2e-3,
        steps=None,
        epochs=14.0,
        dropout=0.3,
        eval_interval=100,
        max_minutes=9.0,
        reserve_seconds=60.0,
    ),
    # ~3.5M parameters, ~7 MB: 8 routed experts (top-2) + a shared expert in every layer and in the head.
    "demo-moe": Preset(
        name="exo-demo-moe",
        arch="moe",
        vocab_size=4096,
        hidden_size=128,
        num_layers=8,
        intermediate_size=0,
        num_heads=2,
        num_kv_heads=1,
        head_dim=64,
        linear_key_heads=1,
        linear_value_heads=2,
        linear_head_dim=64,
        seq_len=512,
        batch_size=64,
        lr=2e-3,
        steps=None,
        epochs=11.0,
        dropout=0.2,
        eval_interval=100,
        max_minutes=9.0,
        reserve_seconds=60.0,
        num_experts=8,
        experts_per_token=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
    ),
}


# ----------------------------------------------------------------------------------------------- corpus


@dataclass
class Corpus:
    train: list[tuple[str, str]]  # (relative path, text)
    heldout: list[tuple[str, str]]
    info: dict = field(default_factory=dict)


def _is_heldout(rel_path: str) -> bool:
    digest = hashlib.sha256(rel_path.encode()).hexdigest()
    return int(digest, 16) % 100 < HELDOUT_PERCENT


def collect_corpus(stdlib_dir: Path, max_files: int | None) -> Corpus:
    """The stdlib's .py files in sorted order, minus the fixed exclusions, split by a hash of the path."""
    files: list[tuple[str, str]] = []
    skipped = {"excluded_dir": 0, "too_large": 0, "not_utf8": 0}
    for path in sorted(stdlib_dir.rglob("*.py")):
        rel = path.relative_to(stdlib_dir).as_posix()
        if any(part in EXCLUDED_DIRS for part in Path(rel).parts[:-1]):
            skipped["excluded_dir"] += 1
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            skipped["too_large"] += 1
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            skipped["not_utf8"] += 1
            continue
        files.append((rel, text))
    if max_files is not None:
        files = files[:max_files]
    heldout = [f for f in files if _is_heldout(f[0])]
    if not heldout:  # tiny corpora: still hold one file out, the one with the smallest path hash
        heldout = [min(files, key=lambda f: hashlib.sha256(f[0].encode()).hexdigest())]
    held = {f[0] for f in heldout}
    train = [f for f in files if f[0] not in held]
    listing = "\n".join(f"{rel}\t{hashlib.sha256(text.encode()).hexdigest()}" for rel, text in files)
    info = {
        "source": "CPython standard library of the interpreter running the script (sysconfig stdlib)",
        "python_version": platform.python_version(),
        "python_implementation": platform.python_implementation(),
        "rule": (
            f"sorted **/*.py; skip dirs {sorted(EXCLUDED_DIRS)}; skip files > {MAX_FILE_BYTES} bytes or not "
            f"UTF-8; held out: sha256(relative path) % 100 < {HELDOUT_PERCENT}"
            + (f"; first {max_files} files only" if max_files else "")
        ),
        "files": len(files),
        "bytes": sum(len(t.encode()) for _, t in files),
        "train_files": len(train),
        "train_bytes": sum(len(t.encode()) for _, t in train),
        "heldout_files": len(heldout),
        "heldout_bytes": sum(len(t.encode()) for _, t in heldout),
        "heldout_paths": [rel for rel, _ in heldout],
        "skipped": skipped,
        "file_list_sha256": hashlib.sha256(listing.encode()).hexdigest(),
    }
    return Corpus(train=train, heldout=heldout, info=info)


def chat_examples(files: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(user, assistant) pairs from top-level functions and classes, so the model also answers in ChatML.

    The user turn is the block's header line(s) or, for half of the documented blocks (by a hash of the
    path and name), the docstring's first line; the assistant turn is the whole block.
    """
    pairs: list[tuple[str, str]] = []
    for rel, text in files:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines()
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            end = node.end_lineno or node.lineno
            block = "\n".join(lines[start:end])
            if not 2 <= end - start <= 80 or len(block) > 3000:
                continue
            header_lines = []
            for line in lines[node.lineno - 1 : node.lineno + 5]:  # the signature, up to its colon
                header_lines.append(line)
                if line.rstrip().endswith(":"):
                    break
            header = "\n".join(header_lines).strip()
            doc = ast.get_docstring(node)
            summary = doc.strip().splitlines()[0].strip() if doc and doc.strip() else ""
            use_doc = summary and int(hashlib.sha256(f"{rel}:{node.name}".encode()).hexdigest(), 16) % 2 == 0
            pairs.append((summary if use_doc else header, block))
    return pairs


def chat_text(user: str, assistant: str | None = None) -> str:
    """The ChatML rendering CHAT_TEMPLATE produces (with the generation prompt when assistant is None)."""
    text = f"{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n"
    return text if assistant is None else text + f"{assistant}{IM_END}\n"


# -------------------------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path) -> None:
    tokenizer.save(str(out_dir / "tokenizer.json"))
    added = {
        str(tokenizer.token_to_id(tok)): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for tok in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": 4096,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def encode_documents(tokenizer: Tokenizer, docs: list[str]) -> list[int]:
    """One stream: every document starts with <|endoftext|>."""
    eot = tokenizer.token_to_id(ENDOFTEXT)
    stream: list[int] = []
    for enc in tokenizer.encode_batch(docs, add_special_tokens=False):
        stream.append(eot)
        stream.extend(enc.ids)
    return stream


# ------------------------------------------------------------------------------------------------ model


def layer_types(num_layers: int) -> list[str]:
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(num_layers)]


def text_config_dict(preset: Preset, tokenizer: Tokenizer) -> dict:
    """The exported ``text_config``, in the key names of the official Qwen3.5 configs."""
    rotary_half = int(preset.head_dim * 0.25) // 2
    # mrope_section splits the rotary half-dims over (t, h, w); text-only positions make it a no-op.
    mrope = [rotary_half - 2 * (rotary_half // 3), rotary_half // 3, rotary_half // 3]
    config = {
        "model_type": "qwen3_5_moe_text" if preset.arch == "moe" else "qwen3_5_text",
        "vocab_size": tokenizer.get_vocab_size(),
        "hidden_size": preset.hidden_size,
        "num_hidden_layers": preset.num_layers,
        "layer_types": layer_types(preset.num_layers),
        "full_attention_interval": 4,
        "num_attention_heads": preset.num_heads,
        "num_key_value_heads": preset.num_kv_heads,
        "head_dim": preset.head_dim,
        "attn_output_gate": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "linear_num_key_heads": preset.linear_key_heads,
        "linear_num_value_heads": preset.linear_value_heads,
        "linear_key_head_dim": preset.linear_head_dim,
        "linear_value_head_dim": preset.linear_head_dim,
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "max_position_embeddings": preset.max_position_embeddings,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": preset.rope_theta,
            "partial_rotary_factor": 0.25,
            "mrope_section": mrope,
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": True,
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": tokenizer.token_to_id(IM_END),
        "pad_token_id": tokenizer.token_to_id(ENDOFTEXT),
        "dtype": "bfloat16",
    }
    if preset.arch == "moe":
        config.update(
            {
                "num_experts": preset.num_experts,
                "num_experts_per_tok": preset.experts_per_token,
                "moe_intermediate_size": preset.moe_intermediate_size,
                "shared_expert_intermediate_size": preset.shared_expert_intermediate_size,
                "norm_topk_prob": True,
                "router_aux_loss_coef": preset.router_aux_weight,
                "output_router_logits": False,
            }
        )
    else:
        config["intermediate_size"] = preset.intermediate_size
    return config


def build_model(preset: Preset, text_config: dict) -> tuple[nn.Module, MTPHead]:
    if preset.arch == "moe":
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM

        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**text_config))
    else:
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**text_config))
    model.config._attn_implementation = "sdpa"  # causal without a mask, also inside the MTP head
    head = MTPHead(model)
    # The head's layers are built outside post_init: give them the backbone's initialisation (MoE expert
    # tensors are created with torch.empty and would otherwise hold garbage).
    for module in head.modules():
        model._init_weights(module)
    return model, head


def add_residual_dropout(model: nn.Module, head: MTPHead, p: float) -> int:
    """Dropout on every residual branch (token mixer and MLP outputs) of the backbone and the head.

    The stdlib corpus is small for a model of this size; this is the regulariser that keeps it from
    memorising the training files. Forward hooks leave the modeling code untouched; eval mode disables them.
    """

    def hook(module: nn.Module, _inputs, output):
        if isinstance(output, tuple):
            return (F.dropout(output[0], p, module.training), *output[1:])
        return F.dropout(output, p, module.training)

    layers = list(model.model.layers) + list(head.layers)
    count = 0
    for layer in layers:
        mixer = getattr(layer, "linear_attn", None) or layer.self_attn
        for module in (mixer, layer.mlp):
            module.register_forward_hook(hook)
            count += 1
    return count


def parameter_count(model: nn.Module, head: nn.Module) -> dict[str, int]:
    backbone = sum(p.numel() for p in model.parameters())  # tied lm_head counted once
    mtp = sum(p.numel() for p in head.parameters())
    return {"backbone": backbone, "mtp_head": mtp, "total": backbone + mtp}


class RouterRecorder:
    """Collects every MoE router's logits of one forward (backbone and head) for the balancing loss."""

    def __init__(self, modules: list[nn.Module]):
        self.logits: list[torch.Tensor] = []
        self.handles = []
        for module in modules:
            for sub in module.modules():
                if type(sub).__name__.endswith("TopKRouter"):
                    self.handles.append(sub.register_forward_hook(self._hook))

    def _hook(self, _module, _inputs, output):
        self.logits.append(output[0])

    def balancing_loss(self, num_experts: int, top_k: int) -> torch.Tensor:
        """Switch-Transformer loss, averaged over routers: E * sum_e (token share of e) * (mean prob of e)."""
        losses = []
        for logits in self.logits:
            probs = logits.float().softmax(-1)
            chosen = probs.topk(top_k, dim=-1).indices
            share = F.one_hot(chosen, num_experts).float().sum(1).mean(0) / top_k
            losses.append(num_experts * (share * probs.mean(0)).sum())
        self.logits.clear()
        return torch.stack(losses).mean()


# --------------------------------------------------------------------------------------------- training


def autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def forward_losses(model, head, window: torch.Tensor, head_weight: float):
    """Next-token loss of the backbone and next-next-token loss of the head on [B, L+1] token windows.

    Head row p takes the backbone's post-norm hidden at p and the true token p+1, and predicts token p+2.
    """
    inputs, targets = window[:, :-1], window[:, 1:]
    hidden = model.model(input_ids=inputs, use_cache=False).last_hidden_state
    logits = model.lm_head(hidden)
    main = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    head_out = head(model, hidden[:, :-1], inputs[:, 1:])
    head_logits = head.logits(model, head_out)
    head_loss = F.cross_entropy(head_logits.flatten(0, 1).float(), targets[:, 1:].flatten())
    return main, head_loss, main + head_weight * head_loss, logits, head_logits


def lr_at(progress: float, preset: Preset) -> float:
    if progress < preset.warmup_fraction:
        return preset.lr * max(progress / preset.warmup_fraction, 0.01)
    tail = (progress - preset.warmup_fraction) / (1 - preset.warmup_fraction)
    return preset.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(tail, 1.0))))


def heldout_windows(stream: torch.Tensor, length: int, count: int) -> torch.Tensor:
    """Up to ``count`` non-overlapping windows of ``length`` tokens, evenly spread over the stream."""
    available = (len(stream) - 1) // length
    if available < 1:
        raise ValueError("held-out stream is shorter than one window")
    picks = torch.linspace(0, available - 1, min(count, available)).long()
    return torch.stack([stream[i * length : i * length + length] for i in picks.tolist()])


@torch.no_grad()
def heldout_metrics(model, head, windows: torch.Tensor, head_weight: float, device, batch: int = 16) -> dict:
    model.eval()
    totals = {"loss": 0.0, "head_loss": 0.0, "agree": 0.0, "head_acc": 0.0, "acc": 0.0}
    n = 0
    for start in range(0, len(windows), batch):
        w = windows[start : start + batch].to(device)
        with autocast(device):
            main, head_loss, _, logits, head_logits = forward_losses(model, head, w, head_weight)
        greedy = logits.argmax(-1)  # [B, L]: backbone's choice for token p+1
        drafts = head_logits.argmax(-1)  # [B, L-1]: head's choice for token p+2
        k = len(w)
        totals["loss"] += main.item() * k
        totals["head_loss"] += head_loss.item() * k
        totals["agree"] += (drafts == greedy[:, 1:]).float().mean().item() * k
        totals["head_acc"] += (drafts == w[:, 2:]).float().mean().item() * k
        totals["acc"] += (greedy == w[:, 1:]).float().mean().item() * k
        n += k
    model.train()
    return {
        "heldout_loss": totals["loss"] / n,
        "heldout_head_loss": totals["head_loss"] / n,
        "head_agreement_with_backbone_greedy": totals["agree"] / n,
        "head_top1_accuracy": totals["head_acc"] / n,
        "backbone_top1_accuracy": totals["acc"] / n,
        "windows": n,
        "window_tokens": windows.shape[1] - 1,
    }


def bits_per_byte(nats_per_token: float, tokens: int, text_bytes: int) -> float:
    """Tokenizer-independent loss: nats per token -> bits per byte of held-out text."""
    return nats_per_token * tokens / text_bytes / math.log(2)


def train(preset: Preset, model, head, train_stream, heldout, device, deadline: float, seed: int) -> dict:
    params = [p for p in list(model.parameters()) + list(head.parameters()) if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]  # norms, A_log, dt_bias
    groups = [
        {"params": decay, "weight_decay": preset.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=preset.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    router = RouterRecorder([model, head]) if preset.arch == "moe" else None
    generator = torch.Generator().manual_seed(seed)
    stream = train_stream.to(device)
    span = preset.seq_len + 1
    offsets_base = torch.arange(span, device=device)
    eval_windows = heldout_windows(heldout, span, preset.eval_windows_during)

    history: list[dict] = []
    curve: list[list] = []  # [step, train loss, train head loss] at every log interval
    best = {"score": float("inf"), "step": 0, "state": None}
    started = time.time()
    budget = max(deadline - started, 1.0)
    step, tokens = 0, 0
    since_eval: list[tuple[float, float]] = []  # logged (loss, head loss) since the previous evaluation

    def evaluate(at_step: int) -> None:
        metrics = heldout_metrics(model, head, eval_windows, preset.head_weight, device)
        score = metrics["heldout_loss"] + preset.head_weight * metrics["heldout_head_loss"]
        record = {"step": at_step, "tokens": tokens, "seconds": round(time.time() - started, 1)}
        record.update({k: round(v, 4) for k, v in metrics.items() if isinstance(v, float)})
        if since_eval:
            record["train_loss"] = round(sum(x[0] for x in since_eval) / len(since_eval), 4)
            record["train_head_loss"] = round(sum(x[1] for x in since_eval) / len(since_eval), 4)
            since_eval.clear()
        history.append(record)
        print(f"eval {json.dumps(record)}", flush=True)
        if score < best["score"]:
            best.update(score=score, step=at_step, state=_snapshot(model, head))

    model.train()
    time_bound = False
    while True:
        # Progress drives warmup and cosine decay: the step target when there is one, but never behind the
        # clock, so a run that is slower than planned still anneals before its wall-time budget ends.
        time_progress = (time.time() - started) / budget
        step_progress = step / preset.steps if preset.steps is not None else 0.0
        if time_progress >= 1.0 or (preset.steps is not None and step >= preset.steps):
            break
        time_bound = time_bound or time_progress > step_progress + 0.01
        progress = max(step_progress, time_progress)
        lr = lr_at(progress, preset)
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(stream) - span, (preset.batch_size,), generator=generator).to(device)
        window = stream[starts[:, None] + offsets_base]
        if router is not None:
            router.logits.clear()  # drop what evaluation forwards recorded
        with autocast(device):
            main, head_loss, loss, _, _ = forward_losses(model, head, window, preset.head_weight)
            if router is not None:
                loss = loss + preset.router_aux_weight * router.balancing_loss(
                    preset.num_experts, preset.experts_per_token
                )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        tokens += window.numel() - preset.batch_size
        if step % preset.log_interval == 0 or step == 1:
            pair = (main.item(), head_loss.item())
            curve.append([step, round(pair[0], 4), round(pair[1], 4)])
            since_eval.append(pair)
            rate = tokens / max(time.time() - started, 1e-6)
            print(
                f"step {step} loss {pair[0]:.3f} head {pair[1]:.3f} lr {lr:.2e} "
                f"tok/s {rate:,.0f} elapsed {time.time() - started:.0f}s",
                flush=True,
            )
        if step % preset.eval_interval == 0:
            evaluate(step)
    if not history or history[-1]["step"] != step:
        evaluate(step)
    if router is not None:
        for handle in router.handles:
            handle.remove()
    _restore(model, head, best["state"])
    return {
        "steps": step,
        "tokens_seen": tokens,
        "train_seconds": round(time.time() - started, 1),
        "best_step": best["step"],
        "schedule_bound_by": "time" if time_bound else "steps",
        "history": history,
        "train_curve": curve,
    }


def _snapshot(model, head) -> dict:
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "head": {k: v.detach().clone() for k, v in head.state_dict().items()},
    }


def _restore(model, head, state: dict | None) -> None:
    if state is not None:
        model.load_state_dict(state["model"])
        head.load_state_dict(state["head"])


@torch.no_grad()
def round_to_bf16(*modules: nn.Module) -> None:
    """Evaluate exactly the shipped weights: round every parameter through bf16 (kept in fp32)."""
    for module in modules:
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16).float())


# ------------------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def greedy_generate(model, prompts: torch.Tensor, new_tokens: int, device, stop_ids=()) -> torch.Tensor:
    """Plain greedy decoding by full re-forward (simple and cache-free): [B, P] -> [B, P + new_tokens]."""
    seq = prompts.to(device)
    for _ in range(new_tokens):
        with autocast(device):
            hidden = model.model(input_ids=seq, use_cache=False).last_hidden_state[:, -1]
            nxt = model.lm_head(hidden).argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
        if stop_ids and len(seq) == 1 and nxt.item() in stop_ids:
            break
    return seq


@torch.no_grad()
def draft_chains(model, head, seq: torch.Tensor, first: int, depth: int, device):
    """Greedy drafts of depth 1..``depth`` for every round start n = first .. T-2 of one sequence.

    Head row p consumes (hidden[p], token[p+1]) at RoPE position p. A round that starts at n (hidden[n] and
    token[n+1] verified) drafts d1 from row n; draft j+1 comes from row n+j, which holds the head's own
    output and draft j (chained, as at inference). Rows after n+j do not matter: the head is causal.
    Returns ([N, depth] drafts, the N round starts).
    """
    seq = seq.to(device)[None]
    with autocast(device):
        hidden = model.model(input_ids=seq, use_cache=False).last_hidden_state
        rows_h, rows_t = hidden[0, :-1], seq[0, 1:]  # the T-1 true rows
        out = head(model, rows_h[None], rows_t[None])[0]
        first_drafts = head.logits(model, out).argmax(-1)
    starts = torch.arange(first, seq.shape[1] - 1, device=device)
    count = len(starts)
    batch_index = torch.arange(count, device=device)
    chain_h, chain_t = [out[starts]], [first_drafts[starts]]
    for j in range(1, depth):
        width = int(starts.max()) + j + 1
        base_h = torch.zeros(count, width, out.shape[-1], device=device, dtype=out.dtype)
        base_t = torch.zeros(count, width, dtype=seq.dtype, device=device)
        true_len = min(width, rows_h.shape[0])
        base_h[:, :true_len] = rows_h[:true_len].to(out.dtype)
        base_t[:, :true_len] = rows_t[:true_len]
        for i in range(j):
            base_h[batch_index, starts + i + 1] = chain_h[i].to(out.dtype)
            base_t[batch_index, starts + i + 1] = chain_t[i]
        with autocast(device):
            step_out = head(model, base_h, base_t)[batch_index, starts + j]
            step_draft = head.logits(model, step_out).argmax(-1)
        chain_h.append(step_out)
        chain_t.append(step_draft)
    return torch.stack(chain_t, dim=1), starts


@torch.no_grad()
def acceptance(model, head, heldout: torch.Tensor, preset: Preset, device) -> dict:
    """Simulated greedy MTP decoding on held-out prompts, for K = 1, 2, 3 drafts per round.

    Each prompt is continued greedily by the backbone; a round at n drafts K tokens by chaining the head,
    accepts the longest prefix equal to the backbone's greedy tokens, emits one more, and moves on.
    """
    span = preset.accept_prompt_len
    prompts = heldout_windows(heldout, span, preset.accept_prompts)
    sequences = greedy_generate(model, prompts, preset.accept_gen_len, device)
    results = {k: {"attempted": [0] * k, "accepted": [0] * k, "rounds": 0, "emitted": 0} for k in (1, 2, 3)}
    for seq in sequences:
        with autocast(device):
            logits = model.lm_head(model.model(input_ids=seq[None], use_cache=False).last_hidden_state)
        verify = logits.argmax(-1)[0]  # verify[p] = backbone's greedy token p+1
        drafts, starts = draft_chains(model, head, seq, span - 1, 3, device)
        verify = verify.tolist()
        by_start = {n: d for n, d in zip(starts.tolist(), drafts.tolist(), strict=True)}
        last = len(seq) - 1
        for k in (1, 2, 3):
            stats = results[k]
            n = span - 1
            while n + k + 1 <= last:
                accepted = 0
                for i in range(k):
                    stats["attempted"][i] += 1
                    if by_start[n][i] == verify[n + 1 + i]:
                        stats["accepted"][i] += 1
                        accepted += 1
                    else:
                        break
                stats["rounds"] += 1
                stats["emitted"] += accepted + 1
                n += accepted + 1
    out = {}
    for k, stats in results.items():
        per_position = [
            a / t if t else None for a, t in zip(stats["accepted"], stats["attempted"], strict=True)
        ]
        drafted = stats["rounds"] * k
        out[f"K={k}"] = {
            "acceptance_per_position": [round(x, 4) if x is not None else None for x in per_position],
            "accepted_over_drafted": round(sum(stats["accepted"]) / drafted, 4) if drafted else None,
            "tokens_per_round": round(stats["emitted"] / stats["rounds"], 4) if stats["rounds"] else None,
            "rounds": stats["rounds"],
        }
    out["prompts"] = len(sequences)
    out["prompt_tokens"] = span
    out["generated_tokens"] = preset.accept_gen_len
    return out


@torch.no_grad()
def samples(model, tokenizer: Tokenizer, preset: Preset, device) -> list[dict]:
    stops = {tokenizer.token_to_id(IM_END), tokenizer.token_to_id(ENDOFTEXT)}
    cases = [("raw", p, p) for p in SAMPLE_PROMPTS] + [("chat", p, chat_text(p)) for p in CHAT_SAMPLE_PROMPTS]
    out = []
    for mode, prompt, text in cases:
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False).ids])
        seq = greedy_generate(model, ids, preset.sample_tokens, device, stop_ids=stops)[0].tolist()
        new = seq[ids.shape[1] :]
        if any(t in stops for t in new):
            new = new[: min(new.index(t) for t in stops if t in new)]
        out.append(
            {"mode": mode, "prompt": prompt, "completion": tokenizer.decode(new, skip_special_tokens=False)}
        )
    return out


# ----------------------------------------------------------------------------------------------- export


def export(preset: Preset, model, head, tokenizer: Tokenizer, text_config: dict, out_dir: Path) -> dict:
    """Raw Hugging Face layout of the official Qwen3.5 checkpoints, head in the last of two shards."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("model*.safetensors"):
        stale.unlink()
    backbone = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":  # tied to the embeddings
            continue
        assert name.startswith("model."), name
        backbone["model.language_model." + name[len("model.") :]] = tensor
    mtp = mtp_state_dict(head, per_expert=preset.arch == "moe")
    to_bf16 = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in {**backbone, **mtp}.items()}
    backbone_bytes = sum(to_bf16[k].numel() * 2 for k in backbone)
    first, second, acc = {}, {}, 0
    for name in backbone:  # state_dict order: embeddings, layers 0.., final norm
        target = first if acc < backbone_bytes / 2 else second
        target[name] = to_bf16[name]
        acc += to_bf16[name].numel() * 2
    second.update({k: to_bf16[k] for k in mtp})
    shards = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": second}
    weight_map = {}
    for filename, tensors in shards.items():
        save_file(tensors, str(out_dir / filename), metadata={"format": "pt"})
        weight_map.update({k: filename for k in tensors})
    total = sum(t.numel() * 2 for t in to_bf16.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    import transformers

    moe = preset.arch == "moe"
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": text_config,
        "tie_word_embeddings": True,
        "transformers_version": transformers.__version__,
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {
        "eos_token_id": [tokenizer.token_to_id(IM_END), tokenizer.token_to_id(ENDOFTEXT)],
        "pad_token_id": tokenizer.token_to_id(ENDOFTEXT),
        "do_sample": False,
        "transformers_version": transformers.__version__,
    }
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_tokenizer(tokenizer, out_dir)
    files = {p.name: p.stat().st_size for p in sorted(out_dir.iterdir()) if p.is_file()}
    return {
        "files": files,
        "total_bytes": sum(files.values()),
        "weight_bytes": total,
        "mtp_tensors": len(mtp),
        "backbone_tensors": len(backbone),
    }


# -------------------------------------------------------------------------------------------------- main


def write_records(records: dict, records_dir: Path, name: str) -> None:
    records_dir.mkdir(parents=True, exist_ok=True)
    (records_dir / f"{name}.json").write_text(json.dumps(records, indent=2) + "\n")
    (records_dir / f"{name}.md").write_text(markdown_summary(records))


def markdown_summary(r: dict) -> str:
    c, t, ev = r["corpus"], r.get("training", {}), r.get("evaluation", {})
    lines = [
        f"# {r['name']} training record",
        "",
        f"- command: `{r['command']}`",
        f"- device: {r['device']}; torch {r['versions']['torch']}, transformers {r['versions']['transformers']}",
        f"- corpus: Python {c['python_version']} stdlib, {c['files']} files, {c['bytes']:,} bytes "
        f"({c['train_files']} train / {c['heldout_files']} held-out files), file list sha256 "
        f"`{c['file_list_sha256'][:16]}`",
        f"- tokens: {r['tokens']['train']:,} train ({r['tokens']['chat_examples']} ChatML examples included), "
        f"{r['tokens']['heldout']:,} held-out",
        f"- parameters: {r['parameters']['total']:,} ({r['parameters']['backbone']:,} backbone + "
        f"{r['parameters']['mtp_head']:,} MTP head)",
    ]
    if t:
        lines.append(
            f"- training: {t['steps']} steps, {t['tokens_seen']:,} tokens seen, {t['train_seconds']} s "
            f"(best held-out at step {t['best_step']}, schedule bound by {t.get('schedule_bound_by')}); "
            f"dropout {r['preset']['dropout']}, peak lr {r['preset']['lr']}, batch {r['preset']['batch_size']} x "
            f"{r['preset']['seq_len']} tokens; total wall time {r.get('wall_seconds')} s"
        )
    if "export" in r:
        lines.append(f"- export: {r['export']['total_bytes']:,} bytes in {len(r['export']['files'])} files")
    if ev:
        h = ev["heldout"]
        lines += [
            "",
            "## Held-out evaluation (shipped bf16 weights)",
            "",
            f"- next-token loss {h['heldout_loss']:.4f} nats/token ({h['heldout_bits_per_byte']:.4f} bits/byte), "
            f"head (next-next-token) loss {h['heldout_head_loss']:.4f} ({h['heldout_head_bits_per_byte']:.4f} bits/byte)",
            f"- head top-1 agreement with the backbone's greedy token: {h['head_agreement_with_backbone_greedy']:.4f}",
            f"- top-1 accuracy: backbone {h['backbone_top1_accuracy']:.4f}, head {h['head_top1_accuracy']:.4f}",
            "",
            "| K | acceptance per position | accepted / drafted | tokens per round |",
            "|---|---|---|---|",
        ]
        for k in (1, 2, 3):
            a = ev["acceptance"][f"K={k}"]
            lines.append(
                f"| {k} | {', '.join(str(x) for x in a['acceptance_per_position'])} | "
                f"{a['accepted_over_drafted']} | {a['tokens_per_round']} |"
            )
    if t.get("history"):
        lines += [
            "",
            "## Losses over time",
            "",
            "| step | tokens | s | train | train head | held-out (subset) | held-out head (subset) |",
            "|---|---|---|---|---|---|---|",
        ]
        for h in t["history"]:
            lines.append(
                f"| {h['step']} | {h['tokens']:,} | {h['seconds']} | {h.get('train_loss', '')} | "
                f"{h.get('train_head_loss', '')} | {h['heldout_loss']} | {h['heldout_head_loss']} |"
            )
    if ev.get("samples"):
        lines += ["", "## Greedy samples", ""]
        for s in ev["samples"]:
            lines += [
                f"### {s['mode']}: `{s['prompt']!r}`",
                "",
                "```",
                s["prompt"] + s["completion"] if s["mode"] == "raw" else s["completion"],
                "```",
                "",
            ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=["tiny", "demo", "demo-moe"], default="tiny")
    parser.add_argument("--arch", choices=["dense", "moe"], help="override the preset's architecture")
    parser.add_argument("--out-dir", type=Path, required=True, help="where the checkpoint is exported")
    parser.add_argument("--records-dir", type=Path, default=Path("scripts/demo_model"))
    parser.add_argument("--name", help="records file name (default: the preset's model name)")
    parser.add_argument(
        "--max-minutes", type=float, help="wall-time budget of the whole run, export included"
    )
    parser.add_argument("--steps", type=int, help="fixed number of steps (step-based schedule)")
    parser.add_argument("--epochs", type=float, help="passes over the training tokens (sets the steps)")
    parser.add_argument("--dropout", type=float, help="residual-branch dropout while training")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--stdlib-dir", type=Path, help="corpus root (default: this interpreter's stdlib)")
    args = parser.parse_args(argv)

    t0 = time.time()
    key = args.preset
    base = PRESETS[key]
    if args.arch and args.arch != base.arch:
        key = {"tiny": "tiny-moe", "demo": "demo-moe", "demo-moe": "demo"}[key]
        base = PRESETS[key]
    preset = dataclasses.replace(
        base,
        max_minutes=args.max_minutes if args.max_minutes is not None else base.max_minutes,
        steps=args.steps if args.steps is not None else base.steps,
        epochs=args.epochs if args.epochs is not None else base.epochs,
        dropout=args.dropout if args.dropout is not None else base.dropout,
    )
    name = args.name or preset.name
    deadline = t0 + preset.max_minutes * 60 - preset.reserve_seconds
    device = torch.device(args.device)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_flush_denormal(True)  # tiny weights and decays otherwise hit slow denormal paths on CPUs
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    import transformers

    records: dict = {
        "name": name,
        "preset": dataclasses.asdict(preset),
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:])
        if argv is None
        else "main(" + repr(argv) + ")",
        "seed": args.seed,
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({os.cpu_count()} cores)",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }

    stdlib = args.stdlib_dir or Path(sysconfig.get_paths()["stdlib"])
    corpus = collect_corpus(stdlib, preset.max_files)
    records["corpus"] = corpus.info
    print(f"corpus {json.dumps({k: v for k, v in corpus.info.items() if k != 'heldout_paths'})}", flush=True)

    tokenizer = train_tokenizer([text for _, text in corpus.train], preset.vocab_size)
    pairs = chat_examples(corpus.train)
    docs = [text for _, text in corpus.train] + [chat_text(u, a) for u, a in pairs]
    random.Random(args.seed).shuffle(docs)
    train_stream = torch.tensor(encode_documents(tokenizer, docs), dtype=torch.long)
    heldout_stream = torch.tensor(
        encode_documents(tokenizer, [t for _, t in corpus.heldout]), dtype=torch.long
    )
    records["tokenizer"] = {
        "vocab_size": tokenizer.get_vocab_size(),
        "type": "byte-level BPE",
        "special_tokens": {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS},
    }
    records["tokens"] = {
        "train": len(train_stream),
        "heldout": len(heldout_stream),
        "chat_examples": len(pairs),
        "train_bytes_per_token": round(corpus.info["train_bytes"] / len(train_stream), 3),
    }
    print(f"tokens {json.dumps(records['tokens'])} ({time.time() - t0:.0f}s)", flush=True)

    text_config = text_config_dict(preset, tokenizer)
    model, head = build_model(preset, text_config)
    model.to(device)
    head.to(device)
    records["parameters"] = parameter_count(model, head)
    if preset.dropout > 0:
        add_residual_dropout(model, head, preset.dropout)
    if preset.steps is None and preset.epochs is not None:
        tokens_per_step = preset.batch_size * preset.seq_len
        preset = dataclasses.replace(
            preset, steps=math.ceil(preset.epochs * len(train_stream) / tokens_per_step)
        )
    records["preset"] = dataclasses.asdict(preset)
    records["text_config"] = text_config
    print(f"parameters {json.dumps(records['parameters'])}", flush=True)

    records["training"] = train(
        preset, model, head, train_stream, heldout_stream, device, deadline, args.seed
    )
    round_to_bf16(model, head)
    records["export"] = export(preset, model, head, tokenizer, text_config, args.out_dir)
    print(f"export {json.dumps(records['export'])} ({time.time() - t0:.0f}s)", flush=True)
    write_records(records, args.records_dir, name)  # a record even if evaluation fails below

    model.eval()
    span = preset.seq_len + 1
    evaluation = {
        "heldout": heldout_metrics(
            model,
            head,
            heldout_windows(heldout_stream, span, preset.eval_windows_final),
            preset.head_weight,
            device,
        )
    }
    held = evaluation["heldout"]
    for key in ("heldout_loss", "heldout_head_loss"):
        held[key.replace("loss", "bits_per_byte")] = bits_per_byte(
            held[key], len(heldout_stream), corpus.info["heldout_bytes"]
        )
    print(f"heldout {json.dumps(evaluation['heldout'])}", flush=True)
    evaluation["acceptance"] = acceptance(model, head, heldout_stream, preset, device)
    print(f"acceptance {json.dumps(evaluation['acceptance'])}", flush=True)
    evaluation["samples"] = samples(model, tokenizer, preset, device)
    for s in evaluation["samples"]:
        print(f"sample [{s['mode']}] {s['prompt']!r} -> {s['completion']!r}", flush=True)
    records["evaluation"] = evaluation
    records["wall_seconds"] = round(time.time() - t0, 1)
    write_records(records, args.records_dir, name)
    print(f"done in {records['wall_seconds']} s", flush=True)


if __name__ == "__main__":
    main()
