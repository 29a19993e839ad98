"""A runner subprocess of an instance: its socket, command line, spawn, stderr tail, end and failure record.

``RunnerProcesses`` is a part of ``InstanceSupervisor`` (exo.cluster.supervisor): the methods that start,
read and end one instance's runner process, on the daemon's asyncio loop; ``InstanceEntry`` is what the
supervisor keeps of each instance (its ``pb.Instance``, the process, the channel to its runner).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import os
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

import exo
from exo.wire.proto_gen import node_pb2 as pb
from exo.wire.proto_gen import node_pb2_grpc as pb_grpc
from exo.wire.runner import MAX_MESSAGE_BYTES

if TYPE_CHECKING:
    from exo.engine import ResolvedModel

log = logging.getLogger("exo.cluster.supervisor")

STDERR_TAIL_LINES = 20
MAX_STDERR_LINE = 2000  # bytes of one stderr line kept in the tail
# sun_path is 104 bytes on macOS, 108 on Linux (with its NUL); stay under both.
MAX_SOCKET_PATH = 100
_LOG_LINE_PREFIX = " runner "  # the runner's logging format: "<time> runner <id> LEVEL: message"


@dataclass
class InstanceEntry:
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



class RunnerProcesses:
    """The runner processes' part of ``InstanceSupervisor``: it reads ``home``, ``runner_cmd``, ``env`` and
    the run directory the supervisor sets up, and reports a new pid through ``_set``."""

    home: Path
    runner_cmd: list[str]
    env: dict[str, str]
    _run_dir: Path | None
    _tmp_run_dir: Path | None
    _set: Callable[..., None]

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

    def _command(self, entry: InstanceEntry) -> list[str]:
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
            elif shard.backend:  # a pipeline's group on another backend than the ring (NCCL: the collective wire)
                cmd += ["--backend", shard.backend]
        return cmd

    async def _spawn(self, entry: InstanceEntry) -> None:
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

    async def _drain(self, entry: InstanceEntry, proc: asyncio.subprocess.Process) -> None:
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

    async def _close_channel(self, entry: InstanceEntry) -> None:
        channel, entry.channel, entry.stub = entry.channel, None, None
        if channel is not None:
            await channel.close(grace=None)

    async def _terminate(self, entry: InstanceEntry, grace: float) -> None:
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

    async def _failure(self, entry: InstanceEntry, code: int) -> pb.Failure:
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
