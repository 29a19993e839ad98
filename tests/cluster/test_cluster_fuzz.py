"""Schema-driven fuzzing of a cluster node (``exo serve``): every operation of its /openapi.json, the
cluster's endpoints included, answers as documented and never with a 5xx."""

from __future__ import annotations

import os

import pytest
import schemathesis
from api.test_fuzz import fuzz_operations  # tests/ is on sys.path (rootdir-relative test packages)
from schemathesis import GenerationMode

from .daemons import Daemon

EXAMPLES = int(os.environ.get("EXO_FUZZ_EXAMPLES", "15"))
pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def node(checkpoint, tmp_path_factory):
    from api.conftest import short_context_copy  # tests/ is on sys.path (rootdir-relative test packages)

    root = tmp_path_factory.mktemp("fuzz-node")
    model = short_context_copy(checkpoint("qwen3_5"), root / "short-context", 64)
    # EXO_OFFLINE: POST /v1/downloads never reaches the network (a made-up repo id is a 404, not a download).
    daemon = Daemon(root / "home", "fuzz", extra_args=["--model", str(model)], env={"EXO_OFFLINE": "1"})
    daemon.start()
    daemon.wait_up(180)
    try:
        yield daemon
    finally:
        daemon.stop()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_fuzz_every_operation_of_a_cluster_node(node, mode):
    schema = schemathesis.openapi.from_dict(node.get("/openapi.json").json())
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/cluster", "/v1/instances", "/v1/instances/preview", "/v1/instances/{id}", "/v1/downloads"} <= paths
    assert len(operations) == 31
    if mode == GenerationMode.NEGATIVE:
        operations = [op for op in operations if "requestBody" in op.definition.raw]
        assert len(operations) == 11
    fuzz_operations(operations, mode, node.url, EXAMPLES)
    assert node.post("/v1/completions", {"prompt": "The", "max_tokens": 4}).status_code == 200
    assert node.process is not None and node.process.poll() is None
