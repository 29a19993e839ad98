"""Where the device thread's time goes, step by step of a batch (``EXO_DEVICE_TRACE``): for benchmarks."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any


class DeviceTrace:
    """Where the device thread's time goes, step by step (``EXO_DEVICE_TRACE=DIR``: off unless set): one JSON line
    per step of a batch in ``DIR/device-<pid>.jsonl`` with its start (``time.monotonic()``, comparable across
    processes), the seconds of each phase (``room``: MLX's cache handed back where it grew past half its bound,
    ``memory.keep_cache_room``, with the bytes in ``handed_back``; ``plan``: the scheduler and tokenizing the queue's head; ``prefill``:
    beginning the admitted, their chunks and first tokens; ``step``: the members' decode step; ``emit``: their
    tokens to their streams) and what it carried. For benchmarks (bench/serving.py reads it back).

    ``EXO_DEVICE_PROFILE=DIR`` (apart from the trace; it slows the thread it measures): the device thread's
    steps under cProfile, one ``DIR/profile-<pid>-<second>-<n>.pstats`` per second of ``time.monotonic()`` in which
    steps ran (and one when a batch ends), so a benchmark sums the seconds of its window (``bench/common.py`` ``device_profile``).

    With the trace on, a watcher thread samples the device thread's Python stack once in a step that has run for
    ``STALL_SECONDS``: the line of that step carries it (``stall_stack``, innermost frame last), so a benchmark
    that sees a stall says where the thread was in it."""

    STALL_SECONDS = 1.0

    def __init__(self, path: str | None, profile: str | None = None) -> None:
        self._file = open(path, "a", buffering=1 << 16) if path else None  # noqa: SIM115 - open for the process
        self._flushed = time.monotonic()
        self._profile_dir = profile
        self._profile: Any = None  # cProfile.Profile of the current second
        self._second = 0
        self._dumps = 0
        self._step: tuple[int, float, dict[str, Any]] | None = None  # the step under way: thread, start, line
        self._watcher: threading.Thread | None = None

    @classmethod
    def from_env(cls) -> DeviceTrace:
        folder = os.environ.get("EXO_DEVICE_TRACE")
        profile = os.environ.get("EXO_DEVICE_PROFILE") or None
        if profile:
            os.makedirs(profile, exist_ok=True)
        if not folder:
            return cls(None, profile)
        os.makedirs(folder, exist_ok=True)
        return cls(os.path.join(folder, f"device-{os.getpid()}.jsonl"), profile)

    def step(self) -> Callable[..., None]:
        """A new step: returns ``lap(phase, **fields)``, which closes the phase (the last, "emit", writes the line)."""
        if self._file is None and self._profile_dir is None:
            return _no_lap
        start = last = time.monotonic()
        line: dict[str, Any] = {"t": start}
        profile = self._profiler(start)
        if self._file is not None:
            self._step = (threading.get_ident(), start, line)
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch, name="exo-device-trace", daemon=True)
                self._watcher.start()

        def lap(phase: str, **fields: Any) -> None:
            nonlocal last
            now = time.monotonic()
            line[phase] = now - last
            line.update(fields)
            last = now
            if phase == "emit":
                if profile is not None:
                    profile.disable()
                if self._file is not None:
                    self._step = None
                    self._write(line)

        return lap

    def pause(self) -> None:
        """The batch ended (its last step may not have closed): the thread idles unprofiled and unwatched, and
        the profile so far is written out (a benchmark reading the window that just ended finds it)."""
        self._step = None
        if self._profile is not None:
            self._profile.disable()
            self._dump()

    def _dump(self) -> None:
        self._dumps += 1
        name = f"profile-{os.getpid()}-{self._second}-{self._dumps}.pstats"
        self._profile.dump_stats(os.path.join(self._profile_dir, name))
        self._profile = None

    def _watch(self) -> None:
        """Sample the stack of a step that runs past ``STALL_SECONDS``, once per step."""
        sampled: dict[str, Any] | None = None
        while True:
            time.sleep(self.STALL_SECONDS / 4)
            step = self._step
            if step is None:
                continue
            thread, start, line = step
            if line is sampled or time.monotonic() - start < self.STALL_SECONDS:
                continue
            frame = sys._current_frames().get(thread)
            if frame is None:
                continue
            line["stall_stack"] = [f"{f.filename}:{f.lineno} {f.name}" for f in traceback.extract_stack(frame)[-16:]]
            line["stall_at"] = time.monotonic() - start
            sampled = line

    def _profiler(self, now: float) -> Any:
        """The profile of this second, enabled (the last second's written out when a new one begins)."""
        if self._profile_dir is None:
            return None
        import cProfile

        second = int(now)
        if self._profile is not None and second != self._second:
            self._dump()
        if self._profile is None:
            self._profile, self._second = cProfile.Profile(), second
        self._profile.enable()
        return self._profile

    def _write(self, line: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        if line["t"] - self._flushed > 1.0:
            self._file.flush()
            self._flushed = line["t"]


def _no_lap(phase: str, **fields: Any) -> None:
    pass
