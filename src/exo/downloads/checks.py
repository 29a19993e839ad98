"""Checks of downloaded weights that need no MLX: headers against the index, and stage completeness.

The shapes of a whole checkpoint are checked against its config by loading it lazily (``mlx_steps``);
a stage's files cannot be (the rest of the model is not there), so for them exo checks what it can
without a model: every tensor the index places in a file is in that file, and the file's header reads.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from safetensors import safe_open

from exo.engine.hf_cache import INDEX_FILE

from .errors import CheckpointRejectedError
from .stages import Stage, stage_files


def read_index(path: Path) -> dict[str, str]:
    """``weight_map`` of ``path``'s index (tensor -> file); {} when the checkpoint has no index."""
    index = path / INDEX_FILE
    if not index.is_file():
        return {}
    try:
        data: Any = json.loads(index.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointRejectedError(f"{index} is not valid JSON: {e}") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointRejectedError(f"{index} has no weight_map of tensor -> file")
    return weight_map


def header_keys(file: Path) -> set[str]:
    try:
        with safe_open(str(file), framework="numpy") as handle:
            return set(handle.keys())
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise CheckpointRejectedError(f"{file.name} is not a readable safetensors file: {e}") from None


def check_index_consistency(path: Path, files: Iterable[str] | None = None) -> None:
    """Every tensor the index places in each of ``files`` (default: all of them) is in that file, and no
    file holds tensors the index places elsewhere."""
    weight_map = read_index(path)
    if not weight_map:
        return
    wanted = set(files) if files is not None else set(weight_map.values())
    by_file: dict[str, set[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, set()).add(name)
    for file in sorted(wanted):
        if not (path / file).is_file():
            raise CheckpointRejectedError(f"{path.name}: {file} is listed in {INDEX_FILE} but not on disk")
        keys = header_keys(path / file)
        missing = sorted(by_file.get(file, set()) - keys)
        misplaced = sorted(k for k in keys - by_file.get(file, set()) if k in weight_map)
        if missing or misplaced:
            detail = f"missing {', '.join(missing[:4])}" if missing else f"holds {', '.join(misplaced[:4])}"
            raise CheckpointRejectedError(
                f"{path.name}: {file} does not match {INDEX_FILE} ({detail}); the download is not the "
                "checkpoint its index describes"
            )


def stage_missing_files(path: Path, stage: Stage) -> list[str]:
    """Files a stage needs that are not in ``path`` (config, index and its weight files)."""
    needed = ["config.json"]
    weight_map = read_index(path) if (path / INDEX_FILE).is_file() else {}
    if weight_map:
        needed += [INDEX_FILE, *stage_files(weight_map, stage.start, stage.end, stage.n_layers,
                                            first=stage.first, last=stage.last)]
    else:
        needed += ["model.safetensors"]
    return [name for name in needed if not (path / name).is_file()]
