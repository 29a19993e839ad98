"""Where the device thread's time goes, step by step of a batch (``EXO_DEVICE_TRACE``): for benchmarks."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any


class DeviceTrace:
    """Where the device thread's time goes, step by step (``EXO_DEVICE_TRACE=DIR``: off unless set): one JSON line
    per step of a batch in ``DIR/device-<pid>.jsonl`` with its start (``time.monotonic()``, comparable across
    processes), the seconds of each phase (``plan``: the scheduler and tokenizing the queue's head; ``prefill``:
    beginning the admitted, their chunks and first tokens; ``step``: the members' decode step; ``emit``: their
    tokens to their streams) and what it carried. For benchmarks (bench/serving.py reads it back)."""

    def __init__(self, path: str | None) -> None:
        self._file = open(path, "a", buffering=1 << 16) if path else None  # noqa: SIM115 - open for the process
        self._flushed = time.monotonic()

    @classmethod
    def from_env(cls) -> DeviceTrace:
        folder = os.environ.get("EXO_DEVICE_TRACE")
        if not folder:
            return cls(None)
        os.makedirs(folder, exist_ok=True)
        return cls(os.path.join(folder, f"device-{os.getpid()}.jsonl"))

    def step(self) -> Callable[..., None]:
        """A new step: returns ``lap(phase, **fields)``, which closes the phase (the last, "emit", writes the line)."""
        if self._file is None:
            return _no_lap
        start = last = time.monotonic()
        line: dict[str, Any] = {"t": start}

        def lap(phase: str, **fields: Any) -> None:
            nonlocal last
            now = time.monotonic()
            line[phase] = now - last
            line.update(fields)
            last = now
            if phase == "emit":
                self._write(line)

        return lap

    def _write(self, line: dict[str, Any]) -> None:
        assert self._file is not None
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
        if line["t"] - self._flushed > 1.0:
            self._file.flush()
            self._flushed = line["t"]


def _no_lap(phase: str, **fields: Any) -> None:
    pass
