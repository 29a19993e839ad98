"""One table answers every error a client can see (``exo.wire.errors.ERRORS``), in every dialect.

Each row's exception is raised where a real app asks the model service for its model (the service is the
API's outer edge), and every dialect must answer it with the row's status, code, param and Retry-After in
its own shape; the rows that cross between nodes must come back from the wire as the same answer."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx2 as httpx
import pytest

from exo.api import BackgroundServer, LocalModelService, build_app
from exo.api.dialects import anthropic_error_type
from exo.api.errors import api_error_from
from exo.cards import AmbiguousModelError, CardError, UnknownModelError
from exo.cluster.placement import ExistingInstance
from exo.settings import load_settings
from exo.wire import errors as we
from exo.wire.convert import error_from_pb, error_to_pb
from exo.wire.proto_gen import node_pb2 as pb

MESSAGE = "what went wrong"


def _raise(cls: type[BaseException]) -> BaseException:
    """An instance of a row's exception, built as the code that raises it builds it."""
    special: dict[type[BaseException], Any] = {
        UnknownModelError: lambda: UnknownModelError("nope", []),
        AmbiguousModelError: lambda: AmbiguousModelError("nope", ["a", "b"]),
        CardError: lambda: CardError(None, "arch", MESSAGE),
        we.QueueFullError: lambda: we.QueueFullError(3, 7),
        we.InstanceFailedError: lambda: we.InstanceFailedError(pb.Instance(instance_id="i1", model_id="m")),
        we.AlreadyPlacedError: lambda: we.AlreadyPlacedError(ExistingInstance("i1", "m", "n1", "ready")),
        we.UnknownNodeError: lambda: we.UnknownNodeError("n9", ["n1"]),
        we.InsufficientDiskError: lambda: we.InsufficientDiskError(MESSAGE, 10, 1),
        we.DownloadConflictError: lambda: we.DownloadConflictError(MESSAGE, "d1"),
        we.ContextLengthError: lambda: we.ContextLengthError(MESSAGE, "max_tokens"),
        we.GenerationRequestError: lambda: we.GenerationRequestError(MESSAGE, param="mtp_k"),
        we.SamplingParamsError: lambda: we.SamplingParamsError("top_p must be in (0, 1], got 2"),
    }
    return special.get(cls, lambda: cls(MESSAGE))()


ROWS = [pytest.param(row, id=row.exception.__name__) for row in we.ERRORS]


class _Failing(LocalModelService):
    """The real local service, except that asking for a model raises what the test sets."""

    error: BaseException | None = None

    async def acquire(self, model: str | None, timeout: float) -> str:
        assert self.error is not None
        raise self.error


@pytest.fixture(scope="module")
def app(tmp_path_factory) -> Iterator[tuple[httpx.Client, _Failing]]:
    settings = load_settings(env={"EXO_HOME": str(tmp_path_factory.mktemp("exo-home"))})
    service = _Failing(settings)
    server = BackgroundServer(build_app(settings, service=service)).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            yield client, service
    finally:
        server.stop()


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
DIALECTS = {
    "openai": ("/v1/chat/completions", CHAT),
    "completions": ("/v1/completions", {"model": "m", "prompt": "hi"}),
    "responses": ("/v1/responses", {"model": "m", "input": "hi"}),
    "anthropic": ("/v1/messages", {**CHAT, "max_tokens": 8}),
    "ollama": ("/api/chat", {**CHAT, "stream": False}),
}


@pytest.mark.parametrize("row", ROWS)
def test_every_row_is_answered_with_its_status_in_every_dialect(app, row):
    client, service = app
    exc = _raise(row.exception)
    assert we.row_of(exc) is row, "a row above this one shadows it"
    service.error = exc
    expected = api_error_from(exc)
    assert (expected.status, expected.type, expected.code) == (row.status, row.type, row.code_of(exc))
    retry = row.retry_after(exc)
    for dialect, (path, body) in DIALECTS.items():
        response = client.post(path, json=body)
        assert response.status_code == row.status, (dialect, response.text)
        assert response.headers.get("Retry-After") == (str(retry) if retry else None), dialect
        got = response.json()
        if dialect == "anthropic":
            assert got == {"type": "error", "error": {"type": anthropic_error_type(row.status),
                                                      "message": expected.message}}
        elif dialect == "ollama":
            assert got == {"error": expected.message}
        else:
            assert got == {"error": {"message": expected.message, "type": row.type,
                                     "param": row.param_of(exc), "code": row.code_of(exc)}}, dialect


@pytest.mark.parametrize("row", [r for r in ROWS if r.values[0].wire])
def test_a_row_that_crosses_the_wire_is_answered_the_same_on_the_other_node(row):
    exc = _raise(row.exception)
    crossed = error_from_pb(error_to_pb(exc).error)
    assert type(crossed) is row.exception
    here, there = api_error_from(exc), api_error_from(crossed)
    assert (here.status, here.code, here.param, here.message, here.headers) == (
        there.status, there.code, there.param, there.message, there.headers)


def test_an_exception_without_a_row_is_a_500_naming_its_type(app):
    client, service = app
    service.error = KeyError("k")
    response = client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "internal_error" and "KeyError" in response.json()["error"]["message"]
    crossed = error_from_pb(error_to_pb(KeyError("k")).error)
    assert type(crossed) is RuntimeError and str(crossed) == "KeyError: k"


def test_a_download_error_is_answered_from_the_table(app):
    client, _ = app
    response = client.get("/v1/downloads/nope")
    assert response.status_code == 404 and response.json()["error"]["code"] == "download_not_found"
    assert response.json()["error"]["param"] == "id"
