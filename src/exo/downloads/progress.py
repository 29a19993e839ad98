"""Progress of one download, readable at any time as a ``DownloadProgress`` snapshot.

huggingface_hub reports bytes through the ``tqdm_class`` it is given: one bar per file, ``update(n)`` per
chunk written (``update_transfer(n)`` for bytes received, which exo does not count twice). ``bar_class``
hands it a class that mimics the few tqdm methods the library calls (the same way its own
``snapshot_download`` aggregates per-file bars) and forwards the bytes here. Cancellation rides on the
same path: once ``cancel()`` is called, the next chunk raises ``DownloadCancelledError`` inside the
library, which deletes its partial file.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from .errors import DownloadCancelledError

Status = Literal[
    "queued", "planning", "downloading", "recovering_head", "validating", "complete", "failed", "cancelled"
]
FINAL_STATUSES = ("complete", "failed", "cancelled")
SPEED_WINDOW_S = 5.0
_SAMPLE_EVERY_S = 0.2


@dataclass(frozen=True)
class DownloadProgress:
    """Bytes and files still to fetch in this download (files already in the cache are not counted)."""

    status: Status
    bytes_done: int
    bytes_total: int
    files_done: int
    files_total: int
    speed_bytes_per_s: float
    eta_s: float | None
    elapsed_s: float
    current_files: tuple[str, ...] = ()

    @property
    def fraction(self) -> float:
        return self.bytes_done / self.bytes_total if self.bytes_total else float(self.status == "complete")

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["current_files"] = list(self.current_files)
        out["speed_bytes_per_s"] = round(self.speed_bytes_per_s, 1)
        out["eta_s"] = None if self.eta_s is None else round(self.eta_s, 1)
        out["elapsed_s"] = round(self.elapsed_s, 3)
        return out


Listener = Callable[[DownloadProgress], None]


class ProgressTracker:
    """Thread-safe counters for one download job (every phase adds its files to the totals)."""

    def __init__(self, listener: Listener | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._listener = listener
        self._cancel = threading.Event()
        self._status: Status = "queued"
        self._started = clock()
        self._finished: float | None = None
        self._bytes_total = 0
        self._files_total = 0
        self._files_done = 0
        self._done_bytes = 0  # bytes of finished files
        self._active: dict[str, int] = {}  # file -> bytes so far
        self._samples: deque[tuple[float, int]] = deque()

    # -- control -------------------------------------------------------------------------------------
    def cancel(self) -> None:
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def cancel_event(self) -> threading.Event:
        return self._cancel

    def check_cancelled(self) -> None:
        if self._cancel.is_set():
            raise DownloadCancelledError("the download was cancelled")

    @property
    def status(self) -> Status:
        return self._status

    def set_status(self, status: Status) -> None:
        with self._lock:
            self._status = status
            if status in FINAL_STATUSES and self._finished is None:
                self._finished = self._clock()
        self._notify()

    # -- work ----------------------------------------------------------------------------------------
    def add_work(self, files: int, total_bytes: int) -> None:
        with self._lock:
            self._files_total += files
            self._bytes_total += total_bytes
            if not self._samples:  # speed counts from when there is something to fetch
                self._samples.append((self._clock(), self._done_bytes))
        self._notify()

    def advance(self, name: str, n: int, stop: threading.Event | None = None) -> None:
        self.check_cancelled()
        if stop is not None and stop.is_set():
            raise DownloadCancelledError("stopped: another file of this download failed")
        with self._lock:
            self._active[name] = max(0, self._active.get(name, 0) + n)
            self._sample()
        self._notify()

    def file_done(self, name: str, size: int) -> None:
        with self._lock:
            self._active.pop(name, None)
            self._done_bytes += size
            self._files_done += 1
            self._sample()
        self._notify()

    def file_abandoned(self, name: str) -> None:
        """A file that stopped part-way: its bytes are gone (the library deletes the partial file)."""
        with self._lock:
            self._active.pop(name, None)
        self._notify()

    def bar_class(self, name: str, stop: threading.Event | None = None) -> type[HubProgressBar]:
        """A ``tqdm_class`` for ``hf_hub_download`` of file ``name``, reporting to this tracker (and
        stopping the file when ``stop`` is set)."""
        return type("HubProgressBarFor", (HubProgressBar,), {"tracker": self, "file_name": name, "stop": stop})

    # -- reading -------------------------------------------------------------------------------------
    def snapshot(self) -> DownloadProgress:
        with self._lock:
            now = self._finished if self._finished is not None else self._clock()
            done = self._done_bytes + sum(self._active.values())
            speed = self._speed(now, done)
            remaining = max(0, self._bytes_total - done)
            eta = remaining / speed if speed > 0 and self._status not in FINAL_STATUSES else None
            if self._status == "complete":
                eta = 0.0
            return DownloadProgress(
                status=self._status,
                bytes_done=min(done, self._bytes_total) if self._bytes_total else done,
                bytes_total=self._bytes_total,
                files_done=self._files_done,
                files_total=self._files_total,
                speed_bytes_per_s=speed,
                eta_s=eta,
                elapsed_s=now - self._started,
                current_files=tuple(sorted(self._active)),
            )

    def _sample(self) -> None:
        now = self._clock()
        done = self._done_bytes + sum(self._active.values())
        if len(self._samples) > 1 and now - self._samples[-2][0] < _SAMPLE_EVERY_S:
            self._samples[-1] = (now, done)  # one sample per interval; the first one stays the reference
        else:
            self._samples.append((now, done))
        while len(self._samples) > 2 and self._samples[1][0] < now - SPEED_WINDOW_S:
            self._samples.popleft()

    def _speed(self, now: float, done: int) -> float:
        """Bytes per second since the oldest sample kept (about the last SPEED_WINDOW_S seconds)."""
        if not self._samples:
            return 0.0
        t0, d0 = self._samples[0]
        return max(0.0, (done - d0) / (now - t0)) if now > t0 else 0.0

    def _notify(self) -> None:
        if self._listener is not None:
            self._listener(self.snapshot())


class HubProgressBar:
    """What huggingface_hub calls on a ``tqdm_class`` (see ``_AggregatedTqdm`` in its snapshot_download):
    bytes go to the tracker, display calls do nothing."""

    tracker: ProgressTracker
    file_name: str
    stop: threading.Event | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.total = kwargs.get("total")
        self.n = int(kwargs.get("initial") or 0)
        if self.n:
            self.tracker.advance(self.file_name, self.n, self.stop)
        else:  # a file that has not started does not start once cancelled
            self.tracker.check_cancelled()

    def __enter__(self) -> HubProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def update(self, n: int | float | None = 1) -> None:
        step = int(n or 0)
        self.n += step
        self.tracker.advance(self.file_name, step, self.stop)

    def update_transfer(self, n: int | float | None = 1) -> None:
        pass  # network bytes of the same chunks (or xet transfer bytes): counted once, via update

    @property
    def format_dict(self) -> dict[str, Any]:
        return {"rate": None}

    def close(self) -> None:
        pass

    def refresh(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_transfer_postfix_str(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_description(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_description_str(self, *args: Any, **kwargs: Any) -> None:
        pass


class SilentBar(HubProgressBar):
    """For calls whose bytes exo does not count (metadata files, the final snapshot bookkeeping)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.total = kwargs.get("total")
        self.n = 0

    def update(self, n: int | float | None = 1) -> None:
        self.n += int(n or 0)
