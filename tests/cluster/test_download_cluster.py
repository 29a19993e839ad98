"""Models on no node's disk, through real `exo serve` daemons downloading from a local hub.

Three daemons (A, B, C) on 127.0.0.1, each with its own empty Hugging Face cache, download from a local
stand-in for the hub (``downloads.hub_server.FakeHub``, the real huggingface_hub client pointed at it by
HF_ENDPOINT); their user cards name the hub's fixture repos (the 4-layer Qwen3.5 fixture re-sharded so
that each part of the model has its own shard). A fourth daemon (D) is offline, alone.

- a request for a model on no disk places it on a node that downloads it: the instance is seen
  ``downloading`` with its progress (in /v1/instances, the node's downloads in /v1/cluster and in
  /v1/downloads of another node), then ``ready``, and it answers as one node decoding plainly does;
- a pipeline over B and C: each node downloads only its stage's files, and the pipeline answers the same;
- a hub that fails fails the instance with the reason (a pipeline's other stage is torn down);
- offline, a model on no disk is the "not on the disk" error naming what to pull, and the hub is not asked.
"""

from __future__ import annotations

import json
import textwrap
import threading
import time
from pathlib import Path

import pytest
from downloads.hub_server import FakeHub
from downloads.reshard import INDEX, reshard, shard_name

from exo.cluster import groups, registry
from exo.downloads import stage_files
from exo.engine import Engine, GenerationRequest, load_checkpoint

from .daemons import Daemon, wait_for

pytestmark = pytest.mark.timeout(300)

REPOS = {"dl-dense": "exo-test/dl-dense", "dl-pipe": "exo-test/dl-pipe", "dl-broken": "exo-test/dl-broken"}
CARD = """
id = "{id}"
name = "download test {id}"
arch = "qwen3_5"
repo = "{repo}"
n_layers = 4
hidden_size = 64
kv_heads = 2
head_dim = 32
context_length = 4096
storage_bytes = {size}

[native_mtp]
num_layers = 1
default_k = 2
max_k = 3
"""
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fib"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(checkpoint, tmp_path_factory) -> Path:
    return reshard(
        checkpoint("qwen3_5", dtype="float32"), tmp_path_factory.mktemp("dl-model") / "four-shards"
    )


@pytest.fixture(scope="module")
def hub(model_dir):
    server = FakeHub().start()
    for repo in REPOS.values():
        server.add_repo(repo, model_dir)
    # The shard of layers 2-3 fails: a whole download fails, and so does a pipeline's last stage.
    server.failing[(REPOS["dl-broken"], shard_name(3))] = 500
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, hub, model_dir):
    root = tmp_path_factory.mktemp("download-cluster")
    size = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    daemons = []
    for name in "abcd":
        home = root / f"node-{name}"
        (home / "model_cards").mkdir(parents=True)
        for card, repo in REPOS.items():
            (home / "model_cards" / f"{card}.toml").write_text(
                textwrap.dedent(CARD.format(id=card, repo=repo, size=size))
            )
        env = {
            "HF_ENDPOINT": hub.url,
            "HF_HOME": str(root / f"hf-{name}"),
            "HF_HUB_OFFLINE": "0",
            "HF_TOKEN": "",
        }
        if name == "d":
            env["EXO_OFFLINE"] = "1"
        daemons.append(Daemon(home, f"node-{name}", env=env))
    *online, offline = daemons
    for d in online:
        d.start([x.address for x in online])
    offline.start()
    try:
        for d in daemons:
            d.wait_up()
        wait_for(lambda: all(len(d.node_ids()) == 3 for d in online), 30, "three nodes to see each other")
        yield daemons
    finally:
        for d in daemons:
            d.stop()


def cache_files(daemon: Daemon, repo: str) -> set[str]:
    """The files of ``repo`` in the daemon's Hugging Face cache (its snapshot)."""
    hf_home = Path(daemon.env["HF_HOME"])
    snapshots = list((hf_home / "hub" / ("models--" + repo.replace("/", "--")) / "snapshots").glob("*"))
    return {p.name for s in snapshots for p in s.iterdir()}


def plain_text(model_dir: Path) -> str:
    engine = Engine(load_checkpoint(model_dir))
    prompt = engine.loaded.tokenizer.encode(PROMPT)
    return engine.complete(GenerationRequest(prompt, max_tokens=MAX_TOKENS, native_mtp="off")).text


def complete(api: Daemon, model: str):
    return api.post(
        "/v1/completions",
        {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0},
        timeout=180,
    )


def instances_of(api: Daemon, model: str) -> list[dict]:
    return [i for i in api.get("/v1/instances").json()["instances"] if i["model"] == model]


def test_a_request_for_a_model_on_no_disk_downloads_it_then_answers(cluster, hub, model_dir):
    a, b, c, _ = cluster
    repo = REPOS["dl-dense"]
    for i in range(1, 5):
        hub.slow[(repo, shard_name(i))] = 0.2  # each 64 KiB chunk waits: the download takes a few seconds
    answer: dict = {}
    thread = threading.Thread(target=lambda: answer.update(response=complete(a, "dl-dense")))
    thread.start()
    seen, cluster_views, listed = [], [], []
    while thread.is_alive():
        for daemon in (a, b, c):  # the owner's own API is up to date; A's view of it is up to 1.5 s old
            seen += instances_of(daemon, "dl-dense")
        owner = next((i["node"] for i in seen if i["state"] == "downloading"), None)
        if owner is not None and not listed:
            # Another node's API (as of the owner's last answer to its polls) shows the owner's download.
            other = next(d for d in (a, b, c) if d.node_id != owner)
            listed += [d for d in other.get("/v1/downloads").json()["data"] if d["model"] == "dl-dense"]
            if listed:
                cluster_views.append(other.cluster())
        time.sleep(0.1)
    thread.join()
    response = answer["response"]
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == plain_text(model_dir)

    downloading = [i for i in seen if i["state"] == "downloading"]
    assert downloading, [i["state"] for i in seen]
    progress = downloading[-1]["download"]
    size = sum(p.stat().st_size for p in model_dir.iterdir())
    assert progress["status"] in ("planning", "downloading", "validating") and progress["bytes_total"] == size
    assert downloading[0]["stages"][0]["state"] == "downloading"
    done = [i["download"]["bytes_done"] for i in downloading if i["self"]]  # as the owner saw it, in order
    assert done == sorted(done) and any(0 < d < size for d in done), done
    node = downloading[0]["node"]
    final = instances_of(a, "dl-dense")[0]
    assert final["state"] == "ready" and final["node"] == node
    assert final["download"]["status"] == "complete" and final["download"]["bytes_done"] == size

    # The cluster state carried the download: the node's downloads in another node's /v1/cluster and
    # /v1/downloads.
    assert listed and listed[0]["node"] == node and listed[0]["progress"]["bytes_total"] == size
    node_views = [n for v in cluster_views for n in v["nodes"] if n["id"] == node]
    assert node_views and node_views[0]["downloads"][0]["model"] == "dl-dense"
    assert node_views[0]["downloads"][0]["options"]["stage"] is None  # the whole model

    # That node holds the whole model now (its peers see it), and only that node downloaded it.
    daemon = next(d for d in cluster if d.node_id == node)
    assert cache_files(daemon, repo) >= {shard_name(i) for i in range(1, 5)}
    assert all(not cache_files(d, repo) for d in cluster if d is not daemon)
    wait_for(
        lambda: "dl-dense" in next(n["models"] for n in a.cluster()["nodes"] if n["id"] == node),
        15,
        "the node to list the model as on its disk",
    )
    assert a.delete(f"/v1/instances/{final['id']}").status_code == 200


def test_a_pipeline_downloads_only_each_stage_s_files(cluster, hub, model_dir):
    a, b, c, _ = cluster
    repo = REPOS["dl-pipe"]
    created = a.post(
        "/v1/instances", {"model": "dl-pipe", "nodes": [b.node_id, c.node_id], "wait": True}, timeout=180
    )
    assert created.status_code == 201, created.text
    body = created.json()
    instance = body["instance"]
    try:
        assert [s["download"] for s in body["placement"]["stages"]] == [True, True]
        assert instance["state"] == "ready", instance
        weight_map = json.loads((model_dir / INDEX).read_text())["weight_map"]
        for daemon, stage in zip((b, c), instance["stages"], strict=True):
            wanted = set(stage_files(weight_map, stage["start_layer"], stage["end_layer"], 4))
            weights = {f for f in cache_files(daemon, repo) if f.endswith(".safetensors")}
            assert weights == wanted, (stage, weights)
            assert len(wanted) < 4  # a stage's node really skipped a shard
            assert stage["download"]["status"] == "complete"
        assert not cache_files(a, repo)
        views = {n["id"]: n for n in a.cluster()["nodes"]}
        for daemon, stage in zip((b, c), instance["stages"], strict=True):
            assert "dl-pipe" not in views[daemon.node_id]["models"]  # a stage's files are not the model
            ranges = [
                d["options"]["stage"] for d in views[daemon.node_id]["downloads"] if d["model"] == "dl-pipe"
            ]
            assert ranges == [{"start": stage["start_layer"], "end": stage["end_layer"], "n_layers": 4}]
        # A peer's download, through A: shown (with its node), but cancelled or followed on its own node.
        peer_download = stage["download"]["id"]
        shown = a.get(f"/v1/downloads/{peer_download}")
        assert shown.status_code == 200 and shown.json()["node"] == c.node_id
        assert shown.json()["status"] == "complete"
        refused = a.delete(f"/v1/downloads/{peer_download}")
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "download_on_other_node"
        assert c.node_id in refused.json()["error"]["message"]
        response = complete(a, "dl-pipe")  # A holds no stage
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == plain_text(model_dir)
        assert response.json()["usage"]["native_mtp"]["stages"] == 2
    finally:
        assert a.delete(f"/v1/instances/{instance['id']}").status_code == 200


def test_a_failed_download_fails_the_instance_with_the_reason(cluster, hub):
    a, b, c, _ = cluster
    response = complete(a, "dl-broken")
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert error["code"] == "model_load_failed"
    assert "downloading dl-broken" in error["message"] and "HTTP 500" in error["message"], error
    # The answer comes from the node that downloaded; A's view of that node's instances follows within a
    # poll of the registry (1.5 s).
    def settled() -> list[dict]:
        found = instances_of(a, "dl-broken")
        return found if found and all(i["state"] not in ("loading", "downloading") for i in found) else []

    failed = wait_for(settled, 10, "A's view of the failed instance")
    assert [i["state"] for i in failed] == ["failed"] and "HTTP 500" in failed[0]["failure"]["message"]
    assert failed[0]["pid"] == 0  # no runner was started

    # A pipeline: stage 0 gets its files (shards 1-2) and starts; stage 1's shard fails; stage 0 is torn down.
    created = a.post(
        "/v1/instances", {"model": "dl-broken", "nodes": [b.node_id, c.node_id], "wait": True}, timeout=180
    )
    assert created.status_code == 500, created.text
    assert "HTTP 500" in created.json()["error"]["message"]
    pipeline = wait_for(
        lambda: next(
            (
                i
                for i in instances_of(a, "dl-broken")
                if len(i["stages"]) == 2 and all(s["state"] == "failed" for s in i["stages"])
            ),
            None,
        ),
        30,
        "every stage of the pipeline to fail",
    )
    first, last = pipeline["stages"]
    assert "HTTP 500" in last["failure"]["message"]
    assert "its pipeline broke" in first["failure"]["message"], first
    # "its pipeline broke" is the watcher's word: it has seen the break (the positive control). It must not
    # place the model anew (the hub would fail the same way). Were it to, it would within the re-placement's
    # settling bound (the registry's expiry and a second after the break; sooner once every node answered):
    # after that whole window, no node has logged a placement and the hub saw no new fetch.
    fetches = len(hub.gets(REPOS["dl-broken"]))
    time.sleep(registry.EXPIRE_S + 1.0 + 4 * groups.WATCH_S + 2.0)
    assert not [d.name for d in (a, b, c) if "dl-broken anew" in d.log_path.read_text()]
    assert len(hub.gets(REPOS["dl-broken"])) == fetches
    assert all(i["state"] == "failed" for i in instances_of(a, "dl-broken"))
    for inst in instances_of(a, "dl-broken"):
        assert a.delete(f"/v1/instances/{inst['id']}").status_code == 200
    wait_for(lambda: all(not instances_of(d, "dl-broken") for d in (a, b, c)), 15, "the failed ones to be gone")


def test_offline_a_model_on_no_disk_says_what_to_pull(cluster, hub):
    offline = cluster[3]
    before = len(hub.log)
    response = complete(offline, "dl-dense")
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert error["code"] == "model_not_available" and "exo pull dl-dense" in error["message"], error
    assert "offline" in error["message"]
    assert offline.cluster()["nodes"][0]["offline"] is True
    assert len(hub.log) == before and not cache_files(offline, REPOS["dl-dense"])
