"""``/v1/downloads`` on a real exo API server (a background thread) downloading from the local hub."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

from exo.api import BackgroundServer, LocalModelService, build_app
from exo.api.downloads import DOWNLOADS
from exo.downloads import HubConfig
from exo.settings import load_settings

from .conftest import write_card

REPO = "org/tiny"
SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


@pytest.fixture
def api(hub) -> Iterator[httpx.Client]:
    settings = load_settings(env={"EXO_HOME": os.environ["EXO_HOME"]})  # where write_card puts cards
    server = BackgroundServer(build_app(settings, service=LocalModelService(settings))).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            yield client
    finally:
        server.stop()


def events(client: httpx.Client, download_id: str) -> list:
    with client.stream("GET", f"/v1/downloads/{download_id}/events") as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
                for line in response.iter_lines() if line.startswith("data: ")]


def test_a_download_its_progress_events_and_its_recovered_head(api, hub, checkpoint):
    # A stock MLX conversion whose card names the raw repo: the daemon fetches it, then the source's head
    # shard, and recovers the head in a child process (a daemon never runs MLX in its own threads).
    stripped = checkpoint("qwen3_5", layout="mlx")
    hub.add_repo("mlx-community/tiny-4bit", stripped)
    hub.add_repo("Qwen/Tiny", checkpoint("qwen3_5", "hf", "trained"))
    write_card("tiny-4bit", "mlx-community/tiny-4bit", stripped, source_repo="Qwen/Tiny")
    hub.slow[("mlx-community/tiny-4bit", "model.safetensors")] = 0.05  # progress shows part-way
    hub.slow[("Qwen/Tiny", SHARD2)] = 0.1  # and so does the head's phase
    created = api.post("/v1/downloads", json={"model": "tiny-4bit"})
    assert created.status_code == 201, created.text
    download = created.json()
    assert download["object"] == "download" and download["model"] == "tiny-4bit"
    weights = sum(p.stat().st_size for p in stripped.iterdir())
    assert download["progress"]["bytes_total"] == weights
    again = api.post("/v1/downloads", json={"model": "tiny-4bit"})  # while it runs: the same download
    assert again.status_code == 200 and again.json()["id"] == download["id"]
    other_head = api.post("/v1/downloads", json={"model": "tiny-4bit", "quantize_head": True})  # not that one
    assert other_head.status_code == 409, other_head.text
    error = other_head.json()["error"]
    assert error["code"] == "download_conflict" and download["id"] in error["message"]
    assert "quantize_head=false" in error["message"]

    seen = events(api, download["id"])
    assert seen[-1] == "[DONE]"
    updates = seen[:-1]
    done = [u["progress"]["bytes_done"] for u in updates]
    assert done == sorted(done) and any(0 < d < weights for d in done)
    statuses = list(dict.fromkeys(u["status"] for u in updates))
    assert statuses[-3:] == ["recovering_head", "validating", "complete"], statuses
    final = updates[-1]
    head_shard = (checkpoint("qwen3_5", "hf", "trained") / SHARD2).stat().st_size
    assert final["progress"]["bytes_total"] > weights + head_shard  # the head's shard (and index) joined
    assert final["progress"]["bytes_done"] == final["progress"]["bytes_total"] and final["progress"]["eta_s"] == 0
    head = final["result"]["head"]
    assert head["status"] == "recovered" and head["source_repo"] == "Qwen/Tiny" and head["agreement"] >= 0.3
    assert final["result"]["files_fetched"] == len(list(stripped.iterdir())) and final["error"] is None
    assert (Path(final["result"]["path"]) / "mtp.safetensors").is_file()

    assert api.get(f"/v1/downloads/{download['id']}").json() == final
    listed = api.get("/v1/downloads").json()
    assert listed["object"] == "list" and [d["id"] for d in listed["data"]] == [download["id"]]
    deleted = api.delete(f"/v1/downloads/{download['id']}").json()
    assert deleted == {"id": download["id"], "object": "download.deleted", "cancelled": False, "deleted": True}
    assert api.get("/v1/downloads").json()["data"] == []


def test_cancel_stops_a_running_download_and_keeps_no_partial_file(api, hub, checkpoint):
    hub.add_repo(REPO, checkpoint("qwen3_5"))
    gate = hub.gates[(REPO, SHARD2)] = threading.Event()
    download = api.post("/v1/downloads", json={"model": REPO}).json()
    deadline = time.monotonic() + 30
    cache = HubConfig.from_env().cache_dir
    # Shard 2 stalls at its gate; shard 1 runs beside it: cancel once it is in the snapshot (under load
    # the two overlap, and a shard 1 still running when the cancel lands is rightly dropped too).
    while not (any(p.endswith(SHARD2) for p in hub.started) and list(cache.rglob(f"snapshots/*/{SHARD1}"))):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    threading.Timer(0.3, gate.set).start()  # the stalled shard moves again after the cancel
    deleted = api.delete(f"/v1/downloads/{download['id']}").json()
    assert deleted["cancelled"] is True
    view = api.get(f"/v1/downloads/{download['id']}").json()
    assert view["status"] == "cancelled" and view["result"] is None
    assert not list(cache.rglob("*.incomplete"))  # the partial file is gone...
    assert not list(cache.rglob(f"snapshots/*/{SHARD2}"))  # ...and never linked into the snapshot
    assert list(cache.rglob(f"snapshots/*/{SHARD1}"))  # finished files stay for next time


def test_bad_requests(api, hub, checkpoint):
    hub.add_repo(REPO, checkpoint("qwen3_5"))

    def error(response: httpx.Response, status: int, code: str) -> dict:
        assert response.status_code == status, response.text
        assert response.json()["error"]["code"] == code
        return response.json()["error"]

    error(api.post("/v1/downloads", content=b"{nope"), 400, "invalid_json")
    error(api.post("/v1/downloads", json={}), 400, "missing_required_parameter")
    error(api.post("/v1/downloads", json={"model": 5}), 400, "invalid_type")
    error(api.post("/v1/downloads", json={"model": REPO, "stage": 1}), 400, "unknown_parameter")
    error(api.post("/v1/downloads", json={"model": REPO, "revision": "../../etc"}), 400, "invalid_value")
    assert "qwen3.5-27b-4bit" in error(api.post("/v1/downloads", json={"model": "qwen3.5-27b"}), 404,
                                       "model_not_found")["message"]
    error(api.post("/v1/downloads", json={"model": "org/nothing"}), 404, "repo_not_found")
    for method in ("GET", "DELETE"):
        error(api.request(method, "/v1/downloads/nope"), 404, "download_not_found")
    error(api.get("/v1/downloads/nope/events"), 404, "download_not_found")

    bundled = api.post("/v1/downloads", json={"model": "exo-demo"})
    assert bundled.status_code == 201
    final = events(api, bundled.json()["id"])[-2]
    assert final["status"] == "complete" and final["result"]["bundled"] is True


def test_not_enough_disk_is_a_507_and_fetches_nothing(hub, checkpoint):
    hub.add_repo(REPO, checkpoint("qwen3_5"))
    settings = load_settings(env={"EXO_HOME": os.environ["EXO_HOME"]})
    app = build_app(settings, service=LocalModelService(settings))
    app[DOWNLOADS].reserve_bytes = 1 << 60  # more than any disk has free
    server = BackgroundServer(app).start()
    try:
        response = httpx.post(server.url + "/v1/downloads", json={"model": REPO}, timeout=30)
    finally:
        server.stop()
    assert response.status_code == 507, response.text
    error = response.json()["error"]
    assert error["code"] == "insufficient_storage" and "not enough disk for org/tiny" in error["message"]
    assert hub.gets(REPO) == []


def test_offline_and_missing_is_a_404_naming_the_files(hub, checkpoint, tmp_path, monkeypatch):
    hub.add_repo(REPO, checkpoint("qwen3_5"))
    settings = load_settings(env={"EXO_HOME": str(tmp_path / "exo-home"), "EXO_OFFLINE": "1"})
    server = BackgroundServer(build_app(settings, service=LocalModelService(settings))).start()
    try:
        response = httpx.post(server.url + "/v1/downloads", json={"model": REPO}, timeout=30)
        assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_available"
        assert "offline" in response.json()["error"]["message"] and REPO in response.json()["error"]["message"]
        document = httpx.get(server.url + "/openapi.json").json()
        assert {"/v1/downloads", "/v1/downloads/{id}", "/v1/downloads/{id}/events"} <= set(document["paths"])
        assert "DownloadObject" in document["components"]["schemas"]
    finally:
        server.stop()
    assert hub.log == []
    assert not Path(HubConfig.from_env().cache_dir).exists()
