"""Real ``exo serve`` daemons on 127.0.0.1 for cluster tests: each its own EXO_HOME, API and gRPC ports."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx2 as httpx

from exo.runner.group import free_port  # never the same port twice in this process

SRC = Path(__file__).resolve().parents[2] / "src"


class Daemon:
    def __init__(
        self,
        home: Path,
        name: str,
        *,
        namespace: str | None = None,
        secret: str | None = None,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.home = home
        self.name = name
        self.namespace = namespace
        self.secret = secret
        self.extra_args = list(extra_args)
        self.env = dict(env or {})
        self.port = free_port()
        self.grpc_port = free_port()
        self.process: subprocess.Popen[str] | None = None
        self.log_path = home / "daemon.log"
        self._node_id: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def start(self, peers: Sequence[str] = ()) -> Daemon:
        self.home.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "EXO_HOME": str(self.home), "PYTHONPATH": python_path(), "EXO_API_KEY": ""}
        env.pop("EXO_CLUSTER_SECRET", None)
        if self.secret is not None:
            env["EXO_CLUSTER_SECRET"] = self.secret
        env.update(self.env)
        args = [
            sys.executable, "-m", "exo.cli.main", "serve", "--host", "127.0.0.1", "--port", str(self.port),
            "--grpc-port", str(self.grpc_port), "--no-discovery", "--name", self.name, *self.extra_args,
        ]
        if peers:
            args += ["--peers", ",".join(peers)]
        if self.namespace:
            args += ["--namespace", self.namespace]
        log = self.log_path.open("a")
        self.process = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        log.close()
        return self

    def wait_up(self, timeout: float = 90.0) -> Daemon:
        deadline = time.monotonic() + timeout
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"{self.name} exited ({self.process.returncode}):\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} did not come up:\n{self.log()}")
            time.sleep(0.2)

    @property
    def node_id(self) -> str:
        if self._node_id is None:
            self._node_id = self.cluster()["node_id"]
        return self._node_id

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.url + path, timeout=kw.pop("timeout", 30), **kw)

    def post(self, path: str, body: dict[str, Any], timeout: float = 120) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=timeout)

    def delete(self, path: str, timeout: float = 60) -> httpx.Response:
        return httpx.delete(self.url + path, timeout=timeout)

    def cluster(self) -> dict[str, Any]:
        response = self.get("/v1/cluster")
        assert response.status_code == 200, response.text
        return response.json()

    def node_ids(self) -> set[str]:
        return {n["id"] for n in self.cluster()["nodes"]}

    def log(self) -> str:
        try:
            return self.log_path.read_text()[-6000:]
        except OSError:
            return ""

    def stop(self) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else None
        self.process.send_signal(signal.SIGINT)
        try:
            return self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(10)

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)


def python_path() -> str:
    """PYTHONPATH for an exo process a test starts: this checkout's sources, then what this process has
    (tests/conftest.py puts the folder there that hides torch from test processes)."""
    return os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))


def wait_for(condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def start_all(daemons: Sequence[Daemon], peers: Sequence[str]) -> None:
    for d in daemons:
        d.start(peers)
    for d in daemons:
        d.wait_up()


@contextlib.contextmanager
def serving(daemon: Daemon, timeout: float = 180) -> Iterator[Daemon]:
    """``daemon`` started and up for the block (a module fixture's node), stopped after it."""
    daemon.start().wait_up(timeout)
    try:
        yield daemon
    finally:
        daemon.stop()
