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
call, as before.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any

from exo.engine.request import GenerationChunk


class Outbox:
    """The items of one stream, in order: ``put`` on the device thread, ``take`` on the call's thread."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = max(0.0, interval_s)
        self._items: collections.deque[Any] = collections.deque()
        self._cv = threading.Condition(threading.Lock())
        self._due = 0.0  # time.monotonic() from which a token wakes the call (0: at once)
        self._urgent = False  # an item that goes at once is in the box
        self.wakes = 0  # the call's thread woken by a put (tests and benchmarks read it)

    def put(self, item: Any) -> None:
        """Any thread (the device's): ``item`` into the box; the call is woken if it must go now."""
        token = isinstance(item, GenerationChunk) and item.finish_reason is None
        with self._cv:
            self._items.append(item)
            if not token:
                self._urgent = True
            elif self._due and time.monotonic() < self._due:
                return  # a token inside the interval: the call takes it when the interval is up
            self.wakes += 1
            self._cv.notify()

    def take(self, timeout: float) -> list[Any]:
        """The call's thread: everything in the box once it may go (an item that goes at once, or tokens once
        the interval since the last take of tokens is up); [] when nothing came for ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                now = time.monotonic()
                if self._items and (self._urgent or now >= self._due):
                    break
                # Tokens in the box: up at the interval's end. None: up at the deadline (a heartbeat's).
                until = self._due if self._items else deadline
                if not self._items and now >= deadline:
                    return []
                self._cv.wait(max(0.0, until - now))
            items = list(self._items)
            self._items.clear()
            self._urgent = False
            if self.interval_s and any(isinstance(i, GenerationChunk) for i in items):
                self._due = time.monotonic() + self.interval_s
            return items
