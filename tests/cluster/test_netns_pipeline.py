"""A pipeline across separate network stacks (Linux network namespaces on one bridge): the stages' ring
runs over the namespaces' own addresses, a request through the node without a stage decodes like one
node, and a stage whose network is cut mid-stream ends the request with an error within 15 s; no runner
of the broken pipeline stays (on either side of the cut) and the model is placed anew on the nodes that
can still reach each other, so the next request succeeds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest

from exo.cards import bundled_model_dir
from exo.engine import Engine, GenerationRequest, load_checkpoint

from .netns import NetnsLab, netns_unavailable, require
from .test_netns_cluster import Daemon

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
MODEL = "exo-demo"
ERROR_WITHIN_S = 15.0

# Streams a chat completion from inside a namespace: one line per SSE line, prefixed with the time.
_STREAM = r"""
import json, sys, time, urllib.request
body = json.dumps({"model": "exo-demo", "messages": [{"role": "user", "content": "Tell me a long story."}],
                   "max_tokens": 3000, "temperature": 0, "stream": True}).encode()
request = urllib.request.Request(sys.argv[1], body, {"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(request, timeout=60) as response:
        for line in response:
            print(f"{time.monotonic():.3f} {line.decode().rstrip()}", flush=True)
except Exception as e:
    print(f"{time.monotonic():.3f} EXC {e}", flush=True)
"""


@pytest.fixture(scope="module")
def lab_daemons(tmp_path_factory: pytest.TempPathFactory) -> Any:
    require(netns_unavailable())
    root = tmp_path_factory.mktemp("netns_pipeline")
    with NetnsLab(3) as lab:
        nodes = [Daemon(lab, i, root / f"n{i}", "pipes") for i in range(3)]
        try:
            for node in nodes:
                node.wait_serving(timeout=90)
            deadline = time.monotonic() + 30
            while any(len(n.cluster()["nodes"]) != 3 for n in nodes):
                assert time.monotonic() < deadline, [n.cluster() for n in nodes]
                time.sleep(0.5)
            yield lab, nodes
        finally:
            for node in nodes:
                if node.proc.poll() is None:
                    node.proc.terminate()
            for node in nodes:
                node.stop()


def _post(lab: NetnsLab, node: Daemon, path: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    code = ("import json, sys, urllib.request, urllib.error\n"
            "r = urllib.request.Request(sys.argv[1], sys.argv[2].encode(), {'Content-Type': 'application/json'})\n"
            "try:\n    resp = urllib.request.urlopen(r, timeout=float(sys.argv[3])); print(resp.status); print(resp.read().decode())\n"
            "except urllib.error.HTTPError as e:\n    print(e.code); print(e.read().decode())\n")
    url = f"http://{node.ip}:52415{path}"
    out = lab.run(node.i, [sys.executable, "-c", code, url, json.dumps(body), str(timeout)], timeout=timeout + 10)
    status, _, text = out.stdout.partition("\n")
    return int(status), json.loads(text)


def _node_id(node: Daemon) -> str:
    return next(n["id"] for n in node.cluster()["nodes"] if n["self"])


def test_a_pipeline_across_network_namespaces(lab_daemons: Any) -> None:
    lab, (a, b, c) = lab_daemons
    b_id, c_id = _node_id(b), _node_id(c)
    status, created = _post(lab, a, "/v1/instances", {"model": MODEL, "nodes": [b_id, c_id], "wait": True})
    assert status == 201 and created["instance"]["state"] == "ready", created
    instance_id = created["instance"]["id"]
    pids = _wait(lambda: [s["pid"] for s in _instance(a, instance_id)["stages"]] if all(
        s["pid"] for s in _instance(a, instance_id)["stages"]) else None, 15, "the stages' runner pids")
    engine = Engine(load_checkpoint(bundled_model_dir(MODEL)))
    prompt = "def fibonacci(n):"
    plain = engine.complete(GenerationRequest(engine.loaded.tokenizer.encode(prompt), max_tokens=24,
                                              native_mtp="off"))
    for mtp in ({"k": 2}, None):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0}
        if mtp is not None:
            body["native_mtp"] = mtp
        status, result = _post(lab, a, "/v1/completions", body)  # a holds no stage
        assert status == 200, result
        assert result["choices"][0]["text"] == plain.text
        assert result["usage"]["native_mtp"]["mode"] == "pipeline" and result["usage"]["native_mtp"]["stages"] == 2

    # Cut the first stage's network mid-stream: nothing is closed, its neighbours just stop hearing from it.
    stream = lab.popen(a.i, [sys.executable, "-c", _STREAM, f"http://{a.ip}:52415/v1/chat/completions"],
                       stdout=subprocess.PIPE, text=True)
    assert stream.stdout is not None
    lines = []
    for line in stream.stdout:
        lines.append(line.rstrip())
        if '"content"' in line:
            break
    cut = time.monotonic()
    lab.run(b.i, ["ip", "link", "set", "eth0", "down"], check=True)
    rest = [line.rstrip() for line in stream.stdout]
    stream.wait(30)
    ended = float(rest[-1].split(" ", 1)[0])
    data = [line.split(" ", 1)[1][6:] for line in rest if " data: " in line]
    assert data[-1] == "[DONE]" and "error" in json.loads(data[-2]), rest[-3:]
    assert ended - cut <= ERROR_WITHIN_S, (ended - cut, data[-2], c.output()[-1500:], a.output()[-1500:])

    # No runner of the broken pipeline stays blocked in a receive: the leader's (on C, whose peer went
    # silent) and the cut stage's own (on B, which can reach no one) both exit.
    _wait(lambda: not any(_alive(pid) for pid in pids), 20, f"the runners {pids} to exit")
    # Placed anew on the nodes that still reach each other (A and C; it fits on one): no manual step.
    def answered() -> dict | None:
        status, result = _post(lab, a, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 24,
                                                           "temperature": 0}, timeout=60)
        return result if status == 200 else None

    result = _wait(answered, 90, "a request to succeed after the cut", interval=1.0)
    assert result["choices"][0]["text"] == plain.text
    placed = [i for i in a.cluster()["instances"] if i["model"] == MODEL and i["state"] == "ready"]
    assert placed and all(b_id not in {s["node"] for s in i["stages"]} | {i["node"]} for i in placed), placed


def _instance(node: Daemon, instance_id: str) -> dict:
    return next(i for i in node.cluster()["instances"] if i["id"] == instance_id)


def _alive(pid: int) -> bool:
    """The process runs (a zombie, ended but not reaped yet, does not)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (ProcessLookupError, OSError):
        return False


def _wait(condition: Any, timeout: float, what: str, interval: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(interval)
