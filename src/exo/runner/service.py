"""The runner's gRPC service (``exo.v1.Runner``) on a unix socket: Status and Generate.

Handlers run on gRPC's thread pool and never touch MLX: Generate queues a job on the device (served by
the main thread) and relays its chunks, sending a heartbeat whenever nothing else flowed for
``HEARTBEAT_S`` so the caller can tell a slow generation from a dead runner.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import TYPE_CHECKING, Any

import grpc

from exo.wire.errors import NodeUnavailableError
from exo.wire.proto_gen import node_pb2 as pb
from exo.wire.proto_gen import node_pb2_grpc as pb_grpc
from exo.wire.runner import HEARTBEAT_S, MAX_MESSAGE_BYTES

from .device import Device, Failed, GenerationJob, QueueFullError, Started, pipeline_failed
from .outbox import Outbox

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
    def __init__(self, state: RunnerState, device: Device, stream_interval_s: float = 0.0) -> None:
        """``stream_interval_s``: a Generate stream's tokens go out at most this often (``runner.outbox``)."""
        self.state = state
        self.device = device
        self.stream_interval_s = stream_interval_s

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
        from exo.wire.convert import chunk_to_pb, error_to_pb, request_from_pb

        engine = self.state.engine
        if self.state.state != pb.INSTANCE_STATE_READY or engine is None:
            yield error_to_pb(NodeUnavailableError(f"instance {self.state.instance_id} is not ready ({self.state.stage})"))
            return
        # The device thread only queues what the job emits (Started, the engine's chunks, Failed): this handler's
        # thread turns them into messages, so the thread that builds the model's graphs spends nothing on the wire.
        out = Outbox(self.stream_interval_s)  # paced: the device thread wakes this one at most every interval
        started = False

        def message(item: object) -> pb.GenerateChunk:
            nonlocal started
            if isinstance(item, Started):
                started = True
                return pb.GenerateChunk(started=pb.Started(
                    prompt_tokens=item.prompt_tokens, max_tokens=item.max_tokens, queue_s=item.queue_s,
                    thinking=item.thinking))
            if isinstance(item, Failed):
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
                return error_to_pb(error)
            return chunk_to_pb(item)  # type: ignore[arg-type]

        def on_done(finish: str, *_: object) -> None:
            # Only the pipeline's own failure ends the group (its stages are gone or may be out of step: the
            # daemon forms a new one); a request that failed alone (its consumer, its input) leaves it serving.
            if self.state.pipelined and pipeline_failed(engine):
                self.state.group_broken = True
                self.device.close()
            out.put(DONE)

        def on_device() -> Engine:
            return engine

        prompt, params = request_from_pb(request)
        timeout = request.timeout_s if request.timeout_s > 0 else DEFAULT_TIMEOUT_S
        job = GenerationJob(self.device, on_device, prompt, params, out.put, timeout_s=timeout, on_done=on_done)
        try:
            self.device.submit(job)
        except QueueFullError as e:
            yield error_to_pb(e)
            return
        except RuntimeError as e:  # the device is closing
            yield error_to_pb(NodeUnavailableError(str(e)))
            return
        # The call ended (client gone, deadline): stop generating. False: it already ended before this line.
        if not context.add_callback(job.cancel):
            job.cancel()
        while True:
            # Everything in the box goes out together: a consumer that lags catches up in one write.
            items = out.take(HEARTBEAT_S)
            if not items:
                yield pb.GenerateChunk(heartbeat=True)
                continue
            for item in coalesced(items):
                if item is DONE:
                    return
                try:
                    reply = message(item)
                except Exception as e:  # noqa: BLE001 - what it could not say ends the request, as a typed error
                    job.cancel()
                    yield error_to_pb(e)
                    return
                yield reply


def coalesced(items: list[object]) -> Iterator[object]:
    """``items`` in order, each run of the engine's chunks in a row as one chunk (their text, tokens and
    logprobs joined; the run's last chunk's finish, stats and stop sequence)."""
    from exo.engine.request import GenerationChunk

    run: list[GenerationChunk] = []
    for item in items:
        if isinstance(item, GenerationChunk):
            run.append(item)
            if item.finish_reason is None:
                continue
        if run:
            yield run[0] if len(run) == 1 else _joined(run)
            run = []
        if not isinstance(item, GenerationChunk):
            yield item
    if run:
        yield run[0] if len(run) == 1 else _joined(run)


def _joined(chunks: list[Any]) -> Any:
    last = chunks[-1]
    logprobs = [e for c in chunks for e in c.logprobs or ()]
    return dataclasses.replace(last, text="".join(c.text for c in chunks), token_ids=[t for c in chunks for t in c.token_ids],
                               logprobs=logprobs if any(c.logprobs is not None for c in chunks) else None)


def start_server(socket_path: str, state: RunnerState, device: Device, max_workers: int,
                 stream_interval_s: float = 0.0) -> grpc.Server:
    """Serve on a unix socket (created with the runner's umask inside a directory only the user opens);
    ``stream_interval_s``: ``RunnerServicer``'s."""
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
    pb_grpc.add_RunnerServicer_to_server(RunnerServicer(state, device, stream_interval_s), server)
    if server.add_insecure_port(f"unix:{socket_path}") == 0:
        raise OSError(f"cannot listen on unix socket {socket_path}")
    server.start()
    return server
