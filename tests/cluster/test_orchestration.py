"""ClusterModelService's on-demand placement, in process (no daemon started): the race between placement,
which says another instance of the model is live, and the lookup of that instance, which no longer finds it
(its node left or it was deleted between the two looks)."""

from __future__ import annotations

import asyncio
import time

import pytest

from exo.cluster import placement as pl
from exo.cluster.orchestration import ClusterModelService
from exo.cluster.placing import PLACE_ATTEMPTS
from exo.cluster.service import NodeUnavailableError
from exo.settings import load_settings


@pytest.fixture
def service(tmp_path) -> ClusterModelService:
    return ClusterModelService(load_settings(env={"EXO_HOME": str(tmp_path)}))


def _phantom(service: ClusterModelService, looks: int | None):
    """``existing()`` as placement saw it: an instance of exo-demo that the cluster view (``find``) lacks,
    for the first ``looks`` looks (None: for good), then nothing."""
    seen = []

    def existing(excluding: frozenset[str] = frozenset()) -> list[pl.ExistingInstance]:
        seen.append(1)
        if looks is not None and len(seen) > looks:
            return []
        return [pl.ExistingInstance("vanished", "exo-demo", service.node_id, "ready")]

    service.view.existing = existing  # type: ignore[method-assign]
    return seen


def test_an_instance_that_stays_unfindable_is_a_503_not_an_unbound_plan(service):
    seen = _phantom(service, None)
    with pytest.raises(NodeUnavailableError, match="instance vanished .* cannot be found"):
        asyncio.run(service.placer.place_and_wait("exo-demo", None))
    assert len(seen) == PLACE_ATTEMPTS


def test_an_instance_that_went_away_is_placed_anew(service):
    seen = _phantom(service, 1)
    # Placed anew: this node (not started) has scanned no model yet, so placement itself answers.
    with pytest.raises(pl.ModelNotOnDiskError):
        asyncio.run(service.placer.place_and_wait("exo-demo", None))
    assert len(seen) == 2


def test_a_reference_unknown_here_is_looked_up_in_the_cluster_on_the_event_loop(service):
    """``acquire`` resolves a reference in a worker thread (it may read the disk); the fallback that asks the
    cluster (``located()``, which prunes the routes and recent starts while the loop reassigns them) must run
    on the loop's thread, never beside it."""
    import threading

    from exo.cards import UnknownModelError

    threads: list[int] = []
    located = service.view.located

    def recording():
        threads.append(threading.get_ident())
        return located()

    service.view.located = recording  # type: ignore[method-assign]

    async def main() -> int:
        with pytest.raises(UnknownModelError):
            await service.acquire("no-such-model-anywhere", 1.0)
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert threads and set(threads) == {loop_thread}


class _Call:
    """A ``Generate`` call's client side (the gRPC edge): the messages it will read, then silence until
    cancelled, as a runner that is still generating."""

    def __init__(self, messages) -> None:
        self.messages = list(messages)
        self.cancelled = False

    async def read(self):
        if self.messages:
            return self.messages.pop(0)
        await asyncio.Event().wait()  # a stream that is still running

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def _finishes(service, messages, *, disconnect: bool) -> dict[str, float]:
    from exo.cluster.router import RemoteGenerationStream
    from exo.cluster.views import Located
    from exo.wire.proto_gen import node_pb2 as pb

    call = _Call(messages)
    service.router.open_call = lambda located, request, timeout: call  # type: ignore[method-assign]

    async def main() -> None:
        located = Located(service.node_id, pb.Instance(instance_id="i1", model_id="exo-demo"))
        stream = RemoteGenerationStream(service.router, located, pb.GenerateRequest(request_id="r1", model="exo-demo"),
                                        timeout_s=60.0, arrived=time.monotonic())
        for _ in range(20):
            await asyncio.sleep(0)  # the pump reads what there is
        if disconnect:
            stream.cancel()
        await asyncio.gather(stream._task, return_exceptions=True)
        assert call.cancelled == disconnect

    asyncio.run(main())
    registry = service.metrics.registry
    return {reason: registry.get_sample_value("exo_generations_total", {"model": "exo-demo", "finish_reason": reason})
            or 0.0 for reason in ("cancelled", "error", "rejected", "timeout")}


def test_a_client_that_disconnects_is_a_cancelled_generation_not_an_error(service):
    from exo.wire.proto_gen import node_pb2 as pb

    messages = [pb.GenerateChunk(started=pb.Started(prompt_tokens=3, max_tokens=8)),
                pb.GenerateChunk(text="hi", token_ids=[5])]
    assert _finishes(service, messages, disconnect=True) == {"cancelled": 1, "error": 0, "rejected": 0, "timeout": 0}


def test_an_error_after_the_stream_started_is_an_error_and_before_it_a_rejection(service):
    from exo.wire.convert import error_chunk
    from exo.wire.proto_gen import node_pb2 as pb

    started = pb.GenerateChunk(started=pb.Started(prompt_tokens=3, max_tokens=8))
    failed = error_chunk("node_unavailable", "a stage of the pipeline is gone")
    mid = _finishes(service, [started, pb.GenerateChunk(text="hi", token_ids=[5]), failed], disconnect=False)
    assert mid == {"cancelled": 0, "error": 1, "rejected": 0, "timeout": 0}
    before = _finishes(service, [failed], disconnect=False)
    assert before == {"cancelled": 0, "error": 1, "rejected": 1, "timeout": 0}


def test_a_routed_prompt_is_tokenized_once(service, checkpoint, monkeypatch):
    """Routing among instances tokenizes the prompt as the runner would (``prompt_tokens``) and the request carries
    those tokens (``rendered``): the runner reads them, it does not tokenize the prompt again."""
    from exo.cluster import routing
    from exo.cluster.views import Located
    from exo.engine import Engine, load_checkpoint, resolve_model
    from exo.engine import prompt as prompt_module
    from exo.engine.prompt import GenerateParams, Prompt, generation_request, prompt_tokens
    from exo.wire.convert import generate_request, request_from_pb
    from exo.wire.proto_gen import node_pb2 as pb

    path = checkpoint("qwen3_5")
    model_id = service.register(resolve_model(str(path)))
    prompt = Prompt(messages=[{"role": "user", "content": "Where is the prefix cache?"}])
    params = GenerateParams(max_tokens=4, default_max_tokens=4)
    request = generate_request(model_id, "", prompt, params, timeout_s=10.0)
    candidates = [routing.Candidate(Located(node, pb.Instance(instance_id=f"i-{node}", model_id=model_id)), 0,
                                    node == service.node_id) for node in (service.node_id, "another-node")]
    service.router._route(model_id, candidates, prompt, params, request)
    engine = Engine(load_checkpoint(path))
    expected = prompt_tokens(engine.loaded.tokenizer, prompt, params)
    assert list(request.rendered.ids) == expected
    runner_prompt, runner_params = request_from_pb(type(request).FromString(request.SerializeToString()))

    def tokenized_again(*args, **kwargs):
        raise AssertionError("the runner tokenized a prompt that came with its tokens")

    monkeypatch.setattr(prompt_module, "prompt_tokens", tokenized_again)
    assert list(generation_request(engine, runner_prompt, runner_params).prompt_tokens) == expected
