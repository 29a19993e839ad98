"""The runner's gRPC service (``exo.v1.Runner``) on a unix socket: Status and Generate.

Handlers run on gRPC's thread pool and never touch MLX: Generate queues a job on the device (served by
the main thread) and relays its chunks, sending a heartbeat whenever nothing else flowed for
``HEARTBEAT_S`` so the caller can tell a slow generation from a dead runner.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import TYPE_CHECKING

import grpc

from exo.wire.errors import NodeUnavailableError
from exo.wire.proto_gen import node_pb2 as pb
from exo.wire.proto_gen import node_pb2_grpc as pb_grpc
from exo.wire.runner import HEARTBEAT_S, MAX_MESSAGE_BYTES

from .device import Device, Failed, GenerationJob, QueueFullError, Started, pipeline_failed

if TYPE_CHECKING:
    from exo.engine import Engine

DEFAULT_TIMEOUT_S = 600.0  # a request without timeout_s
DONE = None  # the last item of a generation's output queue



class RunnerState:
    """What Status reports: load progress, then the model it serves (thread-safe)."""

    def __init__(self, instance_id: str, shard: pb.Shard, ring_port: int = 0) -> None:
        self.instance_id = instance_id
        self.shard = shard
        self.ring_port = ring_port
        self.pipelined = shard.world_size > 1
        self.group_broken = False  # the pipeline failed (``device.pipeline_failed``): the group must be formed anew
        self._hosts: list[str] | None = None
        self._hosts_set = threading.Event()
        self._lock = threading.Lock()
        self.state = pb.INSTANCE_STATE_LOADING
        self.progress = 0.0
        self.stage = "starting"
        self.error = ""
        self.model: pb.ModelSummary | None = None
        self.engine: Engine | None = None
        self.decode_bytes_per_s = 0.0  # a single-node instance's measured decode speed (placement's estimates)

    def update(self, stage: str, progress: float) -> None:
        with self._lock:
            self.stage, self.progress = stage, progress

    def join(self, hosts: list[str]) -> bool:
        """The group's hosts (from the daemon); False when they came already (a second call changes nothing)."""
        with self._lock:
            if self._hosts is not None:
                return self._hosts == hosts
            self._hosts = list(hosts)
        self._hosts_set.set()
        return True

    def wait_for_hosts(self, timeout: float) -> list[str]:
        if not self._hosts_set.wait(timeout):
            raise TimeoutError(f"the daemons did not send this stage its group's hosts within {timeout:.0f} s")
        assert self._hosts is not None
        return list(self._hosts)

    def ready(self, model: pb.ModelSummary, engine: Engine | None) -> None:
        with self._lock:
            self.engine = engine
            self.state, self.stage, self.progress, self.model = pb.INSTANCE_STATE_READY, "ready", 1.0, model

    def fail(self, error: str) -> None:
        with self._lock:
            self.state, self.stage, self.error = pb.INSTANCE_STATE_FAILED, "failed", error

    def status(self, device: Device) -> pb.RunnerStatus:
        snap = device.snapshot()
        with self._lock:
            return pb.RunnerStatus(
                instance_id=self.instance_id,
                state=self.state,
                progress=self.progress,
                stage=self.stage,
                error=self.error,
                model=self.model,
                queue_depth=snap["queue_depth"],
                running=snap["running"],
                pid=os.getpid(),
                shard=self.shard,
                generations=snap["generations"],
                ring_port=self.ring_port,
                prefix_cache=prefix_cache_figures(self.engine),
                prefix_summary=prefix_summary(self.engine),
                decode_bytes_per_s=self.decode_bytes_per_s,
            )


def prefix_cache_figures(engine: Engine | None) -> pb.PrefixCacheFigures | None:
    """The engine's prefix cache figures as the runner's status carries them (None: it has none)."""
    cache = getattr(engine, "prefix_cache", None)
    if cache is None:
        return None
    figures = cache.figures()
    return pb.PrefixCacheFigures(**{f.name: int(figures.get(f.name, 0)) for f in pb.PrefixCacheFigures.DESCRIPTOR.fields})


def prefix_summary(engine: Engine | None) -> pb.PrefixSummary | None:
    """What the engine's prefix cache holds, for the cluster's routers (None: it has none)."""
    cache = getattr(engine, "prefix_cache", None)
    if cache is None:
        return None
    s = cache.summary()
    return pb.PrefixSummary(namespace=s.namespace, block_tokens=s.block_tokens, positions=[p for p, _ in s.heads],
                            hashes=[h for _, h in s.heads], keys=list(s.keys))


class RunnerServicer(pb_grpc.RunnerServicer):
    def __init__(self, state: RunnerState, device: Device) -> None:
        self.state = state
        self.device = device

    def Status(self, request: pb.RunnerStatusRequest, context: grpc.ServicerContext) -> pb.RunnerStatus:
        return self.state.status(self.device)

    def JoinGroup(self, request: pb.JoinGroupRequest, context: grpc.ServicerContext) -> pb.JoinGroupReply:
        shard = self.state.shard
        if not self.state.pipelined or len(request.hosts) != shard.world_size:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"this runner is rank {shard.rank} of {shard.world_size}; got {len(request.hosts)} hosts")
        return pb.JoinGroupReply(accepted=self.state.join(list(request.hosts)))

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateChunk]:
        # Imported here: the engine takes seconds to import, which Status must not wait for.
        from exo.wire.convert import chunk_to_pb, error_chunk, error_to_pb, request_from_pb

        engine = self.state.engine
        if self.state.state != pb.INSTANCE_STATE_READY or engine is None:
            yield error_chunk("model_unavailable", f"instance {self.state.instance_id} is not ready ({self.state.stage})")
            return
        out: queue.SimpleQueue[pb.GenerateChunk | None] = queue.SimpleQueue()

        started = False

        def emit(item: object) -> None:
            nonlocal started
            if isinstance(item, Started):
                started = True
                out.put(pb.GenerateChunk(started=pb.Started(
                    prompt_tokens=item.prompt_tokens, max_tokens=item.max_tokens, queue_s=item.queue_s,
                    thinking=item.thinking)))
            elif isinstance(item, Failed):
                error = item.error
                if self.state.pipelined and pipeline_failed(engine):
                    # A stage (or the link to it) went away, or a call through the stages failed mid-way: this
                    # request (running, or waiting and dropped as the group ends) can be retried elsewhere.
                    when = "mid-generation" if started else "before this request ran"
                    what = "a member of the tensor group" if self.state.shard.sharding == "tensor" else "a pipeline stage"
                    error = NodeUnavailableError(
                        f"{what} of {request.model} was lost {when} ({type(error).__name__}: "
                        f"{error}); the instance is placed anew: retry shortly"
                    )
                out.put(error_to_pb(error))
            else:
                out.put(chunk_to_pb(item))  # type: ignore[arg-type]

        def on_done(finish: str, *_: object) -> None:
            # Only the pipeline's own failure ends the group (its stages are gone or may be out of step: the
            # daemon forms a new one); a request that failed alone (its consumer, its input) leaves it serving.
            if self.state.pipelined and pipeline_failed(engine):
                self.state.group_broken = True
                self.device.close()
            out.put(DONE)

        def on_device() -> Engine:
            if request.HasField("node_mtp"):  # the owning node's switch decides (we are between requests)
                engine.set_native_mtp(request.node_mtp.enabled, request.node_mtp.disabled_reason)
            return engine

        prompt, params = request_from_pb(request)
        timeout = request.timeout_s if request.timeout_s > 0 else DEFAULT_TIMEOUT_S
        job = GenerationJob(self.device, on_device, prompt, params, emit, timeout_s=timeout, on_done=on_done)
        try:
            self.device.submit(job)
        except QueueFullError as e:
            yield error_chunk("queue_full", str(e), retry_after_s=e.retry_after_s)
            return
        except RuntimeError as e:
            yield error_chunk("model_unavailable", str(e))
            return
        # The call ended (client gone, deadline): stop generating. False: it already ended before this line.
        if not context.add_callback(job.cancel):
            job.cancel()
        while True:
            try:
                item = out.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                yield pb.GenerateChunk(heartbeat=True)
                continue
            if item is DONE:
                return
            # Whatever else is ready goes in the same message (one write for several tokens).
            while _is_output(item):
                try:
                    following = out.get_nowait()
                except queue.Empty:
                    break
                if not _is_output(following):
                    yield item
                    item = following
                    break
                item.text += following.text
                item.token_ids.extend(following.token_ids)
                item.logprobs.extend(following.logprobs)
            if item is DONE:
                return
            yield item


def _is_output(item: pb.GenerateChunk | None) -> bool:
    """A piece of generated output still open for more (not started, error, heartbeat or the end)."""
    return (
        item is not None
        and not item.finish_reason
        and not item.HasField("error")
        and not item.HasField("started")
        and not item.heartbeat
    )


def start_server(socket_path: str, state: RunnerState, device: Device, max_workers: int) -> grpc.Server:
    """Serve on a unix socket (created with the runner's umask inside a directory only the user opens)."""
    if os.path.exists(socket_path):
        os.unlink(socket_path)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="exo-runner-rpc"),
        maximum_concurrent_rpcs=max_workers,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    pb_grpc.add_RunnerServicer_to_server(RunnerServicer(state, device), server)
    if server.add_insecure_port(f"unix:{socket_path}") == 0:
        raise OSError(f"cannot listen on unix socket {socket_path}")
    server.start()
    return server
