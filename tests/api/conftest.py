"""A real exo API server on 127.0.0.1 (ephemeral port), in a background thread, on a genuine tiny model.

    def test_x(server):                       # shared by the module: qwen3_5 raw HF with a trained head
        client = server.openai()
    def test_y(make_server):                  # one with its own settings / environment / hooks
        srv = make_server(env={"EXO_MAX_QUEUE": "1"}, step_hook=hook)
"""

from __future__ import annotations

import functools
import json
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest

from exo.api import BackgroundServer, LocalModelService, build_app
from exo.engine import Engine, GenerationRequest, load_checkpoint, resolve_model
from exo.settings import load_settings


@dataclass
class Server:
    url: str
    service: LocalModelService
    model: str
    home: Path
    api_key: str | None = None
    _background: BackgroundServer | None = field(default=None, repr=False)

    def openai(self, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("api_key", self.api_key or "unused")
        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("timeout", 60)
        return openai.OpenAI(base_url=self.url + "/v1", **kwargs)

    def http(self, **kwargs: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=kwargs.pop("timeout", 60), **kwargs)

    def metric(self, name: str, **labels: str) -> float:
        """One sample of /metrics (0 when the series does not exist yet)."""
        with self.http() as client:
            text = client.get("/metrics").text
        for line in text.splitlines():
            if line.startswith(name) and not line.startswith("#"):
                series, value = line.rsplit(" ", 1)
                if series.split("{")[0] == name and all(f'{k}="{v}"' in series for k, v in labels.items()):
                    return float(value)
        return 0.0

    def wait_for(self, condition: Callable[[], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError("condition not reached in time")
            time.sleep(0.01)

    def stop(self) -> None:
        if self._background is not None:
            self._background.stop()
            self._background = None


@pytest.fixture(scope="session")
def model_dir(checkpoint, tmp_path_factory) -> Path:
    """The trained qwen3_5 fixture (raw Hugging Face layout, trained MTP head) with no end-of-sequence token:
    every generation runs to its budget, whatever a fixture of another seed says first (some end after one
    or two tokens, which left cancellation, timeouts, stop strings and penalties nothing to act on). How the
    engine ends at an end-of-sequence token is tested in tests/engine."""
    return without_eos(checkpoint("qwen3_5"), tmp_path_factory.mktemp("no-eos") / "qwen3_5")


def without_eos(source: Path, target: Path) -> Path:
    """A copy of a checkpoint (weights linked) whose config, generation config and tokenizer name no
    end-of-sequence token."""
    target.mkdir()
    for f in source.iterdir():
        if f.suffix == ".safetensors":
            (target / f.name).symlink_to(f)
        elif f.name in ("config.json", "generation_config.json", "tokenizer_config.json"):
            data = json.loads(f.read_text())
            for section in (data, data.get("text_config") or {}):
                for key in ("eos_token_id", "eos_token"):
                    if key in section:
                        section[key] = None
            (target / f.name).write_text(json.dumps(data))
        else:
            shutil.copy(f, target / f.name)
    return target


@pytest.fixture(scope="session")
def reference(model_dir) -> Callable[..., Any]:
    """The engine's own output for a request: reference(prompt_tokens, max_tokens=..., ...)."""
    engine = Engine(load_checkpoint(model_dir))

    def complete(prompt_tokens: list[int], **request: Any):
        return engine.complete(GenerationRequest(list(prompt_tokens), **request))

    complete.tokenizer = engine.loaded.tokenizer  # type: ignore[attr-defined]
    return complete


@pytest.fixture(scope="session")
def make_server(tmp_path_factory) -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def make(
        model: Path | None = None,
        *,
        env: dict[str, str] | None = None,
        home: Path | None = None,
        preload: bool = True,
        service_kwargs: dict[str, Any] | None = None,
        **config: Any,
    ) -> Server:
        home = home or tmp_path_factory.mktemp("exo_home")
        settings = load_settings(env={"EXO_HOME": str(home), **(env or {})})
        service = LocalModelService(settings, **(service_kwargs or {}))
        model_id = service.default_model
        if model is not None:
            model_id = service.register(resolve_model(str(model)), load=preload)
            service.default_model = model_id
        background = BackgroundServer(build_app(settings, service=service, **config)).start()
        key = settings.api_key.get_secret_value() if settings.api_key else None
        server = Server(background.url, service, model_id, home, key, background)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def server(make_server, model_dir) -> Server:
    return make_server(model_dir)


def sse_events(response: httpx.Response) -> list[Any]:
    """The `data:` payloads of a server-sent-events response (JSON decoded, "[DONE]" kept as is)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


@functools.cache
def short_context_copy(source: Path, target: Path, context: int) -> Path:
    """The same checkpoint with a short declared context (bounded generations for fuzzing)."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config.setdefault("text_config", config)["max_position_embeddings"] = context
    (target / "config.json").write_text(json.dumps(config))
    return target


def demo_model_with_template(template: str, target: Path) -> Path:
    """The bundled demo model with another chat template, in ``target`` (its weights linked, not copied)."""
    from exo.cards import bundled_model_dir

    target.mkdir()
    for f in bundled_model_dir("exo-demo").iterdir():
        if f.name == "tokenizer_config.json":
            config = json.loads(f.read_text())
            config["chat_template"] = template
            (target / f.name).write_text(json.dumps(config))
        elif f.suffix == ".safetensors":
            (target / f.name).symlink_to(f)
        else:
            shutil.copy(f, target / f.name)
    return target


def wait_until_serving(url: str, process: Any, timeout_s: float) -> None:
    """Until ``url``'s /health answers 200 (an ``exo serve`` process starting); fails if it exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "exo serve did not come up"
        time.sleep(0.2)

