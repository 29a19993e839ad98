"""`exo serve` as a user runs it: a real process, its flags, a clean stop; errors before serving."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx2 as httpx

from exo.cli.main import build_parser, main
from exo.runner.group import free_port
from tests.api.conftest import wait_until_serving

SRC = Path(__file__).resolve().parents[2] / "src"


_free_port = free_port  # never the same port twice in this process (two calls in a row could be)


def test_serve_flags_and_defaults():
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.model, args.load_timeout) == (None, None, None, None)
    args = build_parser().parse_args(["serve", "--host", "127.0.0.1", "--port", "8000", "--model", "exo-demo"])
    assert (args.host, args.port, args.model) == ("127.0.0.1", 8000, "exo-demo")


def test_serve_with_a_model_that_cannot_load_fails_before_serving(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("EXO_HOME", str(tmp_path))
    assert main(["serve", "--model", "no-such-model", "--port", str(_free_port())]) == 1
    assert "unknown model 'no-such-model'" in capsys.readouterr().err


def test_exo_serve_process(model_dir, tmp_path):
    port = _free_port()
    env = {**os.environ, "EXO_HOME": str(tmp_path), "PYTHONPATH": str(SRC), "EXO_API_KEY": ""}
    process = subprocess.Popen(
        [sys.executable, "-m", "exo.cli.main", "serve", "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
         "--grpc-port", str(_free_port()), "--no-discovery"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_serving(url, process, 60)
        body = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 200 and response.json()["model"] == model_dir.name
        models = httpx.get(url + "/v1/models", timeout=10).json()["data"]
        assert models[0]["id"] == model_dir.name and models[0]["status"] == "loaded"
    finally:
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    assert f"serving on http://127.0.0.1:{port}" in err
