"""Anthropic's count_tokens on a cluster node (``exo serve``) whose disk has the model's files: counted in
the API process with the runner's chat template and tokenizer, so no job reaches the runner's device, even
while a long generation holds it."""

from __future__ import annotations

import threading

import httpx2 as httpx
import pytest

from .daemons import Daemon, serving, wait_for

pytestmark = pytest.mark.timeout(240)
MODEL = "exo-demo"
# As Claude Code sends it: system blocks, a tool round trip, thinking on.
BODY = {"model": MODEL, "system": [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": [
            {"role": "user", "content": "Add 1 and 2."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "add",
                                               "input": {"a": 1, "b": 2}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "3"},
                                         {"type": "text", "text": "Now write a function that adds two numbers."}]}],
        "tools": [{"name": "add", "description": "Adds", "input_schema": {
            "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}]}


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    # One generation at a time on the device: a job for the count would wait behind the long generation.
    with serving(Daemon(tmp_path_factory.mktemp("count"), "count", extra_args=["--model", MODEL],
                         env={"EXO_MAX_BATCH": "1", "EXO_NATIVE_MTP_ENABLED": "0"})) as d:
        yield d


def _generations(node: Daemon) -> float:
    """Every generation this node sent to a runner (exo_generations_total, all finish reasons)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in node.get("/metrics").text.splitlines()
               if line.startswith("exo_generations_total{"))


def _running(node: Daemon) -> int:
    return sum(i["running"] + i["queue_depth"] for i in node.get("/v1/instances").json()["instances"])


def test_count_tokens_never_reaches_the_device_and_matches_the_generation(node):
    before = _generations(node)
    long = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 3000, "temperature": 0, "stream": True}
    first_chunk, stop, finished = threading.Event(), threading.Event(), threading.Event()

    def long_generation() -> None:
        with httpx.stream("POST", node.url + "/v1/completions", json=long, timeout=120) as response:
            for line in response.iter_lines():
                if '"finish_reason": "' in line or '"finish_reason":"' in line:
                    finished.set()
                if line.startswith("data: {"):
                    first_chunk.set()
                if stop.is_set():
                    return  # the client goes away: the long generation is cancelled

    thread = threading.Thread(target=long_generation, daemon=True)
    thread.start()
    try:
        assert first_chunk.wait(120), node.log()
        wait_for(lambda: _running(node) == 1, 10, "the long generation to hold the device")
        counted = node.post("/v1/messages/count_tokens", BODY, timeout=60)
        assert counted.status_code == 200, counted.text
        # Counted while the long generation still runs (the device holds one generation at a time).
        assert not finished.is_set() and thread.is_alive()
    finally:
        stop.set()
        thread.join(60)
    # Only the long generation (cancelled) reached a runner: the count opened none.
    wait_for(lambda: _generations(node) == before + 1 and _running(node) == 0, 30, "the long generation's end")
    assert _generations(node) == before + 1

    answer = node.post("/v1/messages", {**BODY, "max_tokens": 1, "temperature": 0})
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    assert counted.json()["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"] > 0
    wait_for(lambda: _generations(node) == before + 2, 30, "the generation to be counted")


@pytest.fixture(scope="module")
def pair(checkpoint, tmp_path_factory):
    """Node b serves a directory only its disk has; node a has no file of it."""
    root = tmp_path_factory.mktemp("count-pair")
    served = checkpoint("qwen3_5")
    b = Daemon(root / "b", "b", extra_args=["--model", str(served)], env={"EXO_OFFLINE": "1"})
    a = Daemon(root / "a", "a", env={"EXO_OFFLINE": "1"})
    b.start().wait_up(180)
    a.start([b.address]).wait_up(180)
    try:
        yield a, b, served.name  # a directory is served under its name
    finally:
        a.stop()
        b.stop()


def test_count_tokens_asks_the_owner_when_the_files_are_on_another_node(pair):
    a, b, model = pair
    wait_for(lambda: a.node_ids() == {a.node_id, b.node_id}, 60, "the nodes to meet")
    assert model in {m["id"] for m in a.get("/v1/models").json()["data"]}
    body = {**BODY, "model": model}
    before = _generations(a)
    counted = a.post("/v1/messages/count_tokens", body, timeout=180)
    assert counted.status_code == 200, counted.text
    # The owner's runner counted it: one generation from node a (the one-token one, cancelled once counted).
    wait_for(lambda: _generations(a) == before + 1, 30, "the count's generation to be recorded")
    answer = a.post("/v1/messages", {**body, "max_tokens": 1, "temperature": 0})
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    assert counted.json()["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"] > 0
