"""mDNS discovery between real network stacks: nodes in separate Linux network namespaces on one bridge,
and (without namespaces) several Discovery objects of one process on this host."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from exo.cluster.discovery import SERVICE_TYPE, Advert, Discovery, DiscoveryError

from .netns import NetnsLab, netns_unavailable, require

_SRC = Path(__file__).resolve().parents[2] / "src"

# One node: runs Discovery, prints one JSON line per event, closes on a "close" line or stdin EOF.
_AGENT = r"""
import asyncio, dataclasses, json, logging, sys
from exo.cluster.discovery import Discovery

def emit(**event):
    print(json.dumps(event), flush=True)

# Discovery's debug line for an advert of another namespace, as an event: an advert resolved and set aside.
class Ignored(logging.Handler):
    def emit(self, record):
        if record.msg.startswith("ignoring %s of namespace"):
            emit(event="ignored", name=record.args[0], namespace=record.args[1])

logging.getLogger("exo.cluster.discovery").setLevel(logging.DEBUG)
logging.getLogger("exo.cluster.discovery").addHandler(Ignored())

async def main(cfg):
    d = Discovery(**cfg, on_found=lambda a: emit(event="found", **dataclasses.asdict(a)),
                  on_lost=lambda node_id: emit(event="lost", node_id=node_id))
    await d.start()
    emit(event="started", service=d.service_name)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await d.close()
    emit(event="closed")

asyncio.run(main(json.loads(sys.argv[1])))
"""


class Agent:
    """A Discovery process inside one namespace; its events arrive on a queue."""

    def __init__(self, lab: NetnsLab, i: int, **cfg: Any) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(_SRC), os.environ.get("PYTHONPATH", "")])}
        self.proc = lab.popen(
            i,
            [sys.executable, "-c", _AGENT, json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.events: list[dict[str, Any]] = []
        self._queue: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._queue.put(json.loads(line))

    def wait_for(self, pred: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any]:
        """The first event (seen before or arriving within ``timeout``) matching ``pred``."""
        for event in self.events:
            if pred(event):
                return event
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                event = self._queue.get(timeout=left)
            except queue.Empty:
                break
            self.events.append(event)
            if pred(event):
                return event
        stderr = self.proc.stderr.read() if self.proc.poll() is not None and self.proc.stderr else ""
        raise AssertionError(f"no matching event within {timeout}s; got {self.events}; stderr: {stderr}")

    def drain(self) -> list[dict[str, Any]]:
        while True:
            try:
                self.events.append(self._queue.get_nowait())
            except queue.Empty:
                return self.events

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            self.proc.stdin.write("close\n")
            self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def _found(node_id: str) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e["event"] == "found" and e["node_id"] == node_id


@pytest.fixture(scope="module")
def lan() -> Any:
    """Four namespaces: a and b in cluster namespace "alpha"; c and d in "beta", sharing one node id (a
    copied home directory). Started together; yields (lab, agents, node ids)."""
    require(netns_unavailable())
    ids = {"a": uuid.uuid4().hex, "b": uuid.uuid4().hex, "c": uuid.uuid4().hex}
    ids["d"] = ids["c"]
    spaces = {"a": "alpha", "b": "alpha", "c": "beta", "d": "beta"}
    with NetnsLab(4) as lab:
        agents = {
            name: Agent(
                lab,
                i,
                node_id=ids[name],
                namespace=spaces[name],
                grpc_port=52416 + i,
                api_port=52415 - i,
                version="0.1.0-test",
                # b runs mDNS on its one address only (a daemon bound to --host); the others on all.
                **({"interfaces": [lab.ips[i]]} if name == "b" else {}),
            )
            for i, name in enumerate("abcd")
        }
        try:
            for agent in agents.values():
                agent.wait_for(lambda e: e["event"] == "started", timeout=15)
            yield lab, agents, ids
        finally:
            for agent in agents.values():
                agent.kill()


def test_same_namespace_nodes_find_each_other(lan: Any) -> None:
    lab, agents, ids = lan
    a_sees_b = agents["a"].wait_for(_found(ids["b"]), timeout=10)
    b_sees_a = agents["b"].wait_for(_found(ids["a"]), timeout=10)
    assert a_sees_b == {
        "event": "found",
        "node_id": ids["b"],
        "host": lab.ips[1],
        "grpc_port": 52417,
        "api_port": 52414,
        "version": "0.1.0-test",
        "namespace": "alpha",
    }
    assert b_sees_a["host"] == lab.ips[0]
    assert (b_sees_a["grpc_port"], b_sees_a["api_port"]) == (52416, 52415)


def test_duplicate_node_ids_still_see_each_other(lan: Any) -> None:
    # c and d advertise the same node id: each must still report the other (self is filtered by service
    # instance name), or the daemons could never detect the duplicate.
    lab, agents, ids = lan
    assert agents["c"].wait_for(_found(ids["c"]), timeout=10)["host"] == lab.ips[3]
    assert agents["d"].wait_for(_found(ids["d"]), timeout=10)["host"] == lab.ips[2]


def test_other_namespace_is_not_reported(lan: Any) -> None:
    _, agents, ids = lan
    # Everyone has found its own partner by now, so the adverts of the other namespace were on the wire
    # for as long; give stragglers one more second.
    for name, partner in (("a", "b"), ("b", "a"), ("c", "d"), ("d", "c")):
        agents[name].wait_for(_found(ids[partner]), timeout=10)
    # The positive control: each has resolved an advert of the other namespace and set it aside (where a
    # report of it would have come from), not merely waited.
    for name, other in (("a", "beta"), ("b", "beta"), ("c", "alpha")):
        agents[name].wait_for(lambda e, other=other: e["event"] == "ignored" and e["namespace"] == other, timeout=30)
    for name, strangers in (("a", {ids["c"]}), ("b", {ids["c"]}), ("c", {ids["a"], ids["b"]})):
        found = {e["node_id"] for e in agents[name].drain() if e["event"] == "found"}
        assert not found & strangers, f"{name} reported nodes of another namespace: {found & strangers}"
        assert all(e["namespace"] == ("beta" if name == "c" else "alpha") for e in agents[name].events
                   if e["event"] == "found")  # fmt: skip


def test_goodbye_reports_lost(lan: Any) -> None:
    _, agents, ids = lan
    agents["a"].wait_for(_found(ids["b"]), timeout=10)
    t0 = time.monotonic()
    agents["b"].close()
    agents["b"].wait_for(lambda e: e["event"] == "closed", timeout=10)
    agents["a"].wait_for(lambda e: e["event"] == "lost" and e["node_id"] == ids["b"], timeout=5)
    # The goodbye, not a record expiry (minutes), removed it.
    assert time.monotonic() - t0 < 5
    assert agents["b"].proc.wait(timeout=10) == 0
    # Nothing else was lost on the way.
    assert [e for e in agents["c"].drain() if e["event"] == "lost"] == []


def _host_has_multicast_interface() -> bool:
    """An interface other than loopback that is up and multicast-capable (mDNS has a path)."""
    for dev in Path("/sys/class/net").glob("*"):
        try:
            flags = int((dev / "flags").read_text(), 16)
        except (OSError, ValueError):
            continue
        if dev.name != "lo" and flags & 0x1 and flags & 0x1000:  # IFF_UP, IFF_MULTICAST
            return True
    return False


async def _wait(pred: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        await asyncio.sleep(0.05)


def test_in_process_discovery_and_id_change() -> None:
    """Two Discovery objects of one process (two daemons on one host): they find each other, a node id
    change is seen as found(new) + lost(old), and close() is idempotent."""
    require(None if Path("/sys/class/net").is_dir() and _host_has_multicast_interface()
            else "no non-loopback multicast interface up on this host: mDNS has no path")

    async def scenario() -> None:
        events: dict[str, list[tuple[str, Any]]] = {"x": [], "y": []}

        def make(tag: str, node_id: str) -> Discovery:
            return Discovery(
                node_id=node_id,
                namespace=f"test-{os.getpid()}",  # no other run on this host can join
                grpc_port=60000 if tag == "x" else 60001,
                api_port=61000,
                version="t",
                on_found=lambda a: events[tag].append(("found", a)),
                on_lost=lambda n: events[tag].append(("lost", n)),
            )

        x_id, y_id, y_new = uuid.uuid4().hex, uuid.uuid4().hex, uuid.uuid4().hex
        x, y = make("x", x_id), make("y", y_id)
        await asyncio.gather(x.start(), y.start())
        try:
            assert x.service_name and x.service_name.endswith("." + SERVICE_TYPE)
            assert x.service_name != y.service_name
            await _wait(lambda: any(k == "found" and v.node_id == y_id for k, v in events["x"]), 10)
            await _wait(lambda: any(k == "found" and v.node_id == x_id for k, v in events["y"]), 10)
            seen: Advert = next(v for k, v in events["x"] if k == "found")
            assert (seen.grpc_port, seen.api_port, seen.version) == (60001, 61000, "t")
            assert [a.node_id for a in x.peers()] == [y_id]

            await y.update_node_id(y_new)
            await _wait(lambda: ("lost", y_id) in events["x"], 10)
            assert any(k == "found" and v.node_id == y_new for k, v in events["x"])
            assert [a.node_id for a in x.peers()] == [y_new]
            assert all(v != x_id for k, v in events["x"] if k == "lost")
        finally:
            await asyncio.gather(x.close(), y.close())
            await x.close()  # idempotent

    asyncio.run(asyncio.wait_for(scenario(), timeout=25))


def test_start_failure_is_a_clear_error() -> None:
    async def scenario() -> None:
        d = Discovery(
            node_id=uuid.uuid4().hex,
            namespace="x",
            grpc_port=1,
            api_port=2,
            version="t",
            on_found=lambda a: None,
            on_lost=lambda n: None,
            interfaces=["203.0.113.7"],  # TEST-NET-3: not an address of this host
        )
        with pytest.raises(DiscoveryError, match="mDNS discovery failed to start"):
            await d.start()
        await d.close()
        with pytest.raises(DiscoveryError, match="after close"):
            await d.start()

    asyncio.run(scenario())
