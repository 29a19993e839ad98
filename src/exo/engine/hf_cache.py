"""The Hugging Face cache on this machine: where it is, and whether a repo's snapshot is complete.

``huggingface_hub`` reads ``HF_HOME`` / ``HF_HUB_CACHE`` once, when it is imported; exo reads them at
each call so a daemon, a test or a notebook that sets them later still looks where they say.

"Complete" means more than "the snapshot folder exists": a download interrupted after its first files
leaves a folder with ``config.json`` and some shards. A snapshot counts only when huggingface_hub's own
check passes (the cached tree listing, when there is one, finds every file of the repo) AND the
checkpoint itself is whole: ``config.json``, and every shard its ``model.safetensors.index.json``
names (or at least one ``model*.safetensors`` without an index). Half-written files never show up
here: huggingface_hub writes each file under a unique ``.incomplete`` name in ``blobs/`` and links it
into the snapshot only after an atomic rename. Weights in formats exo does not read (``*.bin``, ...)
are not required.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

INDEX_FILE = "model.safetensors.index.json"
_SHARD = re.compile(r"model-\d+-of-\d+\.safetensors")
# Weights in formats exo never reads: `exo pull` skips them, and a snapshot without them is complete.
UNUSED_WEIGHT_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.msgpack", "*.h5", "*.onnx")


def hub_cache_dir() -> Path:
    """``HF_HUB_CACHE``, else ``$HF_HOME/hub`` as they are set now, else huggingface_hub's own choice."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.path.expandvars(os.environ["HF_HUB_CACHE"])).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.path.expandvars(os.environ["HF_HOME"])).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def missing_checkpoint_files(path: Path) -> list[str]:
    """The files a checkpoint directory needs and lacks (empty: it is whole)."""
    missing = [] if (path / "config.json").is_file() else ["config.json"]
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map") or {}
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            return [*missing, f"{INDEX_FILE} (unreadable)"]
        missing += sorted({name for name in weight_map.values() if not (path / name).is_file()})
    elif any(_SHARD.fullmatch(p.name) for p in path.glob("model-*.safetensors")):
        missing.append(INDEX_FILE)  # numbered shards come with an index
    elif not any(path.glob("model*.safetensors")):
        missing.append("model*.safetensors")
    return missing


def cached_snapshot(repo: str, revision: str = "main") -> Path | None:
    """A complete snapshot of ``repo`` in the Hugging Face cache, without touching the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(
            snapshot_download(
                repo,
                revision=revision,
                cache_dir=hub_cache_dir(),
                local_files_only=True,
                ignore_patterns=list(UNUSED_WEIGHT_PATTERNS),
            )
        )
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        return None  # IncompleteSnapshotError is a LocalEntryNotFoundError
    return None if missing_checkpoint_files(path) else path
