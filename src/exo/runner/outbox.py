"""What a generation emits on the device thread, to the thread of its Generate call (``runner.service``), paced.

Every wake-up of a call's thread costs the device thread: the woken thread takes Python's GIL at the device
thread's next release (its step's evaluation) and the device thread waits to get it back, and a gRPC send wakes
two threads more (the call's, gRPC's poller). Woken for every token, one client through ``exo serve`` lost 7-9%
of the engine's decode on a 2-core CPU in one process, against 2% for a consumer woken every 50 ms
(docs/performance.md, "The code's reasons"). So the device thread wakes the call only:

- for an item that must go at once: a generation's first token (its time to first token), its last chunk
  (whatever ended it: finish, ``Failed``, the end of the stream), and anything that is not a token;
- for a token when ``interval_s`` has passed since the call last took tokens.

A token that arrives sooner waits in the box (the call's thread takes it, with every token since, when the
interval is up: ``take`` waits until then): a stream's messages come at most every ``interval_s`` while its
tokens flow, each with every token since the last (``service.coalesced`` joins them). 0: every token wakes the
call, as before. ``Pacing`` is the rule, apart from how the taker waits: the in-process service's channel
(``api.local.Channel``, an event loop's) follows it too.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from exo.engine.request import GenerationChunk


class Pacing:
    """When a stream's items may go, for whoever holds them (``Outbox`` here, ``api.local.Channel`` for the
    in-process service): its owner calls every method under its own lock."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = max(0.0, interval_s)
        self.due = 0.0  # time.monotonic() from which a token wakes the taker (0: at once)
        self.urgent = False  # an item that goes at once is held

    def wakes(self, item: Any) -> bool:
        """``item`` was just added: whether the taker must be woken for it (a token inside the interval: not)."""
        if not (isinstance(item, GenerationChunk) and item.finish_reason is None):
            self.urgent = True
            return True
        return not self.due or time.monotonic() >= self.due

    def ready(self, held: bool) -> bool:
        """Whether what is held (``held``: anything) may go now."""
        return held and (self.urgent or time.monotonic() >= self.due)

    def until(self, held: bool, deadline: float) -> float:
        """Where the taker waits until when nothing may go yet (time.monotonic()): the interval's end when tokens
        are held, else ``deadline``."""
        return self.due if held else deadline

    def taken(self, items: list[Any]) -> None:
        """``items`` went: the next interval starts where they carried tokens."""
        self.urgent = False
        if self.interval_s and any(isinstance(i, GenerationChunk) for i in items):
            self.due = time.monotonic() + self.interval_s


class Outbox:
    """The items of one stream, in order: ``put`` on the device thread, ``take`` on the call's thread."""

    def __init__(self, interval_s: float) -> None:
        self.pacing = Pacing(interval_s)
        self._items: collections.deque[Any] = collections.deque()
        self._cv = threading.Condition(threading.Lock())
        self.wakes = 0  # the call's thread woken by a put (tests and benchmarks read it)

    def put(self, item: Any) -> None:
        """Any thread (the device's): ``item`` into the box; the call is woken if it must go now."""
        with self._cv:
            self._items.append(item)
            if self.pacing.wakes(item):
                self.wakes += 1
                self._cv.notify()

    def take(self, timeout: float) -> list[Any]:
        """The call's thread: everything in the box once it may go (an item that goes at once, or tokens once
        the interval since the last take of tokens is up); [] when nothing came for ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while not self.pacing.ready(bool(self._items)):
                now = time.monotonic()
                if not self._items and now >= deadline:
                    return []
                self._cv.wait(max(0.0, self.pacing.until(bool(self._items), deadline) - now))
            items = list(self._items)
            self._items.clear()
            self.pacing.taken(items)
            return items
