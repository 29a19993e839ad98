"""What a real `exo serve` node (EXO_API_KEY set) serves for the dashboard: the page at / without a key,
the bundle cached and compressed, /v1/events only with the key, and the stream carrying the node's
state and its changes. No browser needed.
"""

from __future__ import annotations

import gzip
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import pytest
from cluster.daemons import wait_for

from .conftest import API_KEY, BROKEN_MODEL, BUNDLE, KeyedDaemon

pytestmark = pytest.mark.timeout(180)


def test_the_page_loads_without_a_key_and_the_api_still_wants_one(node: KeyedDaemon):
    page = httpx.get(node.url + "/", timeout=10)
    assert page.status_code == 200
    assert page.headers["Content-Type"] == "text/html; charset=utf-8"
    assert page.text == (BUNDLE / "index.html").read_text()
    assert page.headers["Cache-Control"] == "no-cache"
    assert "script-src 'self'" in page.headers["Content-Security-Policy"]
    script = re.search(r'src="\./(assets/[^"]+\.js)"', page.text).group(1)  # type: ignore[union-attr]
    asset = httpx.get(f"{node.url}/{script}", timeout=10)
    assert asset.status_code == 200 and asset.headers["Content-Type"].startswith("text/javascript")
    assert asset.headers["Cache-Control"] == "public, max-age=31536000, immutable"
    assert httpx.get(node.url + "/favicon.svg", timeout=10).status_code == 200
    for path in ("/v1/events", "/v1/cluster", "/v1/settings"):
        refused = httpx.get(node.url + path, timeout=10)
        assert refused.status_code == 401, path
        assert refused.json()["error"]["code"] == "invalid_api_key"
    for path in ("/health", "/metrics", "/openapi.json"):
        assert httpx.get(node.url + path, timeout=10).status_code == 200, path


def test_bundle_is_revalidated_and_compressed(node: KeyedDaemon):
    first = httpx.get(node.url + "/", timeout=10)
    again = httpx.get(node.url + "/", headers={"If-None-Match": first.headers["ETag"]}, timeout=10)
    assert again.status_code == 304 and again.content == b""
    script = re.search(r'src="\./(assets/[^"]+\.js)"', first.text).group(1)  # type: ignore[union-attr]
    raw = httpx.get(f"{node.url}/{script}", headers={"Accept-Encoding": "identity"}, timeout=10)
    assert "Content-Encoding" not in raw.headers
    with httpx.stream("GET", f"{node.url}/{script}", headers={"Accept-Encoding": "gzip"}, timeout=10) as packed:
        assert packed.headers["Content-Encoding"] == "gzip"
        body = b"".join(packed.iter_raw())
    assert gzip.decompress(body) == raw.content == (BUNDLE / script).read_bytes()
    assert len(body) < len(raw.content) / 2
    missing = httpx.get(node.url + "/assets/nope.js", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


class Events:
    """A raw client of /v1/events."""

    def __init__(self, response: httpx.Response) -> None:
        self.lines: Iterator[str] = response.iter_lines()

    def message(self) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        for line in self.lines:
            if not line:
                if fields:
                    return fields
                continue
            name, _, value = line.partition(":")
            fields[name or "comment"] = json.loads(value) if name == "data" else value.strip()
        raise AssertionError("the stream ended")

    def until(self, match: Any, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = self.message()
            if "event" in message and match(message["event"], message["data"]):
                return message
        raise AssertionError("no matching event in time")


def _stream(node: KeyedDaemon) -> Any:
    headers = {"Authorization": f"Bearer {API_KEY}", "Accept": "text/event-stream"}
    return httpx.stream("GET", node.url + "/v1/events", headers=headers, timeout=httpx.Timeout(30, read=70))


def test_event_stream_starts_with_the_whole_state_then_pushes_changes(node: KeyedDaemon):
    with _stream(node) as response:
        assert response.status_code == 200
        assert response.headers["Content-Type"] == "text/event-stream"
        events = Events(response)
        assert events.message() == {"retry": "1000"}
        snapshot = events.message()
        assert snapshot["event"] == "snapshot"
        state = snapshot["data"]
        assert state["cluster"]["name"] == "studio"
        [me] = [n for n in state["nodes"] if n["self"]]
        assert me["name"] == "studio" and me["memory_total_bytes"] > 0 and "exo-demo" in me["models"]
        assert {"exo-demo", "exo-demo-moe"} <= {m["id"] for m in state["models"]}
        demo = next(m for m in state["models"] if m["id"] == "exo-demo")
        assert demo["native_mtp"]["available"] and demo["native_mtp"]["max_k"] >= 1

        current = state["settings"]["native_mtp_enabled"]
        assert node.api("PUT", "/v1/settings", json={"native_mtp_enabled": not current}).status_code == 200
        changed = events.until(lambda kind, _: kind == "settings", timeout=10)
        assert changed["data"]["native_mtp_enabled"] is (not current)
        node.api("PUT", "/v1/settings", json={"native_mtp_enabled": current})
        events.until(lambda kind, data: kind == "settings" and data["native_mtp_enabled"] is current, timeout=10)

        created = node.api("POST", "/v1/instances", json={"model": "exo-demo-moe"})
        assert created.status_code == 201, created.text
        instance_id = created.json()["instance"]["id"]
        added = events.until(lambda kind, data: kind == "instance.added" and data["id"] == instance_id)
        assert added["data"]["model"] == "exo-demo-moe" and added["data"]["node"] == me["id"]
        events.until(lambda kind, data: kind == "instance.updated" and data["id"] == instance_id
                      and data["state"] == "ready")
        assert node.api("DELETE", f"/v1/instances/{instance_id}").status_code == 200
        events.until(lambda kind, data: kind == "instance.removed" and data["id"] == instance_id, timeout=20)

        # The node's downloads (offline: from its cache), from start to end.
        assert state["downloads"] == []
        started = node.api("POST", "/v1/downloads", json={"model": BROKEN_MODEL})
        assert started.status_code == 201, started.text
        download_id = started.json()["id"]
        added = events.until(lambda kind, data: kind == "download.added" and data["id"] == download_id)
        assert added["data"]["model"] == BROKEN_MODEL
        final = events.until(lambda kind, data: kind == "download.updated" and data["id"] == download_id
                              and data["status"] in ("complete", "failed", "cancelled"))
        now = node.api("GET", f"/v1/downloads/{download_id}").json()
        assert (final["data"]["status"], final["data"]["error"]) == (now["status"], now["error"])
        node.api("DELETE", f"/v1/downloads/{download_id}")
        events.until(lambda kind, data: kind == "download.removed" and data["id"] == download_id)


def test_the_node_view_carries_its_prefix_cache(node: KeyedDaemon):
    """The node card's figures (docs/prefix-cache.md): a second turn restores the first's prefix, and the
    node's view (/v1/cluster, the dashboard's stream) shows the hit, the bytes per tier and their budgets."""
    system = {"role": "system", "content": "You are a coding agent with tools: read, grep, run. " * 8}
    turn1 = [system, {"role": "user", "content": "Find the bug."}]
    body = {"model": "exo-demo", "temperature": 0, "max_tokens": 4, "native_mtp": {"enabled": False}}
    first = node.api("POST", "/v1/chat/completions", json={**body, "messages": turn1}, timeout=120)
    assert first.status_code == 200, first.text
    turn2 = turn1 + [first.json()["choices"][0]["message"], {"role": "user", "content": "Tool result: none."}]
    second = node.api("POST", "/v1/chat/completions", json={**body, "messages": turn2}, timeout=120)
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, second.text

    def mine() -> dict[str, Any] | None:
        [me] = [n for n in node.cluster()["nodes"] if n["self"]]
        cache = me["prefix_cache"]
        return cache if cache and cache["hits"] >= 1 else None

    wait_for(mine, 20, "the runner's status to carry its prefix cache")
    cache = mine()
    assert cache is not None and cache["lookups"] >= 2 and 0 < cache["token_hit_rate"] < 1
    assert cache["cached_tokens"] == second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cache["ram_bytes"] <= cache["ram_budget_bytes"] <= 2 << 30
    assert cache["disk_budget_bytes"] == 16 << 30
