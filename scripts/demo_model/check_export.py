"""Check an exported demo checkpoint against the loaders that consume it.

1. transformers loads the raw checkpoint as ``Qwen3_5(Moe)ForConditionalGeneration`` (fp32) and decodes greedily;
2. the ``mtp.*`` tensors load back into ``MTPHead`` exactly (the per-expert MoE layout is re-fused);
3. mlx-lm's ``load_model`` loads the backbone (it drops ``mtp.*``) and ``load_tokenizer`` loads the tokenizer;
   its greedy tokens (cached decoding) must equal transformers' greedy tokens (full re-forward), in fp32;
   the shipped bf16 weights are decoded too and the agreement reported;
4. the tokenizer's chat template renders the ChatML the model was trained on.

Usage (repository root): ``PYTHONPATH=src python scripts/demo_model/check_export.py DIR [--json OUT]``.
Exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import torch
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model, load_tokenizer
from safetensors.torch import load_file

from exo.training.mtp_torch import MTPHead, mtp_state_dict

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:"]
CHAT_PROMPTS = ["def fibonacci(n):", "Return the greatest common divisor of a and b.", "class Stack:"]


# Zero-centred norms that mlx-lm's sanitize turns into ``1 + w``: it adds in the checkpoint's dtype (bf16),
# which rounds the gains to bf16. The fp32 comparison gives transformers the same rounded gains.
SHIFTED_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    "norm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


@torch.no_grad()
def emulate_mlx_norm_rounding(model) -> None:
    text = model.model.language_model
    for name, param in text.named_parameters():
        if name.endswith(SHIFTED_NORMS) and ".linear_attn." not in name:
            param.copy_((1.0 + param).to(torch.bfloat16).float() - 1.0)


def hf_model(path: Path):
    config = json.loads((path / "config.json").read_text())
    if config["model_type"] == "qwen3_5_moe":
        from transformers import Qwen3_5MoeForConditionalGeneration as cls
    else:
        from transformers import Qwen3_5ForConditionalGeneration as cls
    model = cls.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa")
    return model.eval(), config


@torch.no_grad()
def hf_greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    seq = torch.tensor([ids])
    for _ in range(new_tokens):
        logits = model(input_ids=seq, use_cache=False).logits[:, -1]
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    return seq[0, len(ids) :].tolist()


def mlx_greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    steps = generate_step(
        mx.array(ids), model, max_tokens=new_tokens, sampler=lambda x: mx.argmax(x, axis=-1)
    )
    return [int(token) for token, _ in steps]


def mlx_chat(model, tokenizer, prompt: str, max_tokens: int) -> str:
    """Greedy mlx-lm decoding of a user message through the chat template, up to an EOS token."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    out = []
    for token in mlx_greedy(model, tokenizer.encode(text, add_special_tokens=False), max_tokens):
        if token in tokenizer.eos_token_ids:
            break
        out.append(token)
    return tokenizer.decode(out)


def check_head(model, path: Path) -> dict:
    """Load mtp.* from the shards into a fresh MTPHead; its state must round-trip exactly."""
    tensors = {}
    for shard in sorted(path.glob("model-*.safetensors")):
        tensors.update({k: v for k, v in load_file(str(shard)).items() if k.startswith("mtp.")})
    head = MTPHead(model)
    per_expert = any(".experts.0." in k for k in tensors)
    expected = mtp_state_dict(head, per_expert=per_expert)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    state = {}
    for name, tensor in head.state_dict().items():
        if per_expert and name.endswith("experts.gate_up_proj"):
            prefix = "mtp." + name[: -len("gate_up_proj")]
            count = tensor.shape[0]
            state[name] = torch.stack(
                [
                    torch.cat(
                        [tensors[f"{prefix}{e}.gate_proj.weight"], tensors[f"{prefix}{e}.up_proj.weight"]]
                    )
                    for e in range(count)
                ]
            )
        elif per_expert and name.endswith("experts.down_proj"):
            prefix = "mtp." + name[: -len("down_proj")]
            state[name] = torch.stack(
                [tensors[f"{prefix}{e}.down_proj.weight"] for e in range(tensor.shape[0])]
            )
        else:
            state[name] = tensors["mtp." + name]
    head.load_state_dict({k: v.float() for k, v in state.items()})
    roundtrip = mtp_state_dict(head, per_expert=per_expert)
    exact = all(torch.equal(roundtrip[k].to(torch.bfloat16), tensors[k]) for k in tensors)
    last = sorted(path.glob("model-*.safetensors"))[-1].name
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    in_last = all(index[k] == last for k in tensors)
    return {
        "mtp_tensors": len(tensors),
        "missing": missing,
        "unexpected": unexpected,
        "roundtrip_exact": exact,
        "all_in_last_shard": in_last,
        "ok": not missing and not unexpected and exact and in_last,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    path = args.path

    model, config = hf_model(path)
    tokenizer = load_tokenizer(path)
    results: dict = {"model_type": config["model_type"], "head": check_head(model, path)}

    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    results["chat_template_ok"] = chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    results["eos_token_ids"] = sorted(tokenizer.eos_token_ids)

    emulate_mlx_norm_rounding(model)
    mlx_model, _ = load_model(path)
    shipped_dtype = str(mlx_model.language_model.model.embed_tokens.weight.dtype)
    comparisons = []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        reference = hf_greedy(model, ids, args.tokens)
        comparisons.append({"prompt": prompt, "transformers": reference, "text": tokenizer.decode(reference)})
    try:
        bf16 = [
            mlx_greedy(mlx_model, tokenizer.encode(c["prompt"], add_special_tokens=False), args.tokens)
            for c in comparisons
        ]
    except RuntimeError as err:  # e.g. MLX's CPU backend runs gather_mm (MoE experts) in fp32 only
        bf16 = None
        results["mlx_bf16_error"] = str(err)
    mlx_model.set_dtype(mx.float32)
    for i, c in enumerate(comparisons):
        ids = tokenizer.encode(c["prompt"], add_special_tokens=False)
        c["mlx_fp32"] = mlx_greedy(mlx_model, ids, args.tokens)
        # Whole-distribution check on prompt + greedy continuation: layout or norm mistakes show up here
        # even when greedy tokens happen to agree.
        seq = ids + c["transformers"]
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0].numpy()
        got = mlx_model(mx.array([seq]))[0].astype(mx.float32)
        c["max_abs_logit_diff_fp32"] = float(abs(np.array(got) - ref).max())
        c["logit_scale"] = float(abs(ref).max())
        c["fp32_equal"] = c["mlx_fp32"] == c["transformers"] and c["max_abs_logit_diff_fp32"] < 1e-3 * max(
            1.0, c["logit_scale"]
        )
        if bf16 is not None:
            agree = 0
            for a, b in zip(bf16[i], c["transformers"], strict=True):
                if a != b:
                    break
                agree += 1
            c["mlx_bf16_matching_prefix"] = agree
            c["mlx_bf16_text"] = tokenizer.decode(bf16[i])
    results["mlx_chat_samples_fp32"] = [
        {"prompt": prompt, "completion": mlx_chat(mlx_model, tokenizer, prompt, 4 * args.tokens)}
        for prompt in CHAT_PROMPTS
    ]
    results["mlx_shipped_dtype"] = shipped_dtype
    results["greedy"] = comparisons
    results["ok"] = (
        results["head"]["ok"] and results["chat_template_ok"] and all(c["fp32_equal"] for c in comparisons)
    )
    text = json.dumps(results, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
