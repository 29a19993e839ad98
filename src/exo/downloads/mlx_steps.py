"""The MLX part of a download: check the checkpoint's shapes, and recover its MTP head.

A daemon never runs MLX outside its runners (a thread that ran MLX can abort the process at exit), so
``SubprocessSteps`` runs this in a child process (``python -m exo.downloads.mlx_steps``, one JSON
request on stdin, one JSON answer on stdout); ``exo pull`` runs it in-process (``InProcessSteps``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from exo.launch import module_argv

from .errors import CheckpointRejectedError, DownloadCancelledError, DownloadError

CHILD_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class HeadJob:
    source_repo: str
    source_commit: str
    files: tuple[str, ...]  # absolute paths of the source shards holding mtp.*
    quantize: bool = False
    pending: bool = False  # a pipeline's last stage: convert only; the pipeline checks it (heads.py)

    def to_json(self) -> dict[str, Any]:
        return {"source_repo": self.source_repo, "source_commit": self.source_commit,
                "files": list(self.files), "quantize": self.quantize, "pending": self.pending}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HeadJob:
        return cls(data["source_repo"], data["source_commit"], tuple(data["files"]), data["quantize"],
                   data.get("pending", False))


def finish_checkpoint(path: str, head: HeadJob | None, layers: tuple[int, int] | None = None) -> dict[str, Any]:
    """Load ``path`` lazily (every tensor's shape checked against config.json; ``layers``: only a pipeline
    stage's, from a partial snapshot), then recover the head.

    Returns ``{"head": RecoveredHead.to_json() | None}``; a checkpoint that does not load raises
    ``CheckpointRejectedError``.
    """
    from exo.engine.loader import CheckpointError, load_checkpoint
    from exo.engine.models import UnsupportedModelError

    from .heads import HeadSource, recover_head

    try:
        loaded = load_checkpoint(path, lazy=True, load_head=False, layers=layers)
    except (CheckpointError, UnsupportedModelError) as e:
        raise CheckpointRejectedError(f"the downloaded checkpoint is rejected: {e}") from None
    if head is None:
        return {"head": None}
    source = HeadSource(head.source_repo, head.source_commit, tuple(Path(f) for f in head.files))
    return {"head": recover_head(loaded, source, quantize=head.quantize, pending=head.pending).to_json()}


class MLXSteps(Protocol):
    def __call__(
        self, path: Path, head: HeadJob | None, cancel: threading.Event, layers: tuple[int, int] | None = None
    ) -> dict[str, Any]: ...


class InProcessSteps:
    """For a process whose main thread may run MLX (``exo pull``)."""

    def __call__(
        self, path: Path, head: HeadJob | None, cancel: threading.Event, layers: tuple[int, int] | None = None
    ) -> dict[str, Any]:
        return finish_checkpoint(str(path), head, layers)


class SubprocessSteps:
    """For a daemon: the steps in a child process, killed when the download is cancelled."""

    def __init__(self, timeout_s: float = CHILD_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s

    def __call__(
        self, path: Path, head: HeadJob | None, cancel: threading.Event, layers: tuple[int, int] | None = None
    ) -> dict[str, Any]:
        request = json.dumps({"path": str(path), "head": head.to_json() if head else None, "layers": layers})
        child = subprocess.Popen(
            module_argv("exo.downloads.mlx_steps"),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        result: dict[str, str] = {}

        def talk() -> None:
            result["out"], result["err"] = child.communicate(request)

        reader = threading.Thread(target=talk, name="exo-mlx-steps", daemon=True)
        reader.start()
        waited = 0.0
        while reader.is_alive():
            reader.join(0.1)
            waited += 0.1
            if cancel.is_set() or waited > self.timeout_s:
                child.kill()
                reader.join()
                if cancel.is_set():
                    raise DownloadCancelledError("the download was cancelled")
                raise DownloadError(f"checking the checkpoint took more than {self.timeout_s:.0f} s")
        return _answer(child.returncode, result.get("out", ""), result.get("err", ""))


def _answer(returncode: int, out: str, err: str) -> dict[str, Any]:
    lines = [line for line in out.splitlines() if line.strip()]
    try:
        answer = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        answer = None
    if not isinstance(answer, dict):
        tail = err.strip().splitlines()[-3:]
        raise DownloadError(f"checking the checkpoint failed (exit status {returncode}): {' | '.join(tail)}")
    if "error" in answer:
        error = answer["error"]
        kind = CheckpointRejectedError if error.get("type") == "CheckpointRejectedError" else DownloadError
        raise kind(error.get("message", "checking the checkpoint failed"))
    return answer


def main() -> int:
    request = json.loads(sys.stdin.read())
    head, layers = request.get("head"), request.get("layers")
    job = HeadJob.from_json(head) if head else None
    try:
        answer = finish_checkpoint(request["path"], job, tuple(layers) if layers else None)
    except Exception as e:  # noqa: BLE001 - every failure goes back to the parent as JSON
        message = str(e.args[0]) if isinstance(e, LookupError) and e.args else str(e)
        kind = "CheckpointRejectedError" if isinstance(e, CheckpointRejectedError) else type(e).__name__
        print(json.dumps({"error": {"type": kind, "message": message}}), flush=True)
        return 1
    print(json.dumps(answer), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
