"""Routing a generation: to the one ready instance of its model, or among several to the one holding the
longest cached prefix of its prompt (``routing``); the generation then streams from that instance's runner
(this node's, or another node's through its ``Generate`` stream), a stream that delivers nothing for
``STREAM_IDLE_S`` ending with an error, never a hang. Also counting a prompt's tokens where the model's files
are on this node."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import grpc
from mlx_lm.utils import load_tokenizer

from exo.cards import UnknownModelError
from exo.engine import ModelNotAvailableError
from exo.engine.prefix_cache import key_hash, message_starts
from exo.engine.prompt import prompt_tokens, tokenize
from exo.metrics import Metrics
from exo.settings import Settings
from exo.wire.convert import chunk_from_pb, error_from_pb, generate_request
from exo.wire.proto_gen import node_pb2 as pb

from . import routing
from .calls import rpc_error
from .cluster_view import ClusterView
from .models import LocalModels
from .node import ClusterNode
from .service import (
    DEADLINE_GRACE_S,
    BatchedStream,
    Failed,
    GenerateParams,
    NodeUnavailableError,
    Prompt,
    RequestTimeoutError,
    Started,
)
from .supervisor import InstanceFailedError, UnknownInstanceError
from .views import Located

log = logging.getLogger(__name__)

# A generation stream that delivers nothing (runners send a heartbeat every 2 s) for this long means
# the node or its runner stopped answering.
STREAM_IDLE_S = 10.0
TOKENIZERS_KEPT = 4  # count_tokens' tokenizers kept in the API process (a few MB each), most recent first


class Router:
    """``last_used``: instance id -> when a generation last went there (the placer's eviction order)."""

    def __init__(self, view: ClusterView, node: ClusterNode, models: LocalModels, settings: Settings,
                 metrics: Metrics, last_used: dict[str, float]) -> None:
        self.view = view
        self.node = node
        self.models = models
        self.settings = settings
        self.metrics = metrics
        self.last_used = last_used
        self.streams: set[RemoteGenerationStream] = set()
        # count_tokens' tokenizers: (model id, its directory) -> the tokenizer, loaded in this process
        self._tokenizers: OrderedDict[tuple[str, str], tuple[Any, threading.Lock]] = OrderedDict()
        self._tokenizers_lock = threading.Lock()
        self._recent_routes = routing.Recent()  # what this node's router sent where lately
        self._message_starts: dict[str, frozenset[int]] = {}  # model id -> its chat templates' message starts

    async def count_prompt_tokens_here(self, model: str, prompt: Prompt) -> int | None:
        """The prompt's tokens as a generation reads them (the chat template and tokenizer that the runner
        loads, through the same ``tokenize``), counted in this process when the model's files are on this
        node: no device, no runner, no queue. None when they are not here (the caller asks the owner)."""
        here = await asyncio.to_thread(self._tokenizer_here, model)
        if here is None:
            return None
        tokenizer, lock = here

        def count() -> int:
            with lock:  # a fast tokenizer is not safe to use from two threads at once
                return len(tokenize(
                    tokenizer, messages=prompt.messages, text=prompt.text, token_ids=prompt.token_ids,
                    template_kwargs=prompt.template_kwargs, tools=prompt.tools,
                ))

        return await asyncio.to_thread(count)

    def _tokenizer_here(self, ref: str) -> tuple[Any, threading.Lock] | None:
        """The model's tokenizer from this node's disk (cached, bounded) with the lock its users take, or None
        if its files are elsewhere (or unknown here: the generation path then answers as for any request)."""
        try:
            resolved = self.models.resolve(ref)
        except (ModelNotAvailableError, UnknownModelError):
            return None
        key = (resolved.model_id, str(resolved.path))
        with self._tokenizers_lock:  # one load at a time: a burst of counts loads a model's tokenizer once
            kept = self._tokenizers.get(key)
            if kept is not None:
                self._tokenizers.move_to_end(key)
                return kept
            try:
                tokenizer = load_tokenizer(resolved.path)  # as the runner's loader does (engine/loader.py)
            except Exception as e:  # noqa: BLE001 - files incomplete or unreadable here: the owner counts
                log.warning("count_tokens: %s's tokenizer did not load here (%s); asking its runner", ref, e)
                return None
            kept = self._tokenizers[key] = (tokenizer, threading.Lock())
            while len(self._tokenizers) > TOKENIZERS_KEPT:
                self._tokenizers.popitem(last=False)
            return kept

    def candidates(self, model_id: str) -> list[routing.Candidate]:
        """The model's ready instances (pipelines: their leaders), with their load as last reported or as this
        node's own streams to them say, whichever is more."""
        single, pipelines = self.view.instances()
        ready = [loc for loc in single if loc.instance.model_id == model_id]
        ready += [self.view.pipeline_located(p) for p in pipelines if p.model_id == model_id]
        ready = [loc for loc in ready if loc.instance.state == pb.INSTANCE_STATE_READY]
        streams: dict[str, int] = {}
        for stream in self.streams:
            streams[stream.instance_id] = streams.get(stream.instance_id, 0) + 1
        return [routing.Candidate(loc, max(loc.instance.queue_depth + loc.instance.running,
                                           streams.get(loc.instance.instance_id, 0)), loc.node_id == self.view.node_id)
                for loc in ready]

    def _route(self, model_id: str, candidates: list[routing.Candidate], prompt: Prompt, params: GenerateParams,
               request: pb.GenerateRequest) -> Located:
        """Several ready instances: the one holding the prompt's longest cached prefix (``routing``). Runs in a
        worker thread: it tokenizes the prompt as the runner would (``prompt_tokens``), and ``request`` then
        carries those tokens (``rendered``), so the runner does not tokenize it again."""
        tokens = None
        starts: frozenset[int] = frozenset()
        here = self._tokenizer_here(model_id)
        if here is not None:
            tokenizer, lock = here
            try:
                with lock:
                    tokens = prompt_tokens(tokenizer, prompt, params)
                    starts = self._message_starts.get(model_id) or self._message_starts.setdefault(
                        model_id, message_starts(tokenizer))
            except Exception:  # noqa: BLE001 - a prompt the owner will refuse: any instance answers that
                tokens = None
        if tokens is not None:
            request.rendered.CopyFrom(pb.TokenIds(ids=tokens))
        key = request.prompt_cache_key or None  # as the runner reads it (made UTF-8 safe)
        choice = routing.choose(candidates, tokens, key, self._recent_routes)
        # Until its summary says so (~2.5 s), read what the chosen instance will store as held.
        reported = routing.summary_from_pb(choice.located.instance.prefix_summary)
        heads = routing.stored_heads(tokens, reported, starts, self.settings.prefix_cache_stride_tokens) if tokens else []
        self._recent_routes.add(choice.located.instance.instance_id, heads, key_hash(key) if key else None)
        log.debug("routed to %s on %s: %d cached tokens%s", choice.located.instance.instance_id,
                  choice.located.node_id[:8], choice.held_tokens, " (prompt_cache_key)" if choice.by_key else "")
        return choice.located

    def generate(
        self, model_id: str, prompt: Prompt, params: GenerateParams, *, timeout_s: float, arrived: float
    ) -> RemoteGenerationStream:
        candidates = self.candidates(model_id)
        if not candidates:
            raise NodeUnavailableError(f"no ready instance of {model_id} in the cluster (it went away)")
        remaining = max(0.001, arrived + timeout_s - time.monotonic())
        located = candidates[0].located
        request = generate_request(model_id, located.instance.instance_id, prompt, params, remaining)
        route = None
        if len(candidates) > 1:
            route = functools.partial(self._route, model_id, candidates, prompt, params, request)
        else:
            self.last_used[located.instance.instance_id] = time.monotonic()
        stream = RemoteGenerationStream(self, located, request, timeout_s=timeout_s, arrived=arrived, route=route)
        self.streams.add(stream)
        return stream

    def open_call(self, located: Located, request: pb.GenerateRequest, timeout: float) -> grpc.aio.UnaryStreamCall:
        if located.node_id == self.view.node_id:
            try:
                return self.node.generate_local(request, timeout=timeout)
            except (UnknownInstanceError, InstanceFailedError) as e:  # gone or restarting since acquire()
                message = str(e.args[0]) if isinstance(e, LookupError) and e.args else str(e)
                raise NodeUnavailableError(message) from None
        peer = self.view.peer(located.node_id)
        return peer.stub.Generate(
            request, timeout=timeout, metadata=self.node.registry.metadata("/exo.v1.Node/Generate")
        )


class RemoteGenerationStream(BatchedStream):
    """A generation on a runner (this node's or another's), with ``GenerationStream``'s interface."""

    def __init__(
        self,
        router: Router,
        located: Located,
        request: pb.GenerateRequest,
        *,
        timeout_s: float,
        arrived: float,
        route: Callable[[], Located] | None = None,
    ) -> None:
        self.id = request.request_id
        self.router = router
        self.model_id = request.model
        self.instance_id = located.instance.instance_id
        self.timeout_s = timeout_s
        self.deadline = arrived + timeout_s
        self.finished = False
        self.tokens = 0
        self._items: asyncio.Queue[Any] = asyncio.Queue()
        self._pending: list[Any] = []
        self._error = None
        self._request = request
        self._default = located
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._cancelled = False  # cancel(): the client went away (a call cancelled otherwise is a failure)
        self._where = "this node"
        if route is None:
            self._open(located)
        self._task = asyncio.get_running_loop().create_task(self._pump(route))

    def _open(self, located: Located) -> None:
        self.instance_id = self._request.instance_id = located.instance.instance_id
        remaining = max(0.001, self.deadline - time.monotonic())
        self._call = self.router.open_call(located, self._request, remaining + DEADLINE_GRACE_S)
        self._where = "this node" if located.node_id == self.router.view.node_id else f"node {located.node_id[:8]}"

    def cancel(self) -> None:
        self._cancelled = True
        if self._call is not None:
            self._call.cancel()
        self._task.cancel()
        self.router.streams.discard(self)

    async def _pump(self, route: Callable[[], Located] | None = None) -> None:
        # The finish reason for the metrics, as a runner's job counts it: "rejected" only before the stream
        # started (the request never ran), "error" after, "cancelled" when the client went away (cancel()).
        finish, stats, started = "error", None, False
        try:
            if route is not None:  # several instances: the choice tokenizes the prompt, off the event loop
                located = self._default
                try:
                    located = await asyncio.to_thread(route)
                except Exception:  # noqa: BLE001 - routing is a hint: the default candidate serves
                    log.exception("routing failed; sending to the default instance")
                try:
                    self.router.last_used[located.instance.instance_id] = time.monotonic()
                    self._open(located)
                except Exception as e:  # noqa: BLE001 - what generate() would have raised: the handler's error
                    self._items.put_nowait(Failed(e))
                    finish = "rejected"
                    return
            assert self._call is not None
            while True:
                try:
                    async with asyncio.timeout(STREAM_IDLE_S):  # no task per read (unlike wait_for)
                        msg = await self._call.read()
                except TimeoutError:
                    self._items.put_nowait(
                        Failed(NodeUnavailableError(f"{self._where} stopped answering for {STREAM_IDLE_S:g} s"))
                    )
                    return
                if msg is grpc.aio.EOF:
                    self._items.put_nowait(Failed(NodeUnavailableError(f"{self._where} ended the stream early")))
                    return
                if msg.heartbeat:
                    continue
                if msg.HasField("error"):
                    self._items.put_nowait(Failed(error_from_pb(msg.error)))
                    finish = "error" if started else "rejected"
                    return
                if msg.HasField("started"):
                    started = True
                    s = msg.started
                    self._items.put_nowait(Started(s.prompt_tokens, s.max_tokens, s.queue_s, s.thinking))
                    continue
                chunk = chunk_from_pb(msg)
                self.tokens += len(chunk.token_ids)
                self._items.put_nowait(chunk)
                if chunk.finish_reason is not None:
                    finish, stats = chunk.finish_reason, chunk.stats
                    return
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self._items.put_nowait(Failed(RequestTimeoutError(
                    f"the request exceeded the server's request timeout of {self.timeout_s:g} s")))
            elif e.code() != grpc.StatusCode.CANCELLED:
                self._items.put_nowait(Failed(rpc_error(e, self._where)))
            elif not self._cancelled:
                # Cancelled, but not by us: the channel under it closed (this node's runner died and its
                # supervisor closed the channel before the call saw the socket go).
                self._items.put_nowait(Failed(NodeUnavailableError(
                    f"the instance on {self._where} went away mid-generation ({e.details() or 'cancelled'}); "
                    "retry shortly")))
            finish = "cancelled" if self._cancelled else "error"
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._cancelled or (task is not None and task.cancelling()):  # cancel(): the client went away
                finish = "cancelled"
                raise
            # The call, not this task, was cancelled: grpc.aio raises this from a read when the channel under
            # it closed (this node's runner died and its supervisor closed the channel): a failure to report.
            self._items.put_nowait(Failed(NodeUnavailableError(
                f"the instance on {self._where} went away mid-generation; retry shortly")))
        except Exception as e:  # anything else: the handler waiting for items must get an end, not hang
            log.exception("relaying a generation from %s failed", self._where)
            self._items.put_nowait(Failed(NodeUnavailableError(
                f"relaying the generation from {self._where} failed ({type(e).__name__}: {e})")))
        finally:
            self.router.streams.discard(self)
            if finish == "cancelled" and time.monotonic() > self.deadline:
                finish = "timeout"
            self.router.metrics.record_generation(self.model_id, finish, stats)

    def _put_back(self, items: list[Any]) -> None:
        self._pending = items + self._pending

    async def _take(self) -> list[Any]:
        if self._pending:
            items, self._pending = self._pending, []
            return items
        remaining = self.deadline + DEADLINE_GRACE_S - time.monotonic()
        try:
            items = [await asyncio.wait_for(self._items.get(), max(0.0, remaining))]
        except TimeoutError:
            self.cancel()
            raise RequestTimeoutError(
                f"the request exceeded the server's request timeout of {self.timeout_s:g} s"
            ) from None
        while not self._items.empty():
            items.append(self._items.get_nowait())
        return items
