"""``exo pull``: what it prints when it downloads and recovers a head, its JSON, and its errors."""

from __future__ import annotations

import json

from exo.cli.main import main

from .conftest import write_card


def test_exo_pull_says_what_it_did(hub, checkpoint, capsys, monkeypatch):
    stripped = checkpoint("qwen3_5", layout="mlx")
    hub.add_repo("mlx-community/tiny-4bit", stripped)
    hub.add_repo("Qwen/Tiny", checkpoint("qwen3_5", "hf", "trained"))
    write_card("tiny-4bit", "mlx-community/tiny-4bit", stripped, source_repo="Qwen/Tiny")

    monkeypatch.setenv("EXO_OFFLINE", "1")
    assert main(["pull", "tiny-4bit"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("exo: error: offline") and "mlx-community/tiny-4bit is not in the Hugging Face cache" in err
    monkeypatch.delenv("EXO_OFFLINE")

    assert main(["pull", "tiny-4bit"]) == 0
    out, err = capsys.readouterr()
    files = len(list(stripped.iterdir()))
    assert f"tiny-4bit: {files} file(s) to download from {hub.url}" in err
    lines = out.splitlines()
    assert lines[0].startswith("tiny-4bit (mlx-community/tiny-4bit@") and f"downloaded {files} file(s)" in lines[0]
    assert lines[2].startswith("  MTP head recovered from Qwen/Tiny (1 shard(s), ") and "(needs 30%)" in lines[2]

    assert main(["pull", "tiny-4bit", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["files_fetched"] == 0 and result["head"]["status"] == "present"
    assert result["head"]["reason"] == "in a sidecar mtp.safetensors"

    assert main(["pull", "no-such-model"]) == 1
    assert "unknown model" in capsys.readouterr().err.lower()
