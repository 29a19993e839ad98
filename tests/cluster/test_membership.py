"""Who joins a cluster: same namespace only, the shared secret when there is one, unique node ids."""

from __future__ import annotations

import grpc
import pytest

from exo.wire.proto_gen import node_pb2 as pb
from exo.wire.proto_gen import node_pb2_grpc as pb_grpc

from .daemons import Daemon, start_all, wait_for

pytestmark = pytest.mark.timeout(240)


def _ids(d: Daemon) -> set[str]:
    return d.node_ids() - {d.node_id}


def test_only_the_same_namespace_joins(tmp_path):
    blue1, blue2 = Daemon(tmp_path / "b1", "blue-1", namespace="blue"), Daemon(tmp_path / "b2", "blue-2", namespace="blue")
    red = Daemon(tmp_path / "r", "red", namespace="red")
    daemons = [blue1, blue2, red]
    try:
        start_all(daemons, [d.address for d in daemons])
        wait_for(lambda: _ids(blue1) == {blue2.node_id} and _ids(blue2) == {blue1.node_id}, 20, "blue nodes to meet")
        for d in daemons:  # several polls later the red node is still alone, and nobody sees it
            assert red.node_id not in d.node_ids() - ({red.node_id} if d is red else set())
        assert _ids(red) == set()
        assert red.cluster()["namespace"] == "red"
    finally:
        for d in daemons:
            d.stop()


def test_the_cluster_secret_is_required(tmp_path):
    f = Daemon(tmp_path / "f", "secret-f", secret="s3cret")
    g = Daemon(tmp_path / "g", "secret-g", secret="s3cret")
    h = Daemon(tmp_path / "h", "other-secret", secret="different")
    i = Daemon(tmp_path / "i", "no-secret")
    daemons = [f, g, h, i]
    try:
        start_all(daemons, [d.address for d in daemons])
        wait_for(lambda: _ids(f) == {g.node_id} and _ids(g) == {f.node_id}, 20, "the two nodes with the secret to meet")
        wait_for(lambda: "does not hold" in f.log() or "refused our call" in f.log(), 10, "f to log the refusal")
        assert _ids(h) == set() and _ids(i) == set()
        # Without the secret nobody can command (or even see) a secured node; deadlines on every call.
        with grpc.insecure_channel(f.address) as channel:
            stub = pb_grpc.NodeStub(channel)
            for call, request in (
                (stub.GetNodeInfo, pb.NodeInfoRequest()),
                (stub.LoadInstance, pb.LoadInstanceRequest(model="exo-demo")),
                (stub.ListInstances, pb.ListInstancesRequest()),
            ):
                with pytest.raises(grpc.RpcError) as err:
                    call(request, timeout=5)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(pb.GenerateRequest(model="exo-demo", text="hi"), timeout=5))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert f.cluster()["nodes"][0]["secured"] is True
        # i has no secret: anyone may call it, but a secured node does not take its answers as a peer's.
        with grpc.insecure_channel(i.address) as channel:
            info = pb_grpc.NodeStub(channel).GetNodeInfo(pb.NodeInfoRequest(), timeout=5)
            assert info.node_id == i.node_id and not info.secured and info.proof == ""
    finally:
        for d in daemons:
            d.stop()


def test_a_duplicate_node_id_is_detected_and_one_side_regenerates(tmp_path):
    x, y = Daemon(tmp_path / "x", "copy-x"), Daemon(tmp_path / "y", "copy-y")
    shared_id = "0123456789abcdef0123456789abcdef"
    for d in (x, y):  # a copied EXO_HOME
        d.home.mkdir(parents=True)
        (d.home / "node_id").write_text(shared_id + "\n")
    try:
        start_all([x, y], [x.address, y.address])

        def distinct() -> bool:
            x._node_id = y._node_id = None
            return x.node_id != y.node_id and _ids(x) == {y.node_id} and _ids(y) == {x.node_id}

        wait_for(distinct, 20, "the two nodes to end up with distinct ids and see each other")
        files = {d.name: (d.home / "node_id").read_text().strip() for d in (x, y)}
        changed = [d for d in (x, y) if files[d.name] != shared_id]
        assert len(changed) == 1, files  # exactly one side took a new id, and kept it
        kept = y if changed[0] is x else x
        assert kept.node_id == shared_id and changed[0].node_id == files[changed[0].name]
        assert "takes a new id" in changed[0].log() and f"is now {changed[0].node_id}" in changed[0].log()
        # (The side that keeps its id logs it too when it polls before the other regenerated: a race.)
    finally:
        for d in (x, y):
            d.stop()
