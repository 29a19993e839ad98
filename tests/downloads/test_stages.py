"""Which files a pipeline stage needs (pure functions over an index's weight_map), in the three layouts."""

from __future__ import annotations

import json

import pytest

from exo.downloads import StageRangeError, stage_files, tensor_role
from exo.downloads.stages import Stage, stage_tensors

# (embedding, layer i prefix, final norm, lm_head, mtp prefix, vision) as each layout names them.
LAYOUTS = {
    "raw qwen3.5": ("model.language_model.embed_tokens.weight", "model.language_model.layers.{i}.",
                    "model.language_model.norm.weight", "lm_head.weight", "mtp.", "model.visual.blocks.0.attn.qkv.weight"),
    "mlx qwen3.5": ("language_model.model.embed_tokens.weight", "language_model.model.layers.{i}.",
                    "language_model.model.norm.weight", "language_model.lm_head.weight", "language_model.mtp.",
                    "vision_tower.blocks.0.attn.qkv.weight"),
    "qwen3-next": ("model.embed_tokens.weight", "model.layers.{i}.", "model.norm.weight", "lm_head.weight",
                   "mtp.", None),
}


def weight_map(layout: str, n_layers: int = 8) -> dict[str, str]:
    """A model of n_layers spread over one shard per layer pair, plus first and last shards."""
    embed, layer, norm, head, mtp, vision = LAYOUTS[layout]
    out = {embed: "first.safetensors", norm: "last.safetensors", head: "last.safetensors",
           f"{mtp}fc.weight": "mtp.safetensors", f"{mtp}layers.0.self_attn.q_proj.weight": "mtp.safetensors"}
    if vision:
        out[vision] = "vision.safetensors"
    for i in range(n_layers):
        shard = f"layers-{i // 2}.safetensors"
        out[layer.format(i=i) + "mlp.gate_proj.weight"] = shard
        out[layer.format(i=i) + "mlp.gate_proj.scales"] = shard  # quantized MLX tensors ride along
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_roles(layout):
    embed, layer, norm, head, mtp, vision = LAYOUTS[layout]
    assert tensor_role(embed) == ("embedding", None)
    assert tensor_role(embed.replace(".weight", ".scales")) == ("embedding", None)
    assert tensor_role(layer.format(i=17) + "self_attn.q_proj.weight") == ("layer", 17)
    assert tensor_role(norm) == ("final_norm", None)
    assert tensor_role(head) == ("lm_head", None)
    assert tensor_role(f"{mtp}layers.0.mlp.experts.3.down_proj.weight") == ("mtp", None)  # not decoder layer 0
    if vision:
        assert tensor_role(vision) == ("vision", None)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    ("start", "end", "expected"),
    [
        (0, 2, ["first", "layers-0"]),                               # first: embedding + its layers
        (2, 6, ["layers-1", "layers-2"]),                            # middle: its layers only
        (6, 8, ["first", "last", "layers-3", "mtp"]),                # last: norm, lm_head, mtp AND embedding
        (0, 8, ["first", "last", "layers-0", "layers-1", "layers-2", "layers-3", "mtp"]),  # one stage
        (3, 5, ["layers-1", "layers-2"]),                            # a range across shard boundaries
    ],
)
def test_stage_files(layout, start, end, expected):
    files = stage_files(weight_map(layout), start, end, 8)
    assert files == [f"{name}.safetensors" for name in expected]
    assert "vision.safetensors" not in files


def test_first_and_last_can_be_given():
    # A pipeline that keeps the embedding elsewhere says so: [0, 2) as a non-first stage has no embedding.
    assert stage_files(weight_map("raw qwen3.5"), 0, 2, 8, first=False) == ["layers-0.safetensors"]
    assert stage_files(weight_map("raw qwen3.5"), 2, 4, 8, last=True) == [
        "first.safetensors", "last.safetensors", "layers-1.safetensors", "mtp.safetensors"]


def test_stage_tensors_are_the_layer_range_and_unknown_tensors_go_everywhere():
    wm = {**weight_map("qwen3-next"), "model.some_new_buffer": "first.safetensors"}
    tensors = stage_tensors(wm, Stage.of(2, 4, 8))
    assert "model.some_new_buffer" in tensors
    layers = {tensor_role(t)[1] for t in tensors if tensor_role(t)[0] == "layer"}
    assert layers == {2, 3}
    assert not any(t.startswith("mtp.") for t in tensors)


@pytest.mark.parametrize(("start", "end", "n"), [(0, 0, 8), (5, 3, 8), (-1, 2, 8), (0, 9, 8)])
def test_bad_ranges_are_typed_errors(start, end, n):
    with pytest.raises(StageRangeError, match=r"0 <= start < end <= 8"):
        stage_files(weight_map("raw qwen3.5"), start, end, n)


def test_a_layer_count_that_does_not_match_the_weights_is_an_error():
    with pytest.raises(StageRangeError, match="hold decoder layer 7 but the model has 4 layers"):
        stage_files(weight_map("raw qwen3.5"), 0, 2, 4)


def test_fixture_index(checkpoint):
    # The raw fixture: embedding, vision and layers 0-1 in shard 1; layers 2-3, norm, lm_head, mtp in shard 2.
    wm = json.loads((checkpoint("qwen3_5") / "model.safetensors.index.json").read_text())["weight_map"]
    shard1, shard2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    assert stage_files(wm, 0, 2, 4) == [shard1]
    assert stage_files(wm, 2, 4, 4) == [shard1, shard2]  # the last stage needs the embedding too
