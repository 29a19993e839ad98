"""GET /v1/models statuses and order, on-demand loading through the catalog, the load timeout."""

from __future__ import annotations

import textwrap

import pytest
from huggingface_hub import constants

CARD = """
id = "{id}"
name = "Tiny {id}"
arch = "qwen3_5"
repo = "{repo}"
n_layers = 4
hidden_size = 64
kv_heads = 2
context_length = 262144
storage_bytes = 1000000

[native_mtp]
num_layers = 1
default_k = 2
max_k = 3
"""


def _hf_cache_entry(cache, repo: str, source) -> None:
    """A Hugging Face cache snapshot of ``repo`` holding the files of ``source`` (the hub's own layout)."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / "0123456789abcdef"
    snapshot.mkdir(parents=True)
    for file in source.iterdir():
        (snapshot / file.name).symlink_to(file)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("0123456789abcdef")


@pytest.fixture
def catalog_home(tmp_path, monkeypatch, checkpoint):
    """An EXO_HOME with user cards for two models in a private Hugging Face cache."""
    cache = tmp_path / "hf_cache"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    home = tmp_path / "home"
    (home / "model_cards").mkdir(parents=True)
    models = {
        "tiny-head": ("exo-test/tiny-head", checkpoint("qwen3_5")),
        "tiny-mlx": ("exo-test/tiny-mlx", checkpoint("qwen3_5", layout="mlx")),
    }
    for card_id, (repo, source) in models.items():
        _hf_cache_entry(cache, repo, source)
        (home / "model_cards" / f"{card_id}.toml").write_text(textwrap.dedent(CARD.format(id=card_id, repo=repo)))
    return home


def _rows(http) -> dict[str, dict]:
    data = http.get("/v1/models").json()["data"]
    return {row["id"]: {**row, "position": i} for i, row in enumerate(data)}


def test_models_load_on_demand_and_are_listed_by_status(make_server, catalog_home):
    srv = make_server(home=catalog_home)  # nothing loaded at start
    with srv.http() as http:
        rows = _rows(http)
        assert rows["tiny-head"]["status"] == rows["tiny-mlx"]["status"] == "local"
        assert rows["tiny-head"]["native_mtp"] == {"default_k": 2, "max_k": 3, "available": True, "reason": None}
        mlx = rows["tiny-mlx"]["native_mtp"]
        assert mlx["available"] is False and "mtp" in mlx["reason"]  # stock mlx layout: head dropped
        assert rows["qwen3.5-27b-4bit"]["status"] == "remote"
        assert rows["qwen3.5-27b-4bit"]["native_mtp"]["available"] is False
        assert rows["tiny-head"]["owned_by"] == "exo-test"
        assert not any(r["status"] == "loaded" for r in rows.values())
        # Local before remote; bundled cards that are on this machine come first among local ones.
        statuses = [r["status"] for r in sorted(rows.values(), key=lambda r: r["position"])]
        assert statuses == sorted(statuses, key=["loaded", "local", "remote"].index)
        local = [r for r in sorted(rows.values(), key=lambda r: r["position"]) if r["status"] == "local"]
        bundled = [r["id"] for r in local if r["owned_by"] == "exo"]
        assert [r["id"] for r in local[: len(bundled)]] == bundled

        body = {"model": "tiny-head", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6}
        response = http.post("/v1/chat/completions", json=body)  # loads it on demand
        assert response.status_code == 200 and response.json()["model"] == "tiny-head"
        assert response.json()["usage"]["native_mtp"]["enabled"] is True
        rows = _rows(http)
        assert rows["tiny-head"]["status"] == "loaded" and rows["tiny-head"]["position"] == 0
        # The repo id names the same model.
        assert http.post("/v1/chat/completions", json={**body, "model": "exo-test/tiny-head"}).json()["model"] == "tiny-head"

        response = http.post("/v1/chat/completions", json={**body, "model": "tiny-mlx"})
        stats = response.json()["usage"]["native_mtp"]
        assert stats["enabled"] is False and "mtp" in stats["reason"]
        rows = _rows(http)  # one model in memory at a time (max_loaded=1): the other was unloaded
        assert rows["tiny-mlx"]["status"] == "loaded" and rows["tiny-head"]["status"] == "local"


def test_a_slow_load_answers_503_and_goes_on_in_the_background(make_server, catalog_home):
    srv = make_server(home=catalog_home, load_timeout_s=0.0)
    body = {"model": "tiny-head", "prompt": "The", "max_tokens": 4}
    with srv.http() as http:
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["code"] == "model_loading" and "still loading" in error["message"]
        assert int(response.headers["Retry-After"]) >= 1
        srv.wait_for(lambda: _rows(http)["tiny-head"]["status"] == "loaded")
        assert http.post("/v1/completions", json=body).status_code == 200


def test_no_model_means_the_default_model(make_server, catalog_home):
    srv = make_server(home=catalog_home)
    srv.service.default_model = "tiny-head"
    with srv.http() as http:
        response = http.post("/v1/completions", json={"prompt": "The", "max_tokens": 4})
        assert response.status_code == 200 and response.json()["model"] == "tiny-head"


def test_the_bundled_demo_model_is_the_default(make_server, tmp_path):
    srv = make_server(home=tmp_path / "home")
    assert srv.service.default_model == "exo-demo"
    with srv.http() as http:
        response = http.post("/v1/completions", json={"prompt": "The", "max_tokens": 4})
        demo = _rows(http)["exo-demo"]
    if demo["status"] == "remote":  # the demo model's files are not in this checkout (yet)
        assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_available"
    else:
        assert response.status_code == 200 and response.json()["model"] == "exo-demo"
        assert _rows(srv.http())["exo-demo"]["position"] == 0
