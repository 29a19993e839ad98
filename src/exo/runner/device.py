"""The runner's device loop: generation jobs run one at a time, in FIFO order, on the MAIN thread.

gRPC handler threads only queue jobs and relay their chunks (a ``queue.SimpleQueue`` per job); every
MLX call happens on the thread that loaded the model, which is the process's main thread and so never
exits before the interpreter (a thread that ran MLX can abort the process when it exits during
interpreter shutdown).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from exo.cluster.proto_gen import node_pb2 as pb

if TYPE_CHECKING:  # the engine (mlx-lm, transformers: seconds) is imported by the load, not before Status serves
    from exo.engine import Engine

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
DONE = None  # the last item of a job's output queue


class QueueFullError(RuntimeError):
    """The device's request queue is full; retry after ``retry_after_s`` (the API's 429 too)."""

    def __init__(self, waiting: int, retry_after_s: int) -> None:
        super().__init__(f"the request queue is full ({waiting} requests waiting); retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


class GenerationJob:
    """One Generate call: its request, its output queue (pb chunks, then DONE), its cancellation."""

    def __init__(self, request: pb.GenerateRequest, device: Device) -> None:
        self.request = request
        self.device = device
        self.received = time.monotonic()
        timeout = request.timeout_s if request.timeout_s > 0 else DEFAULT_TIMEOUT_S
        self.timeout_s = timeout
        self.deadline = self.received + timeout
        self.out: queue.SimpleQueue[pb.GenerateChunk | None] = queue.SimpleQueue()
        self.tokens = 0
        self._cancel = threading.Event()

    def cancel(self) -> None:
        """Any thread (the RPC ended: client gone, deadline): leave the queue, or stop at the next step."""
        if not self._cancel.is_set():
            self._cancel.set()
            if self.device.discard(self):
                self.out.put(DONE)

    def should_stop(self) -> bool:
        if self._cancel.is_set():
            return True
        if time.monotonic() > self.deadline:
            self._cancel.set()
            return True
        return False

    def run(self, engine: Engine) -> None:
        try:
            self._run(engine)
        finally:
            self.out.put(DONE)

    def _run(self, engine: Engine) -> None:
        from exo.engine import GenerationRequest, SamplingParams

        from .prompt import completion_budget, tokenize
        from .wire import chunk_to_pb, error_chunk, error_to_pb, sampling_from_pb

        req = self.request
        queue_s = time.monotonic() - self.received
        if self._cancel.is_set():
            return
        if time.monotonic() > self.deadline:
            self.out.put(error_chunk("timeout", f"the request waited {queue_s:.1f} s for the device and timed out"))
            return
        if req.HasField("node_mtp"):
            switch = (req.node_mtp.enabled, req.node_mtp.disabled_reason)
            if (engine.config.native_mtp_enabled, engine.config.disabled_reason) != switch:
                # Between requests (this is the device thread): the next generation sees the owner's switch.
                engine.config = dataclasses.replace(
                    engine.config, native_mtp_enabled=switch[0], disabled_reason=switch[1]
                )
        try:
            kind = req.WhichOneof("prompt")
            messages = [{"role": m.role, "content": m.content} for m in req.messages.messages] if kind == "messages" else None
            tokens = tokenize(
                engine.loaded.tokenizer,
                messages=messages,
                text=req.text if kind == "text" else None,
                token_ids=list(req.token_ids.ids) if kind == "token_ids" else None,
                template_kwargs=json.loads(req.template_kwargs_json) if req.template_kwargs_json else None,
            )
            param = "messages" if kind == "messages" else "prompt"
            max_tokens = completion_budget(
                engine,
                len(tokens),
                req.max_tokens if req.HasField("max_tokens") else None,
                req.default_max_tokens,
                param,
            )
            request = GenerationRequest(
                prompt_tokens=tokens,
                max_tokens=max_tokens,
                # An absent message means the defaults (its zero values would read as top_p=0).
                sampling=sampling_from_pb(req.sampling) if req.HasField("sampling") else SamplingParams(),
                stop=tuple(req.stop),
                native_mtp=req.native_mtp or "auto",  # type: ignore[arg-type]
                mtp_k=req.mtp_k if req.HasField("mtp_k") else None,
                should_stop=self.should_stop,
            )
            chunks = engine.generate(request)
        except Exception as e:
            self.out.put(error_to_pb(e))
            return
        self.out.put(pb.GenerateChunk(started=pb.Started(prompt_tokens=len(tokens), max_tokens=max_tokens, queue_s=queue_s)))
        try:
            for chunk in chunks:
                self.tokens += len(chunk.token_ids)
                self.out.put(chunk_to_pb(chunk))
        except Exception as e:
            log.exception("generation failed")
            self.out.put(error_to_pb(e))


class Device:
    """A FIFO of generation jobs, served by whichever thread calls ``serve`` (the main thread)."""

    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self._jobs: collections.deque[GenerationJob] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self.running: GenerationJob | None = None
        self.generations = 0
        self._job_seconds = 1.0  # moving average, for Retry-After

    @property
    def waiting(self) -> int:
        return len(self._jobs)

    def submit(self, job: GenerationJob) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError("the runner is shutting down")
            if len(self._jobs) >= self.max_queue:
                retry = max(1, math.ceil(self._job_seconds * (len(self._jobs) + 1)))
                raise QueueFullError(len(self._jobs), retry)
            self._jobs.append(job)
            self._cv.notify()

    def discard(self, job: GenerationJob) -> bool:
        with self._cv:
            try:
                self._jobs.remove(job)
            except ValueError:
                return False
            return True

    def close(self) -> None:
        """Any thread or a signal handler: stop after the running job (which is cancelled)."""
        with self._cv:
            self._closed = True
            dropped = list(self._jobs)
            self._jobs.clear()
            running = self.running
            self._cv.notify_all()
        from .wire import error_chunk

        for job in dropped:
            job.out.put(error_chunk("internal", "the runner is shutting down"))
            job.out.put(DONE)
        if running is not None:
            running.cancel()

    def serve(self, engine: Engine) -> None:
        """Run jobs until ``close()``; call it on the thread that loaded the model."""
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self.running = self._jobs.popleft()
            start = time.perf_counter()
            try:
                job.run(engine)
            except Exception:  # a job reports its own errors; this keeps the device alive
                log.exception("device job failed")
            finally:
                with self._cv:
                    self.running = None
                    self.generations += 1
                self._job_seconds = 0.8 * self._job_seconds + 0.2 * (time.perf_counter() - start)

    def snapshot(self) -> dict[str, Any]:
        with self._cv:
            return {"queue_depth": len(self._jobs), "running": 1 if self.running is not None else 0,
                    "generations": self.generations}
