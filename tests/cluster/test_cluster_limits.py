"""The API's limits hold when a runner serves the request: a full queue is a 429, the request timeout a
408, and neither leaves the runner busy."""

from __future__ import annotations

import threading
import time

import httpx2 as httpx
import pytest

from .daemons import Daemon, serving, wait_for

pytestmark = pytest.mark.timeout(240)
LONG = {"model": "exo-demo", "prompt": "def f(x):", "max_tokens": 3000, "temperature": 0,
        "native_mtp": {"enabled": False}}


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with serving(Daemon(tmp_path_factory.mktemp("limits"), "limits", extra_args=["--model", "exo-demo"],
                         env={"EXO_MAX_QUEUE": "1", "EXO_MAX_BATCH": "2", "EXO_REQUEST_TIMEOUT_S": "8"})) as d:
        yield d


def _instance(node: Daemon) -> dict:
    return node.get("/v1/instances").json()["instances"][0]


def test_the_request_timeout_is_a_408(node):
    start = time.monotonic()
    response = node.post("/v1/completions", LONG, timeout=60)
    assert response.status_code == 408, response.text
    assert response.json()["error"]["code"] == "request_timeout"
    assert 7 < time.monotonic() - start < 20
    wait_for(lambda: _instance(node)["running"] == 0, 10, "the runner to be free")


def test_a_full_queue_is_a_429_with_retry_after(node):
    results: list[int] = []

    def long_request() -> None:
        results.append(node.post("/v1/completions", LONG, timeout=60).status_code)

    threads = [threading.Thread(target=long_request) for _ in range(3)]
    threads[0].start()
    wait_for(lambda: _instance(node)["running"] == 1, 5, "the first request to run")
    threads[1].start()
    wait_for(lambda: _instance(node)["running"] == 2, 5, "the second request to join the first in a batch")
    threads[2].start()
    wait_for(lambda: _instance(node)["queue_depth"] == 1, 5, "the third request to queue (the batch is full)")
    fourth = node.post("/v1/completions", {**LONG, "max_tokens": 2}, timeout=30)
    assert fourth.status_code == 429, fourth.text
    assert fourth.json()["error"]["code"] == "queue_full" and int(fourth.headers["Retry-After"]) >= 1
    for t in threads:
        t.join(60)
    assert sorted(results) == [408, 408, 408]  # all ran out of time (8 s), the third mostly waiting
    assert httpx.post(node.url + "/v1/completions", json={**LONG, "max_tokens": 2}, timeout=30).status_code == 200
