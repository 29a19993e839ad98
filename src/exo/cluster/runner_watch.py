"""The watch over an instance's runner: Status polled while it lives, a silent runner killed, a failure
recorded and the runner restarted within its budget.

``RunnerWatch`` is a part of ``InstanceSupervisor`` (exo.cluster.supervisor): its monitor task runs
``_supervise`` for each instance, on the daemon's asyncio loop, with the supervisor's poll periods and
deadlines and the process methods of ``RunnerProcesses``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable

import grpc

from exo.wire.proto_gen import node_pb2 as pb
from exo.wire.runner import EXIT_GROUP_LOST, EXIT_LOAD_FAILED

from .runner_process import InstanceEntry, RunnerProcesses

log = logging.getLogger("exo.cluster.supervisor")


class RunnerWatch(RunnerProcesses):
    """The monitor's part of ``InstanceSupervisor``: it reads the supervisor's poll periods and deadlines
    (class attributes there, which a test may shorten) and its restart budget, and reports through
    ``_set`` and ``_changed``."""

    LOADING_POLL_S: float
    READY_POLL_S: float
    STATUS_DEADLINE_S: float
    UNREACHABLE_S: float
    STARTUP_S: float
    RESTART_DELAY_S: float
    max_restarts: int
    decode_bytes_per_s: float  # the best a runner here measured (the supervisor's)
    _changed: Callable[[InstanceEntry], None]

    async def _supervise(self, entry: InstanceEntry) -> None:
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

    async def _watch(self, entry: InstanceEntry) -> int:
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

    async def _poll(self, entry: InstanceEntry) -> bool:
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

