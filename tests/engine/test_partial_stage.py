"""A pipeline stage loads from a partial checkpoint: only the shards its layers need are on disk.

A stage's download fetches only those shards (exo.downloads.stages); its runner must load from what is
there, with the same strictness as a whole load (every tensor of the stage, every shape), while a
whole-model load of the same directory still fails clearly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from downloads.reshard import INDEX, reshard, shard_name
from safetensors import safe_open
from safetensors.numpy import save_file

from exo.downloads import stage_files, tensor_role
from exo.engine import CheckpointError, load_checkpoint

STAGES = [(0, 2), (2, 4)]  # the fixtures have 4 layers


def partial_copy(source: Path, dest: Path, start: int, end: int) -> Path:
    """``source`` with only the files a stage of layers [start, end) downloads."""
    weight_map = json.loads((source / INDEX).read_text())["weight_map"]
    keep = set(stage_files(weight_map, start, end, 4))
    dest.mkdir()
    for file in source.iterdir():
        if not file.name.endswith(".safetensors") or file.name in keep:
            shutil.copy(file, dest / file.name)
    return dest


@pytest.fixture(scope="module")
def four_shards(checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("four-shards")
    return {
        arch: reshard(checkpoint(arch, dtype="float32"), root / arch)
        for arch in ("qwen3_5", "qwen3_5_moe", "qwen3_next")
    }


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_stages_from_partial_checkpoints_compute_the_whole_model(four_shards, tmp_path, arch):
    whole_path = four_shards[arch]
    parts = []
    for start, end in STAGES:
        path = partial_copy(whole_path, tmp_path / f"stage-{start}", start, end)
        assert len(list(path.glob("model-*.safetensors"))) < 4  # some shard is really absent
        parts.append(load_checkpoint(path, layers=(start, end)))
    assert parts[-1].head is not None and parts[-1].tokenizer is not None
    whole = load_checkpoint(whole_path)
    tokens = mx.array([whole.tokenizer.encode("def fibonacci(n):\n    if n < 2:")])
    h = tokens
    for part in parts:
        h = part.model.stage_hidden(h, part.model.make_cache())
    assert mx.array_equal(h, whole.model.hidden(tokens, whole.model.make_cache())).item()


def test_a_partial_checkpoint_is_not_a_whole_model_nor_another_stage(four_shards, tmp_path):
    path = partial_copy(four_shards["qwen3_5"], tmp_path / "stage-0", 0, 2)
    with pytest.raises(
        CheckpointError, match=rf"lists shards that are not on disk: {shard_name(3)}, {shard_name(4)}"
    ):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match=rf"layers \[2, 4\) need {shard_name(3)}, {shard_name(4)}"):
        load_checkpoint(path, layers=(2, 4))


def _rewrite(file: Path, change) -> None:
    with safe_open(str(file), framework="numpy") as handle:
        metadata = handle.metadata()
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    save_file(change(tensors), str(file), metadata=metadata)


def test_a_stage_tensor_with_the_wrong_shape_is_rejected(four_shards, tmp_path):
    path = partial_copy(four_shards["qwen3_5"], tmp_path / "stage-0", 0, 2)
    name = "model.language_model.layers.1.mlp.down_proj.weight"

    def widen(tensors):
        tensors[name] = np.zeros((tensors[name].shape[0], tensors[name].shape[1] + 1), tensors[name].dtype)
        return tensors

    _rewrite(path / shard_name(2), widen)
    with pytest.raises(
        CheckpointError, match=r"(?s)do not match config.json.*shape.*layers\.1\.mlp\.down_proj"
    ):
        load_checkpoint(path, layers=(0, 2))


def test_a_stage_tensor_missing_from_its_shard_is_rejected(four_shards, tmp_path):
    path = partial_copy(four_shards["qwen3_5"], tmp_path / "stage-0", 0, 2)
    name = "model.language_model.layers.0.mlp.up_proj.weight"
    _rewrite(path / shard_name(2), lambda tensors: {k: v for k, v in tensors.items() if k != name})
    with pytest.raises(CheckpointError, match=r"(?s)Missing 1 parameters.*layers\.0\.mlp\.up_proj"):
        load_checkpoint(path, layers=(0, 2))


def test_a_raw_stage_without_linear_attention_layers_asks_for_the_whole_model(checkpoint, tmp_path):
    # Layer 3 is full attention. With only its shard on disk, nothing shows mlx-lm the raw conv1d layout
    # that decides whether norms are shifted, so loading would silently be wrong: it is refused instead.
    def part(name: str) -> int:
        role, layer = tensor_role(name)
        return 1 if role == "layer" and layer != 3 else 4

    whole = reshard(checkpoint("qwen3_5", dtype="float32"), tmp_path / "whole", part)
    path = partial_copy(whole, tmp_path / "stage-3", 3, 4)
    assert not (path / shard_name(1)).exists()
    with pytest.raises(CheckpointError, match="no linear-attention layer"):
        load_checkpoint(path, layers=(3, 4))
