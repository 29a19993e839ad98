"""`exo serve` daemons on separate network stacks (Linux network namespaces on one bridge) form a cluster
through zeroconf alone: no static peers. A daemon of another cluster namespace stays out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from .daemons import python_path
from .netns import NetnsLab, netns_unavailable, require

API_PORT, GRPC_PORT = 52415, 52416
JOIN_S = 15  # the bound: nodes see each other within this long of both serving


class Daemon:
    """One `exo serve` in node i's namespace, with its own EXO_HOME."""

    def __init__(self, lab: NetnsLab, i: int, home: Path, namespace: str) -> None:
        self.lab, self.i, self.ip = lab, i, lab.ips[i]
        env = {k: v for k, v in os.environ.items() if not k.startswith("EXO_")}
        env.update(PYTHONPATH=python_path(), EXO_HOME=str(home), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
        self.log_path = home.parent / f"{home.name}.log"
        self.log = open(self.log_path, "w")  # closed in stop()
        argv = [sys.executable, "-m", "exo.cli.main", "serve", "--host", self.ip, "--port", str(API_PORT),
                "--grpc-port", str(GRPC_PORT), "--namespace", namespace]  # fmt: skip
        self.proc = lab.popen(i, argv, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def get(self, path: str) -> tuple[int, str]:
        return self.lab.http_get(self.i, f"http://{self.ip}:{API_PORT}{path}", timeout=3)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_serving(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.get("/health")[0] != 200:
            assert self.proc.poll() is None, f"exo serve exited {self.proc.returncode}:\n{self.output()}"
            assert time.monotonic() < deadline, f"exo serve not up after {timeout}s:\n{self.output()}"
            time.sleep(0.3)

    def cluster(self) -> dict[str, Any]:
        status, body = self.get("/v1/cluster")
        assert status == 200, (status, body)
        return json.loads(body)

    def stop(self) -> int:
        """Wait for the exit after ``terminate()`` (sent to every daemon first, so they stop in parallel)."""
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()
        return self.proc.returncode


pytestmark = pytest.mark.slow  # three cold `exo serve` starts: ~30 s on two cores


@pytest.fixture(scope="module")
def daemons(tmp_path_factory: pytest.TempPathFactory) -> Any:
    require(netns_unavailable())
    root = tmp_path_factory.mktemp("netns_cluster")
    with NetnsLab(3) as lab:
        nodes = {name: Daemon(lab, i, root / name, ns) for i, (name, ns) in enumerate(
            (("a", "alpha"), ("b", "alpha"), ("c", "beta")))}  # fmt: skip
        try:
            for node in nodes.values():
                node.wait_serving(timeout=90)  # three cold starts share two CPU cores
            yield nodes
        finally:
            for node in nodes.values():
                if node.proc.poll() is None:
                    node.proc.terminate()
            for node in nodes.values():
                node.stop()


def _ids(view: dict[str, Any]) -> set[str]:
    return {n["id"] for n in view["nodes"]}


def _self_id(node: Daemon) -> str:
    view = node.cluster()
    (own,) = [n["id"] for n in view["nodes"] if n["self"]]
    return own


def _wait_answered_after(node: Daemon, peer_id: str, since: float, timeout: float = 60.0) -> None:
    """Until ``node`` reports an answer from ``peer_id`` later than ``since`` (time.monotonic(): one clock on
    the host for every namespace)."""
    deadline = time.monotonic() + timeout
    while True:
        now = time.monotonic()
        seen = [n for n in node.cluster()["nodes"] if n["id"] == peer_id]
        if seen and now - seen[0]["last_seen_s"] > since:
            return
        assert now < deadline, f"no answer from {peer_id} polled after {timeout} s: {node.cluster()}"
        time.sleep(0.2)


def test_discovered_daemons_join(daemons: dict[str, Daemon]) -> None:
    a, b = daemons["a"], daemons["b"]
    a_id, b_id = _self_id(a), _self_id(b)
    assert a_id != b_id
    t0 = time.monotonic()
    while not (_ids(a.cluster()) == _ids(b.cluster()) == {a_id, b_id}):
        assert time.monotonic() - t0 < JOIN_S, f"a sees {a.cluster()}\nb sees {b.cluster()}"
        time.sleep(0.5)
    # Each reports the other at its namespace address and ports, learned from the advert.
    (b_seen,) = [n for n in a.cluster()["nodes"] if n["id"] == b_id]
    assert (b_seen["self"], b_seen["api_port"], b_seen["grpc_port"], b_seen["namespace"]) == (
        False, API_PORT, GRPC_PORT, "alpha")  # fmt: skip
    assert b_seen["host"] == b.ip


def test_other_namespace_does_not_join(daemons: dict[str, Daemon]) -> None:
    a, b, c = daemons["a"], daemons["b"], daemons["c"]
    a_id, b_id, c_id = _self_id(a), _self_id(b), _self_id(c)
    # Wait for the alpha pair to have met: c's advert has been on the same wire at least as long.
    t0 = time.monotonic()
    while _ids(a.cluster()) != {a_id, b_id}:
        assert time.monotonic() - t0 < JOIN_S, a.cluster()
        time.sleep(0.5)
    # c's advert has been on the wire as long as b's; a reported one would be polled at once. The positive
    # control that a's registry has moved on since: two more answers from b (each a whole poll of every
    # address a knows), however long a poll takes on this machine.
    for _ in range(2):
        since = time.monotonic()
        _wait_answered_after(a, b_id, since)
    assert _ids(a.cluster()) == {a_id, b_id}
    assert _ids(b.cluster()) == {a_id, b_id}
    assert _ids(c.cluster()) == {c_id}
    assert "advertising" in c.output()  # c did advertise: it was filtered, not silent


def test_stopped_daemon_leaves(daemons: dict[str, Daemon]) -> None:
    # Runs last (it stops b): b's goodbye (or its silence) takes it out of a's view, and b exits cleanly.
    a, b = daemons["a"], daemons["b"]
    a_id, b_id = _self_id(a), _self_id(b)
    t0 = time.monotonic()
    while _ids(a.cluster()) != {a_id, b_id}:
        assert time.monotonic() - t0 < JOIN_S, a.cluster()
        time.sleep(0.5)
    b.proc.terminate()
    assert b.stop() == 0, b.output()
    t0 = time.monotonic()
    while _ids(a.cluster()) != {a_id}:
        assert time.monotonic() - t0 < JOIN_S, a.cluster()
        time.sleep(0.5)
