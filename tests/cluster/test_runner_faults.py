"""A runner killed while a batch decodes, ten times over, on a real daemon: every member's stream ends with an
error (an SSE error event after its tokens, or a 503 before any: never a 500, never a hang), the model serves
again within 15 s of each kill, and the daemon's memory does not grow with the kills."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx2 as httpx
import pytest

from .daemons import Daemon, wait_for

MODEL = "exo-demo"
MEMBERS = 4
KILLS = 10
SERVES_AGAIN_S = 15.0
pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    # The supervisor restarts a runner that crashed at most max_restarts times; past that, the next request
    # places the model anew. Both count as serving again.
    d = Daemon(tmp_path_factory.mktemp("faults") / "node", "node", extra_args=["--model", MODEL])
    d.start()
    try:
        d.wait_up()
        yield d
    finally:
        d.stop()


class _Stream:
    """One streamed completion read on a thread of its own: its status, its events, how it ended."""

    def __init__(self, daemon: Daemon) -> None:
        self.status: int | None = None
        self.events: list[dict] = []
        self.done = False  # data: [DONE] came
        self.failure: BaseException | None = None
        self.ended = threading.Event()
        body = {"model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": 4000, "temperature": 0, "stream": True,
                "ignore_eos": True, "native_mtp": {"enabled": False}}
        threading.Thread(target=self._run, args=(daemon.url, body), daemon=True).start()

    def _run(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.events.append(json.loads(line[6:]))
                if self.status != 200:
                    response.read()
        except BaseException as e:  # noqa: BLE001 - what the test reports
            self.failure = e
        finally:
            self.ended.set()

    @property
    def tokens(self) -> int:
        return sum(1 for e in self.events if e.get("choices"))

    @property
    def error(self) -> dict | None:
        return next((e["error"] for e in self.events if "error" in e), None)


def _instance(daemon: Daemon) -> dict | None:
    instances = [i for i in daemon.get("/v1/instances").json()["instances"] if i["model"] == MODEL]
    return next((i for i in instances if i["state"] == "ready"), None)


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _serves(daemon: Daemon) -> bool:
    try:
        return daemon.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=20).status_code == 200
    except httpx.TransportError:
        return False


def test_a_runner_killed_mid_batch_fails_every_member_cleanly_and_the_model_serves_again(daemon):
    assert daemon.process is not None
    rss: list[int] = []
    for kill in range(KILLS):
        instance = wait_for(lambda: _instance(daemon), 60, "a ready instance")
        streams = [_Stream(daemon) for _ in range(MEMBERS)]
        wait_for(lambda streams=streams: all(s.tokens >= 2 for s in streams), 60, "every member to stream tokens")
        # The runner's status (polled every second) shows them decoding together.
        wait_for(lambda instance=instance: daemon.get(f"/v1/instances/{instance['id']}").json()["running"] == MEMBERS,
                 10, "the batch of every member")
        os.kill(instance["pid"], signal.SIGKILL)
        killed = time.monotonic()
        for s in streams:
            assert s.ended.wait(30), f"kill {kill}: a stream hangs after {s.events[-2:]}\n{daemon.log()}"
            assert s.failure is None, f"kill {kill}: {s.failure!r}"
            assert s.status == 200, s.status  # every member had its first token: the error comes in the stream
            assert s.error is not None and s.error["code"] == "node_unavailable", (kill, s.events[-2:])
            assert s.done, f"kill {kill}: no [DONE] after the error"
        wait_for(lambda: _serves(daemon), SERVES_AGAIN_S, f"the model to serve again after kill {kill}", interval=0.2)
        assert time.monotonic() - killed <= SERVES_AGAIN_S
        rss.append(_rss_bytes(daemon.process.pid))
    # The first kills settle the daemon's allocations (imports, caches); what follows stays flat.
    assert rss[-1] - rss[2] < 24 << 20, [r >> 20 for r in rss]
