"""Schema-driven fuzzing (schemathesis) of every operation in /openapi.json: no 5xx, responses as documented."""

from __future__ import annotations

import os
import time

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from .conftest import short_context_copy

EXAMPLES = int(os.environ.get("EXO_FUZZ_EXAMPLES", "25"))  # per operation and mode: bounded, the whole run takes seconds
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


def fuzz_operations(operations: list, mode: GenerationMode, base_url: str, examples: int) -> None:
    """Every operation, ``examples`` generated cases each, all CHECKS on every response."""
    for operation in operations:

        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def run(case) -> None:
            case.call_and_validate(base_url=base_url, checks=CHECKS)

        run()


@pytest.fixture(scope="module")
def fuzz_server(make_server, model_dir, tmp_path_factory):
    # A declared context of 64 tokens bounds every generation the fuzzer can ask for.
    model = short_context_copy(model_dir, tmp_path_factory.mktemp("fuzz") / "short-context", 64)
    # EXO_OFFLINE: POST /v1/downloads never reaches the network (a made-up repo id is a 404, not a download).
    return make_server(model, env={"EXO_REQUEST_TIMEOUT_S": "5", "EXO_OFFLINE": "1"})


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_fuzz_every_operation(fuzz_server, mode):
    with fuzz_server.http() as http:
        document = http.get("/openapi.json").json()
    schema = schemathesis.openapi.from_dict(document)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 25
    if mode == GenerationMode.NEGATIVE:  # only bodies can be invalid (path parameters are any string)
        operations = [op for op in operations if "requestBody" in op.definition.raw]
        assert len(operations) == 10
    start = time.monotonic()
    fuzz_operations(operations, mode, fuzz_server.url, EXAMPLES)
    assert time.monotonic() - start < 60
    with fuzz_server.http() as http:  # still serving
        assert http.post("/v1/completions", json={"prompt": "The", "max_tokens": 4}).status_code == 200


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]}),
        ("/v1/completions", {"prompt": "0 0 0"}),
    ],
)
@pytest.mark.parametrize("include_usage", [False, True])
def test_streams_match_the_documented_event_schema(fuzz_server, path, body, include_usage):
    # The fuzzer reaches a successful stream only by chance; check every event of real streams here.
    with fuzz_server.http() as http:
        schema = schemathesis.openapi.from_dict(http.get("/openapi.json").json())
    stream = {"stream": True, "max_tokens": 8, "temperature": 0, **body}
    if include_usage:
        stream["stream_options"] = {"include_usage": True}
    case = schema[path]["POST"].Case(body=stream)
    response = case.call_and_validate(base_url=fuzz_server.url, checks=[response_schema_conformance])
    assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
