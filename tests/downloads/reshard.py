"""Re-shard a fixture checkpoint so that each part of the model sits in its own shard (per-stage tests).

    reshard(checkpoint("qwen3_5", dtype="float32"), tmp_path / "four")   # 4 shards, see PARTS

The fixtures keep layers 0-1 with the embedding and layers 2-3 with the output, so every last stage needs
both shards; here a stage of layers [0, 2) needs shards 1-2, [2, 4) needs 1, 3 and 4 (the embedding too).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from safetensors import safe_open
from safetensors.numpy import save_file

from exo.downloads import tensor_role

INDEX = "model.safetensors.index.json"
N_SHARDS = 4


def shard_name(i: int) -> str:
    return f"model-{i:05d}-of-{N_SHARDS:05d}.safetensors"


def part_of(name: str) -> int:
    """1: embedding (and anything else); 2: layers 0-1; 3: layers 2 and up; 4: final norm, lm_head, mtp."""
    role, layer = tensor_role(name)
    if role == "layer":
        assert layer is not None
        return 2 if layer < 2 else 3
    if role in ("final_norm", "lm_head", "mtp"):
        return 4
    return 1


def reshard(source: Path, dest: Path, part: Callable[[str], int] = part_of) -> Path:
    """A copy of ``source`` (float32, sharded with an index) with its tensors in ``N_SHARDS`` shards, tensor
    ``name`` in shard ``part(name)``."""
    dest.mkdir(parents=True)
    weight_map = json.loads((source / INDEX).read_text())["weight_map"]
    shards: dict[int, dict] = {i: {} for i in range(1, N_SHARDS + 1)}
    metadata: dict[str, str] = {}
    for file in sorted(set(weight_map.values())):
        with safe_open(str(source / file), framework="numpy") as handle:
            metadata = handle.metadata() or metadata
            for name in handle.keys():
                shards[part(name)][name] = handle.get_tensor(name)
    new_map = {}
    for i, tensors in shards.items():
        save_file(tensors, str(dest / shard_name(i)), metadata=metadata)
        new_map.update({name: shard_name(i) for name in tensors})
    (dest / INDEX).write_text(
        json.dumps({"metadata": {}, "weight_map": dict(sorted(new_map.items()))}, indent=2)
    )
    for file in source.iterdir():
        if file.is_file() and not file.name.startswith("model") and file.name != "exo_fixture.json":
            shutil.copy(file, dest / file.name)
    return dest
