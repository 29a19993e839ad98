"""The dashboard's tests: its toolchain (Node, for the unit tests and the bundle check), a real `exo serve`
node that requires an API key (shared by the serving and browser tests), and where artifacts go.

Tests that need Node's packages (``npm ci`` in dashboard/) or Chromium skip with the reason on a machine
without them; under CI (``CI`` set, as ``.ci/run`` runs) a missing tool fails instead, so CI cannot pass
by skipping them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest
from cluster.daemons import Daemon, wait_for

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "dashboard"
BUNDLE = ROOT / "src" / "exo" / "assets" / "dashboard"
NODE_BIN = DASHBOARD / "node_modules" / ".bin"
API_KEY = "dashboard-test-key"


def needs(available: bool, reason: str) -> None:
    """Skip without ``available``, except under CI, where it is a failure."""
    if available:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must provide it (see .ci/run)")
    pytest.skip(reason)


def node_tool(name: str) -> Path:
    tool = NODE_BIN / name
    needs(shutil.which("node") is not None and tool.exists(),
          f"dashboard/node_modules/.bin/{name} is missing: run `npm ci` in dashboard/ (needs Node 20.19+)")
    return tool


@pytest.fixture(scope="session")
def artifacts() -> Path:
    """Screenshots and logs worth looking at after a run: dashboard/test-artifacts/ (git-ignored)."""
    path = DASHBOARD / "test-artifacts"
    path.mkdir(exist_ok=True)
    return path


class KeyedDaemon(Daemon):
    """An `exo serve` node with EXO_API_KEY set; its own calls carry the key."""

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)

    def api(self, method: str, path: str, **kwargs) -> httpx.Response:
        with self.http() as client:
            return client.request(method, path, **kwargs)

    def cluster(self) -> dict:
        response = self.api("GET", "/v1/cluster")
        assert response.status_code == 200, response.text
        return response.json()


BROKEN_MODEL = "broken-demo"


def install_broken_model(home: Path) -> dict[str, str]:
    """A model whose weights on disk are not safetensors (a truncated download, say): listed, placeable,
    and failing to load in its runner. Returns the environment that points the daemon's Hugging Face
    cache at it."""
    demo = ROOT / "src" / "exo" / "assets" / "models" / "exo-demo"
    cache = home / "hf-cache"
    repo_dir = cache / "models--exo-tests--broken-demo"
    snapshot = repo_dir / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text("0" * 40)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, snapshot / name)
    (snapshot / "model.safetensors").write_bytes(b"this is not a safetensors file" * 64)
    card = (ROOT / "model_cards" / "exo-demo.toml").read_text()
    card = card.replace('id = "exo-demo"', f'id = "{BROKEN_MODEL}"').replace('name = "exo demo (dense)"', 'name = "broken demo"')
    card = card.replace('bundled = "exo-demo"', 'repo = "exo-tests/broken-demo"')
    (home / "model_cards").mkdir(parents=True)
    (home / "model_cards" / f"{BROKEN_MODEL}.toml").write_text(card)
    return {"HF_HUB_CACHE": str(cache)}


@pytest.fixture(scope="package")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyedDaemon]:
    home = tmp_path_factory.mktemp("dashboard") / "studio"
    # Offline (and the hub at a closed local port besides): a download uses only what the cache holds,
    # the same on every machine, and never fetches gigabytes where the network is open.
    env = {"EXO_API_KEY": API_KEY, "EXO_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9",
           **install_broken_model(home)}
    daemon = KeyedDaemon(home, "studio", env=env)
    daemon.start().wait_up()
    try:
        wait_for(lambda: daemon.cluster()["nodes"], 20, "the node to know itself")
        yield daemon
    finally:
        daemon.stop()
