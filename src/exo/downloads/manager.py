"""Downloads of a node: started, listed, followed and cancelled by id (``/v1/downloads``).

``start`` plans synchronously (so an unknown repo, offline-and-missing or a full disk is an error the
caller gets at once), then fetches in a background thread. A second request for the same model (same
revision, same stage) while the first is running gets the first's task, not a second download, or, when
it asks for other head options (``recover_head``, ``quantize_head``), a ``DownloadConflictError``: one
download cannot give two heads, and silently getting the other one would be wrong; two
processes fetching the same repo are kept apart by huggingface_hub's per-file locks. The MLX part
(checkpoint check, head recovery) runs in a child process (``SubprocessSteps``).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from exo.cards import Catalog, load_catalog
from exo.settings import Settings
from exo.wire.errors import DownloadNotFoundError as DownloadNotFoundError  # with the error table

from .errors import DownloadCancelledError, DownloadConflictError, DownloadError, message
from .fetch import DEFAULT_RESERVE_BYTES, DEFAULT_WORKERS
from .hub import HubConfig
from .mlx_steps import MLXSteps, SubprocessSteps
from .progress import FINAL_STATUSES, ProgressTracker
from .pull import PullOptions, PullResult, PullTarget, prepare, pull, pull_target
from .stages import Stage

log = logging.getLogger(__name__)
KEEP_FINISHED = 50


@dataclass
class DownloadTask:
    id: str
    target: PullTarget
    options: PullOptions
    tracker: ProgressTracker
    created_at: float = field(default_factory=time.time)
    result: PullResult | None = None
    error: dict[str, str] | None = None
    thread: threading.Thread | None = None

    @property
    def key(self) -> tuple[Any, ...]:
        return download_key(self.target, self.options)

    @property
    def finished(self) -> bool:
        return self.tracker.status in FINAL_STATUSES

    def view(self) -> dict[str, Any]:
        """The task as ``/v1/downloads`` shows it."""
        progress = self.tracker.snapshot().to_json()
        status = progress.pop("status")
        stage = self.options.stage
        return {
            "id": self.id,
            "object": "download",
            "model": self.target.model_id,
            "repo": self.target.repo,
            "revision": self.options.revision,
            "status": status,
            "progress": progress,
            "options": {
                "recover_head": self.options.recover_head,
                "quantize_head": self.options.quantize_head,
                "stage": None if stage is None else {"start": stage.start, "end": stage.end,
                                                     "n_layers": stage.n_layers},
            },
            "created_at": round(self.created_at, 3),
            "result": self.result.to_json() if self.result is not None else None,
            "error": self.error,
        }


def download_key(target: PullTarget, options: PullOptions) -> tuple[Any, ...]:
    return (target.repo or target.model_id, options.revision, options.stage)


def _same_head_options(running: DownloadTask, options: PullOptions) -> DownloadTask:
    """``running``, when it was asked for the head ``options`` asks for."""
    theirs, ours = running.options, options
    if (theirs.recover_head, theirs.quantize_head) == (ours.recover_head, ours.quantize_head):
        return running
    raise DownloadConflictError(
        f"{running.target.model_id} is already downloading (download {running.id}) with recover_head="
        f"{str(theirs.recover_head).lower()}, quantize_head={str(theirs.quantize_head).lower()}; a download's "
        f"head options cannot change while it runs: follow it, or cancel it (DELETE /v1/downloads/{running.id}) "
        "and ask again",
        running.id,
    )


class DownloadManager:
    def __init__(
        self,
        hub: Callable[[], HubConfig] = HubConfig.from_env,
        *,
        steps: MLXSteps | None = None,
        catalog: Callable[[], Catalog] = load_catalog,
        max_workers: int = DEFAULT_WORKERS,
        reserve_bytes: int = DEFAULT_RESERVE_BYTES,
    ) -> None:
        self._hub = hub
        self._steps = steps or SubprocessSteps()
        self._catalog = catalog
        self.max_workers = max_workers
        self.reserve_bytes = reserve_bytes
        self._lock = threading.Lock()
        self._tasks: dict[str, DownloadTask] = {}

    @classmethod
    def from_settings(cls, settings: Settings, **kwargs: Any) -> DownloadManager:
        """A node's manager: its cards ($EXO_HOME/model_cards), EXO_OFFLINE, the HF_* environment."""
        kwargs.setdefault("catalog", lambda: load_catalog(home=settings.home))
        return cls(lambda: HubConfig.from_env(offline=settings.offline), **kwargs)

    # -- commands ------------------------------------------------------------------------------------
    def start(
        self,
        model: str,
        *,
        revision: str = "main",
        recover_head: bool = True,
        quantize_head: bool = False,
        stage: Stage | None = None,
    ) -> tuple[DownloadTask, bool]:
        """A running (or new) download of ``model``; True when this call started it."""
        target = pull_target(model, self._catalog())
        options = PullOptions(revision, recover_head, quantize_head, stage, self.max_workers, self.reserve_bytes)
        running = self._running(download_key(target, options))
        if running is not None:
            return _same_head_options(running, options), False
        tracker = ProgressTracker()
        tracker.set_status("planning")
        hub = self._hub()
        plan = prepare(target, hub, options, tracker)
        task = DownloadTask(uuid.uuid4().hex[:12], target, options, tracker)
        with self._lock:
            running = self._running_locked(task.key)
            if running is not None:
                return _same_head_options(running, options), False
            self._tasks[task.id] = task
            self._forget_old_locked()
        task.thread = threading.Thread(
            target=self._run, args=(task, plan, hub), name=f"exo-download-{task.id}", daemon=True
        )
        task.thread.start()
        return task, True

    def running(self, model: str, *, revision: str = "main", stage: Stage | None = None) -> DownloadTask | None:
        """The running download of ``model`` (that revision, that stage; None: the whole model), if any."""
        return self._running(download_key(pull_target(model, self._catalog()), PullOptions(revision, stage=stage)))

    def get(self, download_id: str) -> DownloadTask:
        with self._lock:
            task = self._tasks.get(download_id)
        if task is None:
            raise DownloadNotFoundError(f"no download {download_id!r} on this node; list them with GET /v1/downloads")
        return task

    def tasks(self) -> list[DownloadTask]:
        with self._lock:
            return sorted(self._tasks.values(), key=lambda t: t.created_at)

    def views(self) -> list[dict[str, Any]]:
        """Every download as JSON (for the API, and for the cluster state)."""
        return [task.view() for task in self.tasks()]

    def cancel(self, download_id: str, wait_s: float = 10.0) -> tuple[DownloadTask, bool]:
        """Cancel a running download (True) and wait a little for it to stop; a finished one is forgotten."""
        task = self.get(download_id)
        if task.finished:
            with self._lock:
                self._tasks.pop(download_id, None)
            return task, False
        task.tracker.cancel()
        if task.thread is not None:
            task.thread.join(wait_s)
        return task, True

    def close(self, wait_s: float = 10.0) -> None:
        """Cancel every running download and wait for them to stop (app shutdown)."""
        tasks = [t for t in self.tasks() if not t.finished]
        for task in tasks:
            task.tracker.cancel()
        deadline = time.monotonic() + wait_s
        for task in tasks:
            if task.thread is not None:
                task.thread.join(max(0.0, deadline - time.monotonic()))

    # -- internals -----------------------------------------------------------------------------------
    def _run(self, task: DownloadTask, plan: Any, hub: HubConfig) -> None:
        try:
            task.result = pull(task.target, plan, hub, task.tracker, self._steps, task.options)
        except DownloadCancelledError:
            task.tracker.set_status("cancelled")
        except (DownloadError, LookupError, ValueError, OSError) as e:
            task.error = {"code": getattr(e, "code", "download_failed"), "message": message(e)}
            task.tracker.set_status("failed")
        except Exception as e:  # noqa: BLE001 - a task records its failure; the node goes on
            log.exception("download %s of %s failed", task.id, task.target.model_id)
            task.error = {"code": "internal_error", "message": f"{type(e).__name__}: {message(e)}"}
            task.tracker.set_status("failed")
        if task.tracker.cancelled and task.tracker.status == "failed":  # it failed because it was cancelled
            task.tracker.set_status("cancelled")

    def _running(self, key: tuple[Any, ...]) -> DownloadTask | None:
        with self._lock:
            return self._running_locked(key)

    def _running_locked(self, key: tuple[Any, ...]) -> DownloadTask | None:
        return next((t for t in self._tasks.values() if t.key == key and not t.finished), None)

    def _forget_old_locked(self) -> None:
        finished = sorted((t for t in self._tasks.values() if t.finished), key=lambda t: t.created_at)
        for task in finished[: max(0, len(finished) - KEEP_FINISHED)]:
            del self._tasks[task.id]
