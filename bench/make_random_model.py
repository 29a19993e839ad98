"""Write a random-weight, real-shape Qwen3.5 / Qwen3.6 checkpoint (dense or MoE) in MLX layout (quantized) WITH
an MTP head.

Random weights are useless for acceptance but exact for costs: a verify call, a draft step and a plain
decode step of a random 4-bit Qwen3.5-9B-shaped model move the same bytes and do the same arithmetic as
the real one. ``exo bench`` on it measures beta(K) and delta(K) on the machine at hand. (An MoE shape's
random router spreads tokens over experts more evenly than a trained one does: per step it reads the same
bytes, per verify call of several rows it may read somewhat more distinct experts.)

    python bench/make_random_model.py --shape qwen3.5-9b --bits 4 --out /tmp/qwen3.5-9b-random-4bit
    python bench/make_random_model.py --shape qwen3.6-35b-a3b --bits 4 --out /tmp/qwen3.6-35b-a3b-random-4bit
    exo bench /tmp/qwen3.5-9b-random-4bit --max-tokens 64

``--layers N`` and ``--set KEY=VALUE`` (a text-config field, JSON value) shrink a shape for a check on a
small machine, e.g. the 35B-A3B layout at 4 layers and 16 experts:
``--shape qwen3.6-35b-a3b --layers 4 --set num_experts=16 --set vocab_size=4096``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import quantize_model, save_config, save_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from exo.engine.convert import quantize_head
from exo.engine.models import get_model_classes
from exo.engine.models.mtp import MTPHead

# Public configs of the official checkpoints (text part).
SHAPES = {
    "medium": dict(hidden_size=1024, num_hidden_layers=16, intermediate_size=3072, num_attention_heads=8,
                   num_key_value_heads=2, linear_num_key_heads=8, linear_num_value_heads=16,
                   tie_word_embeddings=True, vocab_size=32768),
    "tiny": dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4,
                 tie_word_embeddings=True, vocab_size=4096, head_dim=64),
    "qwen3.5-2b": dict(hidden_size=2048, num_hidden_layers=24, intermediate_size=6144, num_attention_heads=8,
                       num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=16,
                       tie_word_embeddings=True),
    "qwen3.5-9b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=12288, num_attention_heads=16,
                       num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=32,
                       tie_word_embeddings=False),
    "qwen3.5-27b": dict(hidden_size=5120, num_hidden_layers=64, intermediate_size=17408, num_attention_heads=24,
                        num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=48,
                        tie_word_embeddings=False),
    # MoE (model_type qwen3_5_moe): every layer's MLP is 256 routed experts (8 per token) plus one shared
    # expert of the same size behind a sigmoid gate; the MTP head's layer is an MoE layer of the same shape.
    # Qwen3.6-35B-A3B has Qwen3.5-35B-A3B's shape (their configs differ in no size).
    "qwen3.6-35b-a3b": dict(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
                            linear_num_key_heads=16, linear_num_value_heads=32, num_experts=256,
                            num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                            tie_word_embeddings=False),
    # Qwen3.5-122B-A10B (the 122B-A10B of the catalog; 64 linear value heads: 122.1e9 parameters, ~69.6 GB at
    # 4 bits with its vision tower, as mlx-community's conversion).
    "qwen3.5-122b-a10b": dict(hidden_size=3072, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=2,
                              linear_num_key_heads=16, linear_num_value_heads=64, num_experts=256,
                              num_experts_per_tok=8, moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
                              tie_word_embeddings=False),
    # The 35B-A3B layout small enough for a CPU check (tests/bench: a random MoE decodes with MTP).
    "tiny-moe": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     linear_num_key_heads=2, linear_num_value_heads=4, num_experts=16, num_experts_per_tok=4,
                     moe_intermediate_size=128, shared_expert_intermediate_size=128, tie_word_embeddings=True,
                     vocab_size=4096, head_dim=64),
}
MOE_TEXT = dict(model_type="qwen3_5_moe_text", decoder_sparse_step=1, norm_topk_prob=True, mlp_only_layers=[])
COMMON = dict(
    model_type="qwen3_5_text", vocab_size=248320, head_dim=256, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4, rms_norm_eps=1e-6,
    max_position_embeddings=262144, mtp_num_hidden_layers=1,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10]},
)


# ChatML, as the bundled demo models render it (the real checkpoints' template, without tools and thinking).
CHAT_TEMPLATE = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                 "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
                 "{%- endif %}")


def word_tokenizer(vocab_size: int, out: Path) -> None:
    """A tokenizer with ``vocab_size`` entries so every id the random model emits can be decoded."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab.update({f"w{i}": i for i in range(len(vocab), vocab_size - 3)})
    vocab.update({"<|endoftext|>": vocab_size - 3, "<|im_start|>": vocab_size - 2, "<|im_end|>": vocab_size - 1})
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # ChatML's markers are single tokens, as in the real tokenizers (the prefix cache finds messages by them)
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,  # so that `exo serve` can take chats (bench/agent_session.py)
    }))


def text_config(shape: str, layers: int | None = None, overrides: list[str] = ()) -> dict:
    """The text config of ``shape``, with ``layers`` and ``KEY=VALUE`` overrides (VALUE parsed as JSON)."""
    text = dict(COMMON, **SHAPES[shape])
    if text.get("num_experts"):
        text.update(MOE_TEXT)
        text.pop("intermediate_size", None)
    if layers is not None:
        text["num_hidden_layers"] = layers
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE")
        text[key] = json.loads(value)
    if text.get("num_experts") and text["num_experts_per_tok"] > text["num_experts"]:
        raise SystemExit(f"num_experts_per_tok {text['num_experts_per_tok']} > num_experts {text['num_experts']}")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3.5-9b")
    parser.add_argument("--bits", type=int, default=4, help="0: no quantization")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--quantize-head", action="store_true", help="quantize the head too (default bf16)")
    parser.add_argument("--layers", type=int, help="override the shape's layer count (a multiple of 4 keeps "
                        "its pattern of three linear-attention layers and one full-attention layer)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a text-config field (VALUE as JSON, e.g. num_experts=16)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    start = time.perf_counter()
    text = text_config(args.shape, args.layers, args.set)
    moe = text.get("num_experts", 0) > 0
    config = {"model_type": "qwen3_5_moe" if moe else "qwen3_5",
              "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
              "text_config": text, "tie_word_embeddings": text["tie_word_embeddings"]}
    model_cls, args_cls = get_model_classes(config)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(config))
    dtype = getattr(mx, args.dtype)
    model.set_dtype(dtype)
    lm = model.language_model
    head = MTPHead(lm.args.hidden_size, lm.args.rms_norm_eps, model.make_head_layer(moe=moe))
    head.set_dtype(dtype)
    if args.bits:
        model, config = quantize_model(model, config, args.group_size, args.bits)
    if args.quantize_head and args.bits:
        quantize_head(head, args.bits, args.group_size)
    lm.mtp = head
    args.out.mkdir(parents=True, exist_ok=False)
    save_model(args.out, model)
    save_config(config, args.out / "config.json")
    word_tokenizer(text["vocab_size"], args.out)
    size = sum(f.stat().st_size for f in args.out.glob("*.safetensors"))
    print(f"{args.out}: {args.shape} ({text['num_hidden_layers']} layers{', MoE' if moe else ''}) {args.bits or args.dtype}-bit, {size / 1e9:.2f} GB, {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
