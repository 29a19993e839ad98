"""Instances as runner subprocesses (``python -m exo.runner``), supervised by the daemon.

Each instance gets one runner and one monitor task on the daemon's asyncio loop. The monitor polls the
runner's Status over its unix socket (load progress while LOADING, queue depth and running while
READY) and watches the process: an unexpected exit is recorded as the instance's ``failure`` (exit
code, the last stderr lines, the line that says why) and restarted while ``restarts < max_restarts``;
a failed load (``EXIT_LOAD_FAILED``: the same checkpoint would fail again) or an exhausted budget
leaves the instance FAILED and listed until ``stop()``. A runner whose Status stays unreachable while
its process lives is killed and treated as a crash, so no runner is ever left half-alive. Runners die
with the daemon (``--parent-pid``: see ``exo.runner.main``).

An instance whose weights the node lacks starts with ``fetch_and_start``: it is listed at once (LOADING,
stage ``downloading``, its ``download`` progress), its monitor first awaits the download, then spawns
the runner as ``start`` does; a failed download fails the instance with the reason.

The supervisor is in three parts: this module (the instances' records, the public calls: queries, start,
stop, kill, wait, generate), ``runner_watch.RunnerWatch`` (the monitor: Status polls, the silent runner
killed, failures recorded, restarts) and ``runner_process.RunnerProcesses`` (one runner process: socket,
command line, spawn, stderr tail, termination, the failure's message).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from exo.launch import module_argv
from exo.wire.errors import InstanceFailedError as InstanceFailedError  # with the error table
from exo.wire.proto_gen import node_pb2 as pb

from .runner_process import InstanceEntry
from .runner_watch import RunnerWatch

if TYPE_CHECKING:
    from exo.engine import ResolvedModel

log = logging.getLogger(__name__)

_LIVE = (pb.INSTANCE_STATE_LOADING, pb.INSTANCE_STATE_READY)
# Hands a download's id and progress to the instance waiting for it.
DownloadReport = Callable[[str, pb.DownloadProgress], None]
# Downloads an instance's weights (reporting progress); the model to run once they are there.
Fetch = Callable[[DownloadReport], Awaitable["ResolvedModel"]]


class UnknownInstanceError(LookupError):
    """No such instance on this node (never started, or stopped)."""


class InstanceSupervisor(RunnerWatch):
    """Runs instances as runner subprocesses; all methods run on the daemon's asyncio loop (grpc.aio)."""

    # Poll periods and deadlines (seconds). Class attributes so a test can shorten them.
    LOADING_POLL_S = 0.3
    READY_POLL_S = 1.0
    STATUS_DEADLINE_S = 2.0
    UNREACHABLE_S = 30.0  # Status failing this long after the runner once answered: kill it
    STARTUP_S = 120.0  # no Status answer at all this long after the spawn: kill it
    RESTART_DELAY_S = 0.5
    GENERATE_GRACE_S = 30.0  # beyond the request's own timeout, for the call's deadline
    DEFAULT_GENERATE_TIMEOUT_S = 600.0  # a request without timeout_s (the runner's default)

    def __init__(
        self,
        home: Path,
        *,
        node_id: Callable[[], str],
        max_restarts: int = 2,
        runner_cmd: Sequence[str] | None = None,
        env: Mapping[str, str] | None = None,
        on_change: Callable[[pb.Instance], None] | None = None,
    ) -> None:
        self.home = Path(home)
        self.node_id = node_id
        self.max_restarts = max_restarts
        self.runner_cmd = list(runner_cmd) if runner_cmd is not None else module_argv("exo.runner")
        self.env = dict(env or {})
        self.on_change = on_change
        self.decode_bytes_per_s = 0.0  # the best decode speed a runner here measured (NodeInfo's, for placement)
        self._entries: dict[str, InstanceEntry] = {}
        self._run_dir: Path | None = None
        self._tmp_run_dir: Path | None = None  # the fallback for a home whose paths are too long

    # -- queries --------------------------------------------------------------------------------------------

    def get(self, instance_id: str) -> pb.Instance | None:
        entry = self._entries.get(instance_id)
        return self._snapshot(entry) if entry is not None else None

    def list(self) -> list[pb.Instance]:
        entries = sorted(self._entries.values(), key=lambda e: e.info.created_unix)
        return [self._snapshot(e) for e in entries]

    def live_for(self, model_id: str) -> pb.Instance | None:
        """A single-node instance of ``model_id`` that is loading or ready (a ready one first)."""
        live = [e for e in self._entries.values()
                if e.info.model_id == model_id and e.info.state in _LIVE and not e.info.stages]
        if not live:
            return None
        live.sort(key=lambda e: (e.info.state != pb.INSTANCE_STATE_READY, e.info.created_unix))
        return self._snapshot(live[0])

    # -- lifecycle ------------------------------------------------------------------------------------------

    async def start(
        self,
        instance_id: str,
        resolved: ResolvedModel,
        shard: pb.Shard | None = None,
        *,
        on_demand: bool = False,
        group_id: str = "",
        model_ref: str | None = None,
        stages: Sequence[pb.StagePlacement] = (),
        owner_node: str = "",
    ) -> pb.Instance:
        """Spawn a runner for ``resolved`` (or a pipeline stage of it: ``shard``, ``stages``); returns at
        once, in state LOADING."""
        if instance_id in self._entries:
            raise ValueError(f"instance {instance_id} already exists")
        now = time.time()
        info = pb.Instance(
            instance_id=instance_id,
            model_id=resolved.model_id,
            model_ref=model_ref if model_ref is not None else resolved.model_id,
            state=pb.INSTANCE_STATE_LOADING,
            stage="starting",
            shard=shard if shard is not None else pb.Shard(world_size=1),
            created_unix=now,
            updated_unix=now,
            on_demand=on_demand,
            group_id=group_id,
            stages=list(stages),
            owner_node=owner_node,
        )
        entry = InstanceEntry(info, resolved, self._socket_path(instance_id))
        self._entries[instance_id] = entry
        try:
            await self._spawn(entry)
        except BaseException:
            self._entries.pop(instance_id, None)
            raise
        if entry.stopping:  # stop() ran during the spawn, before this process existed: end it here
            await self._terminate(entry, 0.0)
            await self._close_channel(entry)
            raise UnknownInstanceError(f"instance {instance_id} was stopped while it started")
        entry.monitor = asyncio.create_task(self._supervise(entry), name=f"exo-runner-monitor-{instance_id[:8]}")
        self._changed(entry)
        return self._snapshot(entry)

    async def fetch_and_start(
        self,
        instance_id: str,
        model_id: str,
        fetch: Fetch,
        shard: pb.Shard | None = None,
        *,
        on_demand: bool = False,
        group_id: str = "",
        model_ref: str | None = None,
        stages: Sequence[pb.StagePlacement] = (),
        owner_node: str = "",
    ) -> pb.Instance:
        """An instance whose weights must be downloaded first: listed at once (LOADING, ``downloading``);
        ``fetch`` runs in its monitor, then the runner starts as in ``start``."""
        if instance_id in self._entries:
            raise ValueError(f"instance {instance_id} already exists")
        now = time.time()
        info = pb.Instance(
            instance_id=instance_id, model_id=model_id, model_ref=model_ref if model_ref is not None else model_id,
            state=pb.INSTANCE_STATE_LOADING, stage="downloading",
            shard=shard if shard is not None else pb.Shard(world_size=1), created_unix=now, updated_unix=now,
            on_demand=on_demand, group_id=group_id, stages=list(stages), owner_node=owner_node,
        )
        entry = InstanceEntry(info, None, self._socket_path(instance_id), downloading=True)
        self._entries[instance_id] = entry
        entry.monitor = asyncio.create_task(self._fetch_then_supervise(entry, fetch),
                                            name=f"exo-runner-monitor-{instance_id[:8]}")
        self._changed(entry)
        return self._snapshot(entry)

    async def _fetch_then_supervise(self, entry: InstanceEntry, fetch: Fetch) -> None:
        def report(download_id: str, progress: pb.DownloadProgress) -> None:
            entry.info.download_id = download_id
            entry.info.download.CopyFrom(progress)
            entry.info.updated_unix = time.time()

        try:
            resolved = await fetch(report)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a failed download fails the instance, with the reason
            entry.downloading = False
            text = str(e.args[0]) if isinstance(e, LookupError) and e.args else str(e)
            log.warning("instance %s: %s", entry.info.instance_id, text)
            entry.info.failure.CopyFrom(pb.Failure(message=text, at_unix=time.time()))
            self._set(entry, state=pb.INSTANCE_STATE_FAILED, stage="failed")
            return
        entry.downloading = False
        if entry.stopping:
            return
        entry.resolved = resolved
        self._set(entry, stage="starting")
        try:
            await self._spawn(entry)
        except OSError as e:
            entry.info.failure.CopyFrom(pb.Failure(message=f"the runner could not start: {e}", at_unix=time.time()))
            self._set(entry, state=pb.INSTANCE_STATE_FAILED, stage="failed")
            return
        if entry.stopping:
            await self._terminate(entry, 0.0)
            return
        await self._supervise(entry)

    async def wait_ready(self, instance_id: str, timeout: float) -> pb.Instance:
        """Wait until the instance is READY; raises InstanceFailedError, TimeoutError, UnknownInstanceError."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            entry = self._entries.get(instance_id)
            if entry is None:
                raise UnknownInstanceError(f"unknown instance {instance_id} (it was stopped or never started)")
            state = entry.info.state
            if state == pb.INSTANCE_STATE_READY:
                return self._snapshot(entry)
            if state in (pb.INSTANCE_STATE_FAILED, pb.INSTANCE_STATE_STOPPING):
                snap = self._snapshot(entry)
                if state == pb.INSTANCE_STATE_STOPPING:
                    raise InstanceFailedError(snap, f"instance {instance_id} is stopping")
                raise InstanceFailedError(snap)
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                raise TimeoutError(
                    f"instance {instance_id} of {entry.info.model_id} is not ready after {timeout:.0f} s "
                    f"({entry.info.stage}, {entry.info.progress:.0%})"
                )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(entry.changed.wait(), left)

    async def stop(self, instance_id: str, grace: float = 5.0) -> bool:
        """SIGTERM the runner, SIGKILL it after ``grace`` s; remove the instance. False if unknown."""
        entry = self._entries.get(instance_id)
        if entry is None:
            return False
        if not entry.stopping:
            entry.stopping = True
            self._set(entry, state=pb.INSTANCE_STATE_STOPPING, stage="stopping")
        if entry.downloading and entry.monitor is not None:
            entry.monitor.cancel()  # no runner yet; the download itself goes on (it may be shared)
        await self._terminate(entry, grace)
        if entry.monitor is not None and entry.monitor is not asyncio.current_task():
            # It returns once it sees `stopping` (and kills a process it spawned meanwhile).
            _, pending = await asyncio.wait({entry.monitor}, timeout=grace + 5.0)
            for task in pending:
                task.cancel()
            await self._terminate(entry, 0.0)
        await self._close_channel(entry)
        with contextlib.suppress(OSError):
            os.unlink(entry.socket_path)
        if self._entries.get(instance_id) is entry:
            del self._entries[instance_id]
        entry.notify()
        return True

    def kill(self, instance_id: str, reason: str) -> bool:
        """Kill a runner now (SIGKILL: a pipeline stage blocked in a receive never runs a signal handler);
        the instance stays listed, FAILED with ``reason`` (a pipeline stage is not restarted). An instance
        still downloading its weights fails at once. False if unknown or not running."""
        entry = self._entries.get(instance_id)
        if entry is not None and entry.downloading and entry.monitor is not None:
            entry.monitor.cancel()  # no runner yet: it fails here, and its download goes on (it may be shared)
            entry.downloading = False
            entry.info.failure.CopyFrom(pb.Failure(message=reason, at_unix=time.time()))
            self._set(entry, state=pb.INSTANCE_STATE_FAILED, stage="failed")
            return True
        if entry is None or entry.process is None or entry.process.returncode is not None:
            return False
        entry.kill_reason = reason
        with contextlib.suppress(ProcessLookupError):
            entry.process.kill()
        return True

    async def close(self) -> None:
        """Stop every runner and wait for them."""
        await asyncio.gather(*(self.stop(iid) for iid in list(self._entries)), return_exceptions=True)
        if self._tmp_run_dir is not None:
            shutil.rmtree(self._tmp_run_dir, ignore_errors=True)
            self._tmp_run_dir = None
            self._run_dir = None

    async def join_group(self, instance_id: str, hosts: Sequence[str]) -> bool:
        """Hand a pipeline stage's runner its group's hosts; it joins the ring."""
        entry = self._entries.get(instance_id)
        if entry is None or entry.stub is None:
            raise UnknownInstanceError(f"unknown instance {instance_id} (it was stopped or never started)")
        reply = await entry.stub.JoinGroup(
            pb.JoinGroupRequest(instance_id=instance_id, hosts=list(hosts)), timeout=self.STATUS_DEADLINE_S
        )
        return reply.accepted

    # -- generation -----------------------------------------------------------------------------------------

    def generate(
        self, instance_id: str, request: pb.GenerateRequest, timeout: float | None = None
    ) -> grpc.aio.UnaryStreamCall:
        """The runner's Generate stream; ``call.cancel()`` cancels the runner's generation."""
        entry = self._entries.get(instance_id)
        if entry is None:
            raise UnknownInstanceError(f"unknown instance {instance_id} (it was stopped or never started)")
        if entry.info.state != pb.INSTANCE_STATE_READY or entry.stub is None:
            snap = self._snapshot(entry)
            if entry.info.state == pb.INSTANCE_STATE_FAILED:
                raise InstanceFailedError(snap)
            state = pb.InstanceState.Name(entry.info.state).removeprefix("INSTANCE_STATE_").lower()
            raise InstanceFailedError(snap, f"instance {instance_id} of {entry.info.model_id} is not ready ({state})")
        if timeout is None:
            own = request.timeout_s if request.timeout_s > 0 else self.DEFAULT_GENERATE_TIMEOUT_S
            timeout = own + self.GENERATE_GRACE_S
        return entry.stub.Generate(request, timeout=timeout)

    # -- internals ------------------------------------------------------------------------------------------

    def _snapshot(self, entry: InstanceEntry) -> pb.Instance:
        snap = pb.Instance()
        snap.CopyFrom(entry.info)
        snap.node_id = self.node_id()
        return snap

    def _changed(self, entry: InstanceEntry) -> None:
        entry.notify()
        if self.on_change is not None:
            try:
                self.on_change(self._snapshot(entry))
            except Exception:
                log.exception("on_change failed for instance %s", entry.info.instance_id)

    def _set(self, entry: InstanceEntry, *, state: int | None = None, **fields: object) -> None:
        """Update the instance; a new state is a transition (waiters and on_change hear of it)."""
        info = entry.info
        changed = False
        for name, value in fields.items():
            if getattr(info, name) != value:
                setattr(info, name, value)
                changed = True
        transition = state is not None and state != info.state
        if transition:
            info.state = state  # type: ignore[assignment]
        if changed or transition:
            info.updated_unix = time.time()
        if transition:
            self._changed(entry)
