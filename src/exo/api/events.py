"""A node's state as one stream of server-sent events (``GET /v1/events``), for the dashboard.

The state is a set of named sections (the cluster's nodes, links, instances, the settings, the models),
each read from the node by a callable. On connect a client gets ``retry:`` and one ``snapshot`` event
holding every section; after that only what changed:

    snapshot            {"cluster": {...}, "nodes": [...], "links": [...], "instances": [...],
                         "settings": {...}, "models": [...]}
    <item>.added        a new item of a keyed section (node.added, instance.added): the item
    <item>.updated      an item that changed: the whole new item
    <item>.removed      {"id": ...}
    <section>           a whole unkeyed section that changed (cluster, links, settings, models)

plus an SSE comment (``: heartbeat``) every ``heartbeat_s`` so a client can tell a dead connection from
a quiet cluster. Every client gets a fresh snapshot when it (re)connects, so nothing is replayed.

Changes are pushed: anything that knows the state changed calls ``notify()`` (settings PUT, instance
create/delete, peers joining or leaving, an instance's state transition), and the hub recomputes at
once. Changes nobody announces (load progress, memory, a peer's instances) are found by recomputing
every ``interval_s`` while at least one client listens; nothing runs while nobody does. Readings that
move all the time (last-seen ages, round-trip times, memory to the byte) do not count as changes on
their own: the next real change carries their current values.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

log = logging.getLogger(__name__)

State = dict[str, Any]


@dataclass(frozen=True)
class Section:
    """One part of the state: ``read`` returns it (a list of items with ``id`` when ``item`` is set,
    else any JSON value). ``every_s``: how often it is re-read when nobody announced a change;
    ``blocking``: read it in a thread (it touches the disk). ``noise``: an item's fields that change
    all the time and are ignored when deciding whether it changed (a number: the step below which a
    change does not count; None: never counts)."""

    name: str
    read: Callable[[], Any]
    item: str | None = None
    every_s: float | None = None
    blocking: bool = False
    noise: Mapping[str, float | None] | None = None


@dataclass(frozen=True)
class Event:
    type: str
    data: Any


def _signature(value: Any, noise: Mapping[str, float | None] | None) -> Any:
    if not noise or not isinstance(value, dict):
        return value
    out = {}
    for key, field_value in value.items():
        if key not in noise:
            out[key] = field_value
        elif (step := noise[key]) is not None and isinstance(field_value, int | float):
            out[key] = round(field_value / step)
    return out


def diff_section(section: Section, old: Any, new: Any) -> list[Event]:
    """What a client holding ``old`` needs to hold ``new`` (only changes that count)."""
    if section.item is None:
        if _signature(old, section.noise) == _signature(new, section.noise):
            return []
        return [Event(section.name, new)]
    old_items = {item["id"]: item for item in old or []}
    new_items = {item["id"]: item for item in new or []}
    events = []
    for item_id, item in new_items.items():
        before = old_items.get(item_id)
        if before is None:
            events.append(Event(f"{section.item}.added", item))
        elif _signature(before, section.noise) != _signature(item, section.noise):
            events.append(Event(f"{section.item}.updated", item))
    events.extend(Event(f"{section.item}.removed", {"id": i}) for i in old_items if i not in new_items)
    return events


def encode(event: Event, event_id: int | None = None) -> bytes:
    """One SSE message (JSON data on one line)."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    data = json.dumps(event.data, separators=(",", ":"), ensure_ascii=False)
    return f"{head}event: {event.type}\ndata: {data}\n\n".encode()


class Subscription:
    """One client's queue of events; ``closed`` when the hub ends it (shutdown, or the client fell too far
    behind: it reconnects and gets a fresh snapshot)."""

    def __init__(self, snapshot: State, max_queue: int) -> None:
        self.snapshot = snapshot
        self.max_queue = max_queue
        self.closed = False
        self._queue: list[bytes] = []
        self._ready = asyncio.Event()

    def put(self, message: bytes) -> None:
        if self.closed:
            return
        if len(self._queue) >= self.max_queue:
            log.warning("an event stream client fell %d events behind; it will reconnect", self.max_queue)
            self.close()
            return
        self._queue.append(message)
        self._ready.set()

    def close(self) -> None:
        self.closed = True
        self._ready.set()

    async def next(self, timeout: float) -> bytes | None:
        """The messages queued since the last call, joined (waits at most ``timeout``: TimeoutError);
        None once closed."""
        if not self._queue and not self.closed:
            await asyncio.wait_for(self._ready.wait(), timeout)
        self._ready.clear()
        if self.closed:
            return None
        messages, self._queue = self._queue, []
        return b"".join(messages)


class EventHub:
    """The state's sections, the clients listening and the task that looks for changes while they do."""

    def __init__(
        self,
        sections: Iterable[Section],
        *,
        interval_s: float = 1.0,
        heartbeat_s: float = 15.0,
        retry_ms: int = 1000,
        max_queue: int = 1000,
    ) -> None:
        self.sections = {s.name: s for s in sections}
        self.interval_s = interval_s
        self.heartbeat_s = heartbeat_s
        self.retry_ms = retry_ms
        self.max_queue = max_queue
        self._state: State = {}
        self._read_at: dict[str, float] = {}
        self._subscribers: set[Subscription] = set()
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._closed = False

    # -- telling the hub something changed ----------------------------------------------------------------
    def notify(self) -> None:
        """Recompute now (callable from any thread; cheap when nobody listens)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if threading.get_ident() == self._loop_thread:
            self._wake.set()
        else:
            loop.call_soon_threadsafe(self._wake.set)

    # -- clients ------------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def subscribe(self) -> AsyncIterator[Subscription]:
        """A subscription whose ``snapshot`` is current and whose queue holds every change after it."""
        self._loop, self._loop_thread = asyncio.get_running_loop(), threading.get_ident()
        async with self._lock:
            await self._refresh(force=True)
            subscription = Subscription(dict(self._state), self.max_queue)
            if self._closed:
                subscription.close()
            self._subscribers.add(subscription)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._watch(), name="exo-events")
        try:
            yield subscription
        finally:
            self._subscribers.discard(subscription)

    def opening(self, subscription: Subscription) -> bytes:
        """What a stream starts with: the reconnection delay, then the snapshot."""
        return f"retry: {self.retry_ms}\n\n".encode() + encode(Event("snapshot", subscription.snapshot), next(self._ids))

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    async def close(self) -> None:
        """End every stream (app shutdown: open streams would otherwise hold it up)."""
        self._closed = True
        for subscription in list(self._subscribers):
            subscription.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # -- finding changes ----------------------------------------------------------------------------------
    async def _watch(self) -> None:
        while self._subscribers and not self._closed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            # Read the flag, not how the wait ended: a notify() landing between the timeout and this
            # task's resumption would otherwise be cleared unseen (a lost wake-up, seen on a loaded CPU).
            force = self._wake.is_set()
            self._wake.clear()
            try:
                async with self._lock:
                    await self._refresh(force=force)
            except Exception:  # noqa: BLE001 - one failed read must not end every client's stream
                log.exception("reading the node's state for /v1/events failed")

    async def _refresh(self, *, force: bool) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        events: list[Event] = []
        for section in self.sections.values():
            due = section.every_s is None or now - self._read_at.get(section.name, -1e9) >= section.every_s
            if section.name in self._state and not (force or due):
                continue
            value = await asyncio.to_thread(section.read) if section.blocking else section.read()
            self._read_at[section.name] = now
            if section.name in self._state:
                events.extend(diff_section(section, self._state[section.name], value))
            self._state[section.name] = value
        if events and self._subscribers:
            message = b"".join(encode(event, next(self._ids)) for event in events)
            for subscription in list(self._subscribers):
                subscription.put(message)


async def stream_events(request: web.Request, hub: EventHub) -> web.StreamResponse:
    """The handler's body: a snapshot, then changes and heartbeats until the client or the hub ends it."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    async with hub.subscribe() as subscription:
        await response.prepare(request)
        try:
            await response.write(hub.opening(subscription))
            while True:
                try:
                    message = await subscription.next(hub.heartbeat_s)
                except TimeoutError:
                    message = b": heartbeat\n\n"
                if message is None:
                    break
                await response.write(message)
            await response.write_eof()
        except ConnectionError:  # the client went away between our writes
            pass
    return response
