"""Downloads against a local hub: the real huggingface_hub client, HF_ENDPOINT pointed at ``FakeHub``.

    def test_x(hub, checkpoint):              # a started FakeHub; HF_ENDPOINT and a fresh HF_HOME set
        hub.add_repo("org/tiny", checkpoint("qwen3_5"))
        result = pull_model("org/tiny")        # in-process, like `exo pull`
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from exo.downloads import HubConfig, InProcessSteps, ProgressTracker, PullOptions, prepare, pull, pull_target
from exo.downloads.pull import PullResult

from .hub_server import FakeHub

_HF_VARS = ("HF_HUB_CACHE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    server = FakeHub().start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    for name in _HF_VARS:
        monkeypatch.delenv(name, raising=False)
    try:
        yield server
    finally:
        server.stop()


def pull_model(model: str, tracker: ProgressTracker | None = None, **options: Any) -> PullResult:
    """`exo pull` without the terminal: plan, fetch, check, recover the head (in this process)."""
    hub = HubConfig.from_env(offline=os.environ.get("EXO_OFFLINE") == "1")
    target = pull_target(model)
    tracker = tracker or ProgressTracker()
    opts = PullOptions(**options)
    plan = prepare(target, hub, opts, tracker)
    return pull(target, plan, hub, tracker, InProcessSteps(), opts)


def write_card(card_id: str, repo: str, checkpoint: Path, source_repo: str | None) -> Path:
    """A user card ($EXO_HOME/model_cards/) for ``repo``, its shape read from ``checkpoint``'s config."""
    config = json.loads((checkpoint / "config.json").read_text())
    text = config.get("text_config", config)
    arch = config["model_type"]
    lines = [
        f'id = "{card_id}"', f'name = "{card_id}"', f'arch = "{arch}"', f'repo = "{repo}"',
        f"n_layers = {text['num_hidden_layers']}", f"hidden_size = {text['hidden_size']}",
        f"kv_heads = {text['num_key_value_heads']}", f"head_dim = {text['head_dim']}",
        f"context_length = {text['max_position_embeddings']}", "storage_bytes = 1000000",
        "", "[native_mtp]", "num_layers = 1", "default_k = 1", "max_k = 2",
    ]
    if source_repo:
        lines.append(f'source_repo = "{source_repo}"')
    cards = Path(os.environ["EXO_HOME"]) / "model_cards"
    cards.mkdir(parents=True, exist_ok=True)
    path = cards / f"{card_id}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path
