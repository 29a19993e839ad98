"""The fixture checkpoints are what they claim: official layouts, loadable by mlx-lm and transformers
with identical greedy output, and a trained head that agrees with its backbone far more than a random one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fixtures import ARCHS, FAMILY, FIXTURE_FILE, MALFORMED, SIDECAR_FILE, FixtureStore, read_fixture_info
from fixtures.checkpoints import cache_key
from fixtures.layouts import INDEX_FILE, read_tensors
from fixtures.reference import (
    load_torch_backbone,
    load_torch_head,
    mlx_logits,
    top2_margin,
    torch_greedy,
    torch_logits,
)
from fixtures.tokenizer import write_tokenizer
from fixtures.training import greedy_continuation, head_agreement, prompt_ids
from safetensors import SafetensorError, safe_open

H, E = 64, 8  # hidden size and experts of every fixture

DENSE_HEAD = {
    "mtp.fc.weight": (H, 2 * H),
    "mtp.pre_fc_norm_embedding.weight": (H,),
    "mtp.pre_fc_norm_hidden.weight": (H,),
    "mtp.norm.weight": (H,),
    "mtp.layers.0.input_layernorm.weight": (H,),
    "mtp.layers.0.post_attention_layernorm.weight": (H,),
    "mtp.layers.0.self_attn.q_proj.weight": (4 * 32 * 2, H),  # q and its output gate
    "mtp.layers.0.self_attn.k_proj.weight": (2 * 32, H),
    "mtp.layers.0.self_attn.v_proj.weight": (2 * 32, H),
    "mtp.layers.0.self_attn.o_proj.weight": (H, 4 * 32),
    "mtp.layers.0.self_attn.q_norm.weight": (32,),
    "mtp.layers.0.self_attn.k_norm.weight": (32,),
}
DENSE_MLP = {
    "mtp.layers.0.mlp.gate_proj.weight": (128, H),
    "mtp.layers.0.mlp.up_proj.weight": (128, H),
    "mtp.layers.0.mlp.down_proj.weight": (H, 128),
}
MOE_MLP = {
    "mtp.layers.0.mlp.gate.weight": (E, H),
    "mtp.layers.0.mlp.shared_expert.gate_proj.weight": (64, H),
    "mtp.layers.0.mlp.shared_expert.up_proj.weight": (64, H),
    "mtp.layers.0.mlp.shared_expert.down_proj.weight": (H, 64),
    "mtp.layers.0.mlp.shared_expert_gate.weight": (1, H),
}
FUSED = {"mtp.layers.0.mlp.experts.gate_up_proj": (E, 128, H), "mtp.layers.0.mlp.experts.down_proj": (E, H, 64)}
PER_EXPERT = {
    f"mtp.layers.0.mlp.experts.{e}.{proj}.weight": (H, 64) if proj == "down_proj" else (64, H)
    for e in range(E)
    for proj in ("gate_proj", "up_proj", "down_proj")
}
EXPECTED_HEAD = {
    "qwen3_5": {**DENSE_HEAD, **DENSE_MLP},
    "qwen3_5_moe": {**DENSE_HEAD, **MOE_MLP, **PER_EXPERT},
    "qwen3_6_moe": {**DENSE_HEAD, **MOE_MLP, **FUSED},
    "qwen3_next": {**DENSE_HEAD, **MOE_MLP, **PER_EXPERT},
}
BACKBONE_PREFIX = {"qwen3_5": "model.language_model.", "qwen3_5_moe": "model.language_model.",
                   "qwen3_6_moe": "model.language_model.", "qwen3_next": "model."}


def _file_tensors(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) for one safetensors file, plus its metadata under key ''."""
    with safe_open(str(path), framework="pt") as f:
        out = {name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype()) for name in f.keys()}
        out[""] = f.metadata()
    return out


def _all_tensors(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    out: dict = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update({k: v for k, v in _file_tensors(file).items() if k})
    return out


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(tokenizer_dir)


def test_tokenizer_loads_like_a_qwen_tokenizer(tokenizer, tokenizer_dir, tmp_path):
    assert tokenizer.vocab_size == 512
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hello!"}], add_generation_prompt=True)
    assert tokenizer.decode(ids) == "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    text = "Count from 7 to 19. Ünïcode too: 東京"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    # Deterministic: a rebuild is byte-identical.
    rebuilt = write_tokenizer(tmp_path / "tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (rebuilt / name).read_bytes() == (Path(tokenizer_dir) / name).read_bytes()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("head", ["trained", "random", "none"])
def test_hf_layout(checkpoint, arch, head):
    path = checkpoint(arch, "hf", head)
    config = json.loads((path / "config.json").read_text())
    if arch == "qwen3_next":
        assert config["model_type"] == "qwen3_next"
        assert config["architectures"] == ["Qwen3NextForCausalLM"]
        assert config["num_nextn_predict_layers"] == 1
    else:
        text = config["text_config"]
        assert config["model_type"] == ("qwen3_5" if arch == "qwen3_5" else "qwen3_5_moe")
        assert text["mtp_num_hidden_layers"] == 1
        assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
        assert text["rope_parameters"]["mrope_section"] and text["rope_parameters"]["partial_rotary_factor"]

    index = json.loads((path / INDEX_FILE).read_text())
    shards = sorted(p.name for p in path.glob("model-*.safetensors"))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    found: dict[str, str] = {}
    for shard in shards:
        tensors = _file_tensors(path / shard)
        assert tensors.pop("") == {"format": "pt"}
        found.update({name: shard for name in tensors})
        assert all(dtype == "BF16" for _, dtype in tensors.values())
    assert found == index["weight_map"]  # the index is exact

    mtp = {name: shard for name, shard in found.items() if name.startswith("mtp.")}
    if head == "none":
        assert not mtp
    else:
        assert set(mtp.values()) == {shards[-1]}
        shapes = {name: _file_tensors(path / shards[-1])[name][0] for name in mtp}
        assert shapes == EXPECTED_HEAD[arch]
    assert "lm_head.weight" in found
    backbone = [n for n in found if not n.startswith(("mtp.", "lm_head", "model.visual."))]
    assert all(n.startswith(BACKBONE_PREFIX[arch]) for n in backbone)
    layer3 = BACKBONE_PREFIX[arch] + "layers.3.mlp.experts."
    if arch in ("qwen3_5_moe", "qwen3_6_moe"):  # Qwen3.5-MoE files fuse the backbone experts
        assert {n for n in found if n.startswith(layer3)} == {layer3 + "gate_up_proj", layer3 + "down_proj"}
    if arch == "qwen3_next":  # Qwen3-Next stores them per expert
        assert layer3 + "7.down_proj.weight" in found and layer3 + "gate_up_proj" not in found


@pytest.mark.parametrize("arch", ARCHS)
def test_norms_are_zero_centred_like_official_files(checkpoint, fixture_store, arch):
    path = checkpoint(arch, "hf", "trained", "float32")
    tensors = {}
    for shard in sorted(path.glob("model-*.safetensors")):
        tensors.update(read_tensors(shard))
    norms = [n for n in tensors if n.endswith("norm.weight") and "linear_attn.norm" not in n
             and "visual" not in n]
    assert len(norms) >= 4 * 2 + 1 + 6
    for name in norms:  # applied as (1 + w): trained weights stay near 0, never near 1
        assert tensors[name].float().mean().abs() < 0.5, name
    # The head on disk is the trained one, bit for bit.
    trained = fixture_store.trained(FAMILY[arch])["head"]
    assert torch.equal(tensors["mtp.fc.weight"], trained["fc.weight"])
    assert torch.equal(tensors["mtp.norm.weight"], trained["norm.weight"])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_mlx_layouts(checkpoint, arch, dtype):
    from mlx_lm.utils import load_tokenizer

    raw = checkpoint(arch, "hf", "trained", dtype)
    for layout, bits in (("mlx", 0), ("mlx_q4", 4), ("mlx_q8", 8)):
        path = checkpoint(arch, layout, dtype=dtype)
        config = json.loads((path / "config.json").read_text())
        declared = config.get("num_nextn_predict_layers") or config["text_config"]["mtp_num_hidden_layers"]
        assert declared == 1  # the config still declares the head ...
        tensors = _all_tensors(path)
        assert not [n for n in tensors if "mtp" in n]  # ... that stock mlx-lm dropped
        assert _file_tensors(path / "model.safetensors")[""] == {"format": "mlx"}
        if bits:
            assert config["quantization"]["bits"] == bits and config["quantization"]["group_size"] == 64
            assert any(n.endswith(".scales") for n in tensors)
        else:
            assert "quantization" not in config
        assert read_fixture_info(path)["head"] == "none"
        # mlx-lm re-saved the tokenizer (chat template moved to chat_template.jinja); it still works.
        messages = [{"role": "user", "content": "Hello!"}]
        assert load_tokenizer(path).apply_chat_template(messages, add_generation_prompt=True) == \
            load_tokenizer(raw).apply_chat_template(messages, add_generation_prompt=True)
    for layout in ("mlx_sidecar", "mlx_q4_sidecar", "mlx_q8_sidecar"):
        for head in ("trained", "random"):
            path = checkpoint(arch, layout, head, dtype)
            sidecar = _file_tensors(path / SIDECAR_FILE)
            assert sidecar.pop("") == {"format": "pt"}
            assert set(sidecar) == set(EXPECTED_HEAD[arch])
            source = checkpoint(arch, "hf", head, dtype)
            raw_head = read_tensors(source / "model-00002-of-00002.safetensors", prefix="mtp.")
            side = read_tensors(path / SIDECAR_FILE)
            assert all(torch.equal(side[n], raw_head[n]) for n in raw_head)
            base = checkpoint(arch, layout.removesuffix("_sidecar"), dtype=dtype)
            assert sorted(p.name for p in path.iterdir() if p.name not in (SIDECAR_FILE, FIXTURE_FILE)) == \
                sorted(p.name for p in base.iterdir() if p.name != FIXTURE_FILE)
    assert raw.exists()


# Bounds measured with scripts/fixture_sweep.py over fixtures of seeds 0-10 (EXO_FIXTURE_SEED), each a
# different but equally valid model (CPUs train different weights from the same recipe):
# - float32 MLX (mlx-lm's kernels) vs float32 torch on the same weights round in different orders: at most
#   5.0e-6 apart on any logit (fp32_max_logit_diff_*). 1e-4 leaves 20x room and is still far below any
#   decision: positions closer than 2e-4 to a tie are the only ones whose greedy choice may differ.
FP32_LOGIT_ATOL = 1e-4
# - bf16 / 4-bit weights vs float32, greedy choices on the same 64 positions (teacher forcing): at least
#   0.969 (bf16) and 0.844 (4-bit) agreed. A wrongly loaded checkpoint agrees at ~1/512 of them.
LOWP_AGREEMENT = {"hf": 0.85, "mlx_q4": 0.70}
# - trained head vs backbone on 8 x 40 positions: 0.731 to 1.0; a random head: 0 to 0.097.
TRAINED_AGREEMENT_MIN = 0.6
TRAINED_MINUS_RANDOM_MIN = 0.4
CONTINUATION = 16


@pytest.mark.parametrize("arch", ARCHS)
def test_mlx_lm_matches_transformers_greedy(checkpoint, tokenizer, arch, record_property):
    """mlx-lm's loader on the raw files and on its own conversion computes what transformers computes.

    Compared on transformers' own greedy continuations (teacher forcing), so one near tie cannot derail
    the rest: float32 logits agree within float32 rounding, and so the greedy choice agrees at every
    position that is not within rounding of a tie (exact by construction). bf16 and 4-bit weights move
    logits by far more than rounding: their greedy choices must still agree at most positions.
    """
    import mlx.core as mx
    from mlx_lm import load

    raw = checkpoint(arch, "hf", "trained", "float32")
    model, info = load_torch_backbone(raw, with_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    prompts = prompt_ids(tokenizer)[:4]
    sequences = [p + torch_greedy(model, p, CONTINUATION) for p in prompts]
    # Row len(p) - 1 + i of a sequence predicts its continuation token i.
    rows = [slice(len(p) - 1, len(s) - 1) for p, s in zip(prompts, sequences, strict=True)]
    want = torch.cat([torch_logits(model, s)[r] for s, r in zip(sequences, rows, strict=True)])
    decided = top2_margin(want) > 2 * FP32_LOGIT_ATOL  # not within rounding of a tie

    def logits_of(layout: str, dtype: str) -> torch.Tensor:
        mlx_model, _ = load(str(checkpoint(arch, layout, None, dtype)))
        return torch.cat([mlx_logits(mlx_model, s)[r] for s, r in zip(sequences, rows, strict=True)])

    for layout in ("hf", "mlx", "mlx_sidecar"):
        got = logits_of(layout, "float32")
        worst = float((got - want).abs().max())
        record_property(f"fp32_max_logit_diff_{layout}", worst)
        assert worst < FP32_LOGIT_ATOL, layout
        assert torch.equal(got.argmax(-1)[decided], want.argmax(-1)[decided]), layout
    # bf16 and 4-bit: mlx-lm loads them and they still follow the trained patterns closely.
    # (MLX's CPU backend runs unquantized MoE experts (GatherMM) in float32 only.)
    on_cpu = mx.default_device() == mx.cpu
    for layout in ("hf", "mlx_q4"):
        if layout == "hf" and on_cpu and FAMILY[arch] != "dense":
            continue
        got = logits_of(layout, "bfloat16")
        agreement = float((got.argmax(-1) == want.argmax(-1)).float().mean())
        record_property(f"lowp_greedy_agreement_{layout}", agreement)
        assert agreement >= LOWP_AGREEMENT[layout], layout


@pytest.mark.parametrize("arch", ARCHS)
def test_trained_head_agrees_far_more_than_random(checkpoint, tokenizer, arch, record_property):
    raw = checkpoint(arch, "hf", "trained", "float32")
    backbone = load_torch_backbone(raw)
    prompts = prompt_ids(tokenizer)  # what the builder measured on: 8 prompts x 40 greedy tokens
    continuations = [greedy_continuation(backbone, p) for p in prompts]
    trained = head_agreement(backbone, load_torch_head(raw, backbone), prompts, continuations)
    random_head = load_torch_head(checkpoint(arch, "mlx_sidecar", "random", "float32"), backbone)
    rand = head_agreement(backbone, random_head, prompts, continuations)
    recorded = read_fixture_info(raw)["head_agreement"]
    record_property("trained_agreement", trained)
    record_property("random_agreement", rand)
    record_property("recorded_minus_measured", recorded - trained)
    assert trained >= TRAINED_AGREEMENT_MIN
    assert trained - rand >= TRAINED_MINUS_RANDOM_MIN
    # The head on disk is the head the builder measured: the same agreement on the same positions.
    assert recorded == pytest.approx(trained, abs=1e-4)


@pytest.mark.parametrize("kind", MALFORMED)
def test_malformed_checkpoints_have_their_defect(malformed_checkpoint, kind):
    path = malformed_checkpoint(kind)
    last = path / "model-00002-of-00002.safetensors"
    index = json.loads((path / INDEX_FILE).read_text())
    if kind == "no_config":
        assert not (path / "config.json").exists()
    elif kind == "bad_model_type":
        from mlx_lm.utils import load_model

        with pytest.raises(ValueError, match="not supported"):
            load_model(path)
    elif kind == "missing_shard":
        assert last.name in set(index["weight_map"].values()) and not last.exists()
    elif kind == "corrupt_shard":
        with pytest.raises(SafetensorError):
            with safe_open(str(last), framework="pt") as f:
                [f.get_tensor(n) for n in f.keys()]
    elif kind == "bad_head_shape":
        assert _file_tensors(last)["mtp.fc.weight"][0] == (H, H)
    elif kind == "missing_head_tensor":
        names = set(_file_tensors(last)) - {""}
        assert "mtp.norm.weight" not in names and "mtp.norm.weight" not in index["weight_map"]
        assert len([n for n in names if n.startswith("mtp.")]) == len(EXPECTED_HEAD["qwen3_5"]) - 1
    assert read_fixture_info(path)["malformed"] == kind


def test_store_reuses_cached_builds(fixture_store, checkpoint):
    path = checkpoint("qwen3_5", "hf", "trained")
    stamp = (path / "model-00002-of-00002.safetensors").stat().st_mtime_ns
    again = FixtureStore(fixture_store.root.parent)
    assert again.key == fixture_store.key == cache_key(fixture_store.seed)
    assert again.checkpoint("qwen3_5", "hf", "trained") == path
    assert (path / "model-00002-of-00002.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError):
        checkpoint("qwen3_5", "mlx", "trained")
    with pytest.raises(ValueError):
        checkpoint("llama", "hf")
