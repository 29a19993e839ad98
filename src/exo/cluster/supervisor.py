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
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

import exo
from exo.launch import module_argv
from exo.wire.proto_gen import node_pb2 as pb
from exo.wire.proto_gen import node_pb2_grpc as pb_grpc
from exo.wire.runner import EXIT_GROUP_LOST, EXIT_LOAD_FAILED, MAX_MESSAGE_BYTES

if TYPE_CHECKING:
    from exo.engine import ResolvedModel

log = logging.getLogger(__name__)

STDERR_TAIL_LINES = 20
MAX_STDERR_LINE = 2000  # bytes of one stderr line kept in the tail
# sun_path is 104 bytes on macOS, 108 on Linux (with its NUL); stay under both.
MAX_SOCKET_PATH = 100
_LOG_LINE_PREFIX = " runner "  # the runner's logging format: "<time> runner <id> LEVEL: message"

_LIVE = (pb.INSTANCE_STATE_LOADING, pb.INSTANCE_STATE_READY)
# Hands a download's id and progress to the instance waiting for it.
DownloadReport = Callable[[str, pb.DownloadProgress], None]
# Downloads an instance's weights (reporting progress); the model to run once they are there.
Fetch = Callable[[DownloadReport], Awaitable["ResolvedModel"]]


class InstanceFailedError(RuntimeError):
    """The instance failed (or is not ready); ``.instance`` is its snapshot, ``failure`` filled when known."""

    def __init__(self, instance: pb.Instance, message: str | None = None) -> None:
        if message is None:
            why = instance.failure.message or "no diagnostics"
            message = f"instance {instance.instance_id} of {instance.model_id} failed: {why}"
        super().__init__(message)
        self.instance = instance


class UnknownInstanceError(LookupError):
    """No such instance on this node (never started, or stopped)."""


@dataclass
class _Entry:
    info: pb.Instance  # node_id is filled at snapshot time
    resolved: ResolvedModel | None  # None while its weights are downloading
    socket_path: str
    stderr: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=STDERR_TAIL_LINES))
    process: asyncio.subprocess.Process | None = None
    channel: grpc.aio.Channel | None = None
    stub: pb_grpc.RunnerStub | None = None
    monitor: asyncio.Task[None] | None = None
    drain: asyncio.Task[None] | None = None
    stopping: bool = False
    downloading: bool = False  # its monitor is awaiting the weights (no runner yet)
    kill_reason: str = ""  # set when the supervisor itself killed a runner that stopped answering
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def notify(self) -> None:
        # Wake every waiter of the current event and give later waiters a fresh one.
        self.changed.set()
        self.changed = asyncio.Event()


class InstanceSupervisor:
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
        self._entries: dict[str, _Entry] = {}
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
        entry = _Entry(info, resolved, self._socket_path(instance_id))
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
        entry = _Entry(info, None, self._socket_path(instance_id), downloading=True)
        self._entries[instance_id] = entry
        entry.monitor = asyncio.create_task(self._fetch_then_supervise(entry, fetch),
                                            name=f"exo-runner-monitor-{instance_id[:8]}")
        self._changed(entry)
        return self._snapshot(entry)

    async def _fetch_then_supervise(self, entry: _Entry, fetch: Fetch) -> None:
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

    def _snapshot(self, entry: _Entry) -> pb.Instance:
        snap = pb.Instance()
        snap.CopyFrom(entry.info)
        snap.node_id = self.node_id()
        return snap

    def _changed(self, entry: _Entry) -> None:
        entry.notify()
        if self.on_change is not None:
            try:
                self.on_change(self._snapshot(entry))
            except Exception:
                log.exception("on_change failed for instance %s", entry.info.instance_id)

    def _set(self, entry: _Entry, *, state: int | None = None, **fields: object) -> None:
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

    def _socket_path(self, instance_id: str) -> str:
        name = hashlib.sha256(instance_id.encode()).hexdigest()[:16] + ".sock"
        if self._run_dir is None:
            run_dir = self.home / "run"
            if len(str(run_dir / name).encode()) > MAX_SOCKET_PATH:
                self._tmp_run_dir = run_dir = Path(tempfile.mkdtemp(prefix="exo-run-"))  # mode 0o700
            else:
                run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
                run_dir.chmod(0o700)  # only this user may open the runners' sockets
            self._run_dir = run_dir
        path = str(self._run_dir / name)
        if len(path.encode()) > MAX_SOCKET_PATH:
            raise OSError(f"no short enough directory for a runner's unix socket ({path})")
        return path

    def _command(self, entry: _Entry) -> list[str]:
        info, resolved = entry.info, entry.resolved
        assert resolved is not None, "a runner starts once its weights are there"
        cmd = [
            *self.runner_cmd,
            "--instance-id", info.instance_id,
            *(["--group-id", info.group_id] if info.group_id else []),
            "--socket", entry.socket_path,
            "--model-path", str(resolved.path),
            "--model-id", resolved.model_id,
            "--parent-pid", str(os.getpid()),
        ]
        if resolved.card is not None:
            cmd += ["--card", resolved.card.id]
        shard = info.shard
        if shard.start_layer or shard.end_layer or shard.rank or shard.world_size > 1:
            cmd += [
                "--start-layer", str(shard.start_layer),
                "--end-layer", str(shard.end_layer),
                "--rank", str(shard.rank),
                "--world-size", str(max(shard.world_size, 1)),
            ]
            if shard.sharding == "tensor":
                cmd += ["--sharding", "tensor", "--backend", shard.backend or "ring"]
        return cmd

    async def _spawn(self, entry: _Entry) -> None:
        env = {**os.environ, **self.env, "EXO_HOME": str(self.home)}
        _importable(env)
        with contextlib.suppress(OSError):
            os.unlink(entry.socket_path)  # a stale socket would answer nothing; the runner recreates it
        entry.stderr.clear()
        entry.kill_reason = ""
        # Forked from this (the loop's) thread: the runner's PR_SET_PDEATHSIG fires when this thread ends.
        proc = await asyncio.create_subprocess_exec(
            *self._command(entry),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        entry.process = proc
        entry.drain = asyncio.create_task(self._drain(entry, proc), name=f"exo-runner-stderr-{proc.pid}")
        entry.channel = grpc.aio.insecure_channel(
            f"unix:{entry.socket_path}",
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                # The socket appears a moment after the spawn: retry soon, not after gRPC's backoff.
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 500),
            ],
        )
        entry.stub = pb_grpc.RunnerStub(entry.channel)
        self._set(entry, pid=proc.pid)
        log.info("instance %s: runner pid %d for %s", entry.info.instance_id, proc.pid, entry.info.model_id)

    async def _drain(self, entry: _Entry, proc: asyncio.subprocess.Process) -> None:
        """Read the runner's stderr to its end (a full pipe would block it): keep a tail, log each line."""
        assert proc.stderr is not None
        tag = entry.info.instance_id[:8]
        while True:
            try:
                raw = await proc.stderr.readline()
            except ValueError:  # a line over the stream's limit: dropped (readline skipped it)
                raw = b"[a stderr line too long to keep]"
            if not raw:
                return
            line = raw[:MAX_STDERR_LINE].decode("utf-8", errors="replace").rstrip()
            if line:
                entry.stderr.append(line)
                log.info("runner %s: %s", tag, line)

    async def _close_channel(self, entry: _Entry) -> None:
        channel, entry.channel, entry.stub = entry.channel, None, None
        if channel is not None:
            await channel.close(grace=None)

    async def _terminate(self, entry: _Entry, grace: float) -> None:
        proc = entry.process
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM if grace > 0 else signal.SIGKILL)
        try:
            await asyncio.wait_for(proc.wait(), grace if grace > 0 else 10.0)
        except TimeoutError:
            log.warning("instance %s: runner %d ignored SIGTERM for %.0f s: killing it",
                        entry.info.instance_id, proc.pid, grace)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async def _supervise(self, entry: _Entry) -> None:
        """The instance's life: watch the runner, record its failures, restart it within the budget."""
        try:
            while True:
                code = await self._watch(entry)
                if entry.stopping:
                    return
                failure = await self._failure(entry, code)
                await self._close_channel(entry)
                # A pipeline stage is never restarted alone: its group is formed anew (exo.cluster.orchestration).
                pipelined = entry.info.shard.world_size > 1
                restartable = (
                    code not in (EXIT_LOAD_FAILED, EXIT_GROUP_LOST) and not pipelined
                    and entry.info.restarts < self.max_restarts
                )
                log.warning("instance %s: runner exited (%d): %s%s", entry.info.instance_id, code, failure.message,
                            "; restarting" if restartable else "")
                entry.info.failure.CopyFrom(failure)
                if not restartable:
                    self._set(entry, state=pb.INSTANCE_STATE_FAILED, stage="failed", running=0, queue_depth=0)
                    return
                entry.info.restarts += 1
                was_loading = entry.info.state == pb.INSTANCE_STATE_LOADING
                self._set(entry, state=pb.INSTANCE_STATE_LOADING, stage="restarting", progress=0.0,
                          running=0, queue_depth=0)
                if was_loading:  # LOADING -> LOADING is still news: a failure and a restart
                    self._changed(entry)
                await asyncio.sleep(self.RESTART_DELAY_S)
                if entry.stopping:
                    return
                await self._spawn(entry)
                if entry.stopping:  # stop() ran during the spawn: it may have missed this process
                    await self._terminate(entry, 0.0)
                    return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never leave a runner without its monitor
            log.exception("instance %s: supervision failed", entry.info.instance_id)
            await self._terminate(entry, 0.0)
            entry.info.failure.CopyFrom(
                pb.Failure(exit_code=-1, message=f"supervision failed: {type(e).__name__}: {e}", at_unix=time.time(),
                           stderr_tail=list(entry.stderr))
            )
            self._set(entry, state=pb.INSTANCE_STATE_FAILED, stage="failed")

    async def _watch(self, entry: _Entry) -> int:
        """Poll Status until the process exits (killing it when it stops answering); its exit code."""
        proc = entry.process
        assert proc is not None and entry.stub is not None
        exited = asyncio.ensure_future(proc.wait())
        spawned = last_ok = time.monotonic()
        answered = False
        try:
            while True:
                period = self.READY_POLL_S if entry.info.state == pb.INSTANCE_STATE_READY else self.LOADING_POLL_S
                done, _ = await asyncio.wait({exited}, timeout=period)
                if done:
                    return exited.result()
                if entry.stopping:
                    continue  # stop() is ending it; only wait
                if await self._poll(entry):
                    answered, last_ok = True, time.monotonic()
                    continue
                silent = time.monotonic() - (last_ok if answered else spawned)
                limit = self.UNREACHABLE_S if answered else self.STARTUP_S
                if silent > limit:
                    what = "stopped answering Status" if answered else "never answered Status"
                    entry.kill_reason = f"the runner {what} for {silent:.0f} s; killed"
                    log.warning("instance %s: %s", entry.info.instance_id, entry.kill_reason)
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
        finally:
            if not exited.done():
                exited.cancel()

    async def _poll(self, entry: _Entry) -> bool:
        """One Status call; copies progress (and the model once ready). False: the runner did not answer."""
        if entry.stub is None or not os.path.exists(entry.socket_path):
            return False
        try:
            status = await entry.stub.Status(pb.RunnerStatusRequest(), timeout=self.STATUS_DEADLINE_S)
        except grpc.aio.AioRpcError as e:
            # A full server still answered: it is alive.
            return e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        if entry.stopping:
            return True
        if status.ring_port and entry.info.ring_port != status.ring_port:
            entry.info.ring_port = status.ring_port
            entry.notify()  # the orchestrator waits for every stage's port
        if status.state == pb.INSTANCE_STATE_READY:
            if entry.info.state != pb.INSTANCE_STATE_READY:
                entry.info.model.CopyFrom(status.model)
            self._set(entry, state=pb.INSTANCE_STATE_READY, stage="ready", progress=1.0,
                      queue_depth=status.queue_depth, running=status.running)
            if status.HasField("prefix_cache") and entry.info.prefix_cache != status.prefix_cache:
                entry.info.prefix_cache.CopyFrom(status.prefix_cache)  # figures, no transition: no notice
            if status.HasField("prefix_summary") and entry.info.prefix_summary != status.prefix_summary:
                entry.info.prefix_summary.CopyFrom(status.prefix_summary)  # for routing: no notice either
            if status.decode_bytes_per_s and entry.info.decode_bytes_per_s != status.decode_bytes_per_s:
                entry.info.decode_bytes_per_s = status.decode_bytes_per_s  # (the node's estimates)
                self.decode_bytes_per_s = max(self.decode_bytes_per_s, status.decode_bytes_per_s)

        elif status.state == pb.INSTANCE_STATE_LOADING:
            self._set(entry, stage=status.stage, progress=status.progress)
        # FAILED: the runner is about to exit with the reason on stderr; the exit is what counts.
        return True

    async def _failure(self, entry: _Entry, code: int) -> pb.Failure:
        if entry.drain is not None:  # the last lines (the reason of a failed load) are still in the pipe
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(entry.drain), 2.0)
            entry.drain.cancel()
        tail = list(entry.stderr)
        return pb.Failure(exit_code=code, message=_failure_message(code, tail, entry.kill_reason),
                          stderr_tail=tail, at_unix=time.time())


def _importable(env: dict[str, str]) -> None:
    """Let the runner import the exo this daemon runs, also when it came from a source tree (PYTHONPATH,
    a path set up by a test or a wrapper) rather than an installed package."""
    root = str(Path(exo.__file__).resolve().parent.parent)
    if Path(root).name in ("site-packages", "dist-packages"):
        return  # installed: found anyway (and on PYTHONPATH it would come before the standard library)
    paths = env.get("PYTHONPATH", "").split(os.pathsep) if env.get("PYTHONPATH") else []
    if root not in (str(Path(p).resolve()) for p in paths if p):
        env["PYTHONPATH"] = os.pathsep.join([root, *paths])


def _failure_message(code: int, tail: Sequence[str], kill_reason: str) -> str:
    """Why the runner stopped, in one line: its own reason when it printed one."""
    for line in reversed(tail):
        if line.startswith("exo runner:"):
            return line
    if kill_reason:
        return kill_reason
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"the runner was killed by {name}"
    last = next((ln for ln in reversed(tail) if ln.strip() and _LOG_LINE_PREFIX not in ln), "")
    return f"the runner exited with status {code}" + (f": {last.strip()}" if last else "")
