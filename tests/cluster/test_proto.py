"""The committed gRPC stubs are exactly what scripts/gen_proto.py derives from proto/exo/v1/node.proto; a request
crosses them whole."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "src" / "exo" / "wire" / "proto_gen"


def _gen_proto():
    spec = importlib.util.spec_from_file_location("exo_gen_proto", ROOT / "scripts" / "gen_proto.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stubs_are_fresh(tmp_path):
    gen = _gen_proto()
    written = gen.generate(tmp_path / "proto_gen")
    names = sorted(p.name for p in written)
    assert names == sorted(["__init__.py", *gen.GENERATED])
    committed = sorted(p.name for p in COMMITTED.iterdir() if p.is_file())
    assert committed == names, f"stale stubs: run python scripts/gen_proto.py (files {committed} vs {names})"
    for path in written:
        assert path.read_bytes() == (COMMITTED / path.name).read_bytes(), (
            f"stale stubs: run python scripts/gen_proto.py ({path.name} differs)"
        )


def test_generated_grpc_module_imports_from_the_package():
    # The rewrite in gen_proto.py: protoc's `from exo.v1 import node_pb2` would not import.
    text = (COMMITTED / "node_pb2_grpc.py").read_text()
    assert "from exo.wire.proto_gen import node_pb2 as exo_dot_v1_dot_node__pb2" in text
    assert "from exo.v1 import" not in text
    from exo.wire.proto_gen import node_pb2, node_pb2_grpc

    assert node_pb2_grpc.exo_dot_v1_dot_node__pb2 is node_pb2
    assert node_pb2.DESCRIPTOR.services_by_name["Node"].methods_by_name["Generate"].server_streaming


def test_a_changed_proto_is_noticed(tmp_path):
    # The freshness check above can fail: stubs of an edited proto differ from the committed ones.
    gen = _gen_proto()
    proto = tmp_path / "proto" / gen.PROTO_FILE
    proto.parent.mkdir(parents=True)
    text = (ROOT / "proto" / gen.PROTO_FILE).read_text()
    proto.write_text(text.replace("message HealthRequest {}", "message HealthRequest {\n  bool deep = 1;\n}"))
    gen.PROTO_ROOT = tmp_path / "proto"
    written = {p.name: p for p in gen.generate(tmp_path / "out")}
    assert written["node_pb2.py"].read_bytes() != (COMMITTED / "node_pb2.py").read_bytes()
    assert written["__init__.py"].read_bytes() == (COMMITTED / "__init__.py").read_bytes()


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_generate_request_carries_its_parameters_to_the_owner(ignore_eos):
    """What the API node decided travels to the node that owns the model, ignore_eos included."""
    from exo.engine.prompt import GenerateParams, Prompt
    from exo.wire.convert import generate_request, request_from_pb

    params = GenerateParams(max_tokens=40, default_max_tokens=256, stop=("\n\n",), native_mtp="auto", mtp_k=2,
                            logprobs=3, ignore_eos=ignore_eos)
    message = generate_request("m", "", Prompt(text="hello"), params, timeout_s=10.0)
    prompt, back = request_from_pb(type(message).FromString(message.SerializeToString()))
    assert prompt.text == "hello" and back == params
    # The serving node's daemon adds its native-MTP switch, which reaches the engine in the request.
    from exo.engine.request import MTPSwitch
    from exo.wire.proto_gen import node_pb2 as pb

    message.node_mtp.CopyFrom(pb.NodeSwitch(enabled=False, disabled_reason="off on the owner"))
    _, switched = request_from_pb(message)
    assert switched.mtp_switch == MTPSwitch(False, "off on the owner")


@pytest.mark.parametrize("stop_sequence", [None, "\n\nUser:"])
def test_a_final_chunk_carries_the_stop_string_that_matched(stop_sequence):
    """The runner's last chunk tells the API node which stop string ended the output (Anthropic's
    stop_sequence), and none when none did."""
    from exo.engine.request import GenerationChunk
    from exo.wire.convert import chunk_from_pb, chunk_to_pb

    chunk = GenerationChunk("done", [1, 2], "stop", stop_sequence=stop_sequence)
    message = chunk_to_pb(chunk)
    back = chunk_from_pb(type(message).FromString(message.SerializeToString()))
    assert back.stop_sequence == stop_sequence and back.finish_reason == "stop" and back.text == "done"
