"""``/v1/events``: the dashboard's event stream (``exo.api.events``), served by a real aiohttp server.

The state comes from plain callables (what a node would read); the stream is read over HTTP as a browser
would: the snapshot first, then only changes, pushed at ``notify()`` or found by the interval, heartbeats
when quiet, and every stream ended by the hub's close.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from exo.api.events import Event, EventHub, Section, diff_section, encode, stream_events

NOISE = {"rtt_ms": None, "memory_available_bytes": 64.0}
NODES = Section("nodes", lambda: [], item="node", noise=NOISE)


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ([], [{"id": "a"}], [("node.added", {"id": "a"})]),
        ([{"id": "a"}], [], [("node.removed", {"id": "a"})]),
        ([{"id": "a", "name": "x"}], [{"id": "a", "name": "y"}], [("node.updated", {"id": "a", "name": "y"})]),
        # Noise alone is no change: a new round-trip time, memory within the same 64-byte step.
        ([{"id": "a", "rtt_ms": 1.0, "memory_available_bytes": 130}],
         [{"id": "a", "rtt_ms": 9.0, "memory_available_bytes": 150}], []),
        # Memory that moved a step is a change, and the event carries every current value.
        ([{"id": "a", "rtt_ms": 1.0, "memory_available_bytes": 130}],
         [{"id": "a", "rtt_ms": 9.0, "memory_available_bytes": 300}],
         [("node.updated", {"id": "a", "rtt_ms": 9.0, "memory_available_bytes": 300})]),
        ([{"id": "a"}, {"id": "b"}], [{"id": "b"}, {"id": "c"}], [("node.added", {"id": "c"}), ("node.removed", {"id": "a"})]),
    ],
)
def test_keyed_sections_send_added_updated_removed(old, new, expected):
    assert [(e.type, e.data) for e in diff_section(NODES, old, new)] == expected


def test_unkeyed_sections_are_sent_whole_when_they_change():
    settings = Section("settings", dict)
    assert diff_section(settings, {"native_mtp_enabled": True}, {"native_mtp_enabled": True}) == []
    assert diff_section(settings, {"native_mtp_enabled": True}, {"native_mtp_enabled": False}) == [
        Event("settings", {"native_mtp_enabled": False})
    ]


def test_encoding_is_one_sse_message_with_json_on_one_line():
    assert encode(Event("node.added", {"name": "mäc\nmini"}), 7) == (
        'id: 7\nevent: node.added\ndata: {"name":"mäc\\nmini"}\n\n'.encode()
    )


# -- the hub behind a real HTTP server ------------------------------------------------------------------


class Source:
    """What a node would report; tests change it and count the reads."""

    def __init__(self) -> None:
        self.nodes = [{"id": "a", "name": "mac-a", "rtt_ms": 0.0}]
        self.settings = {"native_mtp_enabled": True}
        self.catalog = ["exo-demo"]
        self.catalog_reads = 0

    def models(self) -> list[str]:
        self.catalog_reads += 1
        return list(self.catalog)

    def sections(self) -> list[Section]:
        return [
            Section("nodes", lambda: [dict(n) for n in self.nodes], item="node", noise={"rtt_ms": None}),
            Section("settings", lambda: dict(self.settings)),
            Section("models", self.models, every_s=3600.0, blocking=True),
        ]


class Stream:
    """One client of /v1/events, reading messages as they come."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response
        self.buffer = b""

    async def message(self, timeout: float = 5.0) -> dict[str, Any]:
        """The next SSE message as its fields (``comment`` for a comment line), data parsed."""
        async with asyncio.timeout(timeout):
            while b"\n\n" not in self.buffer:
                chunk = await self.response.content.readany()
                if not chunk:
                    return {"eof": True}
                self.buffer += chunk
        raw, self.buffer = self.buffer.split(b"\n\n", 1)
        fields: dict[str, Any] = {}
        for line in raw.decode().split("\n"):
            if line.startswith(":"):
                fields["comment"] = line[1:].strip()
            else:
                name, _, value = line.partition(": ")
                fields[name] = json.loads(value) if name == "data" else value
        return fields

    async def event(self, timeout: float = 5.0) -> dict[str, Any]:
        """The next message that is an event (skips heartbeats)."""
        while True:
            message = await self.message(timeout)
            if "event" in message or "eof" in message:
                return message


@asynccontextmanager
async def serving(hub: EventHub) -> AsyncIterator[tuple[str, aiohttp.ClientSession]]:
    app = web.Application()

    async def events(request: web.Request) -> web.StreamResponse:
        return await stream_events(request, hub)

    app.router.add_get("/v1/events", events)
    app.on_shutdown.append(lambda _app: hub.close())
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession() as client:
            yield f"http://127.0.0.1:{port}/v1/events", client
    finally:
        await runner.cleanup()


async def eventually(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def run(test: Callable[[], Any]) -> None:
    asyncio.run(asyncio.wait_for(test(), 30))


def test_snapshot_first_then_pushed_changes_only():
    source = Source()
    hub = EventHub(source.sections(), interval_s=3600.0, heartbeat_s=3600.0, retry_ms=1500)

    async def scenario() -> None:
        async with serving(hub) as (url, client), client.get(url) as response:
            assert response.headers["Content-Type"] == "text/event-stream"
            stream = Stream(response)
            assert await stream.message() == {"retry": "1500"}
            snapshot = await stream.event()
            assert snapshot["event"] == "snapshot"
            assert snapshot["data"] == {"nodes": source.nodes, "settings": {"native_mtp_enabled": True},
                                        "models": ["exo-demo"]}
            # The interval is an hour: what arrives now was pushed by notify().
            source.settings["native_mtp_enabled"] = False
            source.nodes.append({"id": "b", "name": "mac-b", "rtt_ms": 3.0})
            hub.notify()
            got = [await stream.event(), await stream.event()]
            assert [(e["event"], e["data"]) for e in got] == [
                ("node.added", {"id": "b", "name": "mac-b", "rtt_ms": 3.0}),
                ("settings", {"native_mtp_enabled": False}),
            ]
            assert int(got[1]["id"]) > int(got[0]["id"]) > int(snapshot["id"])
            # Noise alone sends nothing; the next real change does.
            source.nodes[0]["rtt_ms"] = 42.0
            hub.notify()
            source.nodes.pop(1)
            await asyncio.sleep(0.1)
            hub.notify()
            assert (await stream.event())["event"] == "node.removed"

    run(scenario)


def test_unannounced_changes_are_found_by_the_interval_and_slow_sections_wait_their_turn():
    source = Source()
    hub = EventHub(source.sections(), interval_s=0.05, heartbeat_s=3600.0)

    async def scenario() -> None:
        async with serving(hub) as (url, client), client.get(url) as response:
            stream = Stream(response)
            await stream.event()
            reads = source.catalog_reads
            source.nodes[0]["name"] = "renamed"  # nobody calls notify(): the interval finds it
            event = await stream.event(timeout=10.0)
            assert (event["event"], event["data"]["name"]) == ("node.updated", "renamed")
            await asyncio.sleep(0.3)  # several intervals
            assert source.catalog_reads == reads  # the catalog is read hourly unless announced
            source.catalog.append("qwen3.5-27b-4bit")
            hub.notify()
            event = await stream.event()
            assert (event["event"], event["data"]) == ("models", ["exo-demo", "qwen3.5-27b-4bit"])

    run(scenario)


def test_a_notify_landing_as_the_interval_times_out_is_not_lost(monkeypatch):
    """A notify() between the interval's timeout and the watcher's resumption (a loaded CPU widens that
    window) still forces a full read: the catalog, read only when announced, must come."""
    source = Source()
    hub = EventHub(source.sections(), interval_s=0.05, heartbeat_s=3600.0)
    real_wait_for = asyncio.wait_for
    raced = []

    async def wait_for_racing_notify(awaitable, timeout):
        watcher = getattr(awaitable, "cr_frame", None) is not None and awaitable.cr_frame.f_locals.get("self") is hub._wake
        if watcher and not raced and source.catalog[-1] != "exo-demo":  # changed, not yet announced
            awaitable.close()
            raced.append(True)
            hub.notify()  # lands after the timeout fired, before the watcher looks
            raise TimeoutError
        return await real_wait_for(awaitable, timeout)

    async def scenario() -> None:
        async with serving(hub) as (url, client), client.get(url) as response:
            stream = Stream(response)
            await stream.event()
            monkeypatch.setattr("exo.api.events.asyncio.wait_for", wait_for_racing_notify)
            source.catalog.append("qwen3.5-27b-4bit")
            event = await stream.event(timeout=3.0)
            assert raced and (event["event"], event["data"]) == ("models", ["exo-demo", "qwen3.5-27b-4bit"])

    run(scenario)


def test_heartbeats_while_quiet_and_nothing_runs_without_clients():
    source = Source()
    hub = EventHub(source.sections(), interval_s=0.02, heartbeat_s=0.1)

    async def scenario() -> None:
        async with serving(hub) as (url, client):
            async with client.get(url) as response:
                stream = Stream(response)
                await stream.event()
                assert await stream.message(timeout=2.0) == {"comment": "heartbeat"}
                assert hub.subscribers == 1
            await eventually(lambda: hub.subscribers == 0)
            await eventually(lambda: hub._task is not None and hub._task.done())  # stopped with its last client

    run(scenario)


def test_every_client_gets_the_same_changes_and_close_ends_all_streams():
    source = Source()
    hub = EventHub(source.sections(), interval_s=3600.0, heartbeat_s=3600.0)

    async def scenario() -> None:
        async with serving(hub) as (url, client):
            async with client.get(url) as first, client.get(url) as second:
                streams = [Stream(first), Stream(second)]
                for stream in streams:
                    await stream.event()
                source.settings["native_mtp_enabled"] = False
                hub.notify()
                for stream in streams:
                    assert (await stream.event())["data"] == {"native_mtp_enabled": False}
                started = time.monotonic()
                await hub.close()  # what the app's shutdown does
                for stream in streams:
                    assert await stream.event() == {"eof": True}
                assert time.monotonic() - started < 5.0  # at once, not whenever the clients give up

    run(scenario)


def test_a_client_too_far_behind_is_dropped_and_gets_a_snapshot_when_it_reconnects():
    source = Source()
    hub = EventHub(source.sections(), interval_s=3600.0, heartbeat_s=3600.0, max_queue=3)

    async def scenario() -> None:
        async with serving(hub) as (url, client):
            async with hub.subscribe() as subscription:  # a client that never reads
                for i in range(5):
                    source.settings["native_mtp_enabled"] = i % 2 == 0
                    async with hub._lock:
                        await hub._refresh(force=True)
                assert subscription.closed
                assert await subscription.next(1.0) is None
            async with client.get(url) as response:
                snapshot = await Stream(response).event()
                assert snapshot["data"]["settings"] == {"native_mtp_enabled": True}

    run(scenario)


def test_a_failing_section_does_not_end_the_streams():
    source = Source()
    broken = {"now": False}

    def nodes() -> list[dict[str, Any]]:
        if broken["now"]:
            raise RuntimeError("registry in a bad state")
        return [dict(n) for n in source.nodes]

    hub = EventHub([Section("nodes", nodes, item="node"), Section("settings", lambda: dict(source.settings))],
                   interval_s=0.02, heartbeat_s=3600.0)

    async def scenario() -> None:
        async with serving(hub) as (url, client), client.get(url) as response:
            stream = Stream(response)
            await stream.event()
            broken["now"] = True
            await asyncio.sleep(0.1)
            broken["now"] = False
            source.nodes[0]["name"] = "back"
            assert (await stream.event())["data"]["name"] == "back"

    run(scenario)
