"""ClusterAuth (HMAC metadata, replay window, proofs) and AuthInterceptor on a real grpc.aio server."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from exo.cluster.auth import REPLAY_WINDOW_S, AuthInterceptor, ClusterAuth
from exo.wire.proto_gen import node_pb2 as pb
from exo.wire.proto_gen import node_pb2_grpc as pb_grpc

INFO = "/exo.v1.Node/GetNodeInfo"
GENERATE = "/exo.v1.Node/Generate"
NODE = "a" * 32


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# -- ClusterAuth ------------------------------------------------------------------------------------------


def test_round_trip():
    clock = Clock()
    sender, receiver = ClusterAuth("s3cret", clock=clock), ClusterAuth("s3cret", clock=clock)
    md = sender.metadata(INFO, NODE)
    assert dict(md).keys() == {"x-exo-node", "x-exo-ts", "x-exo-nonce", "x-exo-sig"}
    assert dict(md)["x-exo-node"] == NODE
    assert receiver.check(INFO, md) is None
    # Every call gets its own nonce (and so its own signature).
    again = sender.metadata(INFO, NODE)
    assert dict(again)["x-exo-nonce"] != dict(md)["x-exo-nonce"]
    assert receiver.check(INFO, again) is None


def test_receiver_accepts_grpc_metadata_objects():
    # A server sees invocation metadata as _Metadatum-like (key, value) pairs, possibly with binary values.
    receiver = ClusterAuth("k")
    md = ClusterAuth("k").metadata(INFO, NODE) + (("x-other-bin", b"\x00\x01"),)
    assert receiver.check(INFO, md) is None


def _refusal(sender: ClusterAuth, receiver: ClusterAuth, case: str) -> str | None:
    md = sender.metadata(INFO, NODE)
    if case == "missing":
        md = ()
    elif case == "missing-sig":
        md = tuple(kv for kv in md if kv[0] != "x-exo-sig")
    elif case == "malformed-ts":
        md = tuple((k, "yesterday" if k == "x-exo-ts" else v) for k, v in md)
    elif case == "other-method":
        return receiver.check(GENERATE, md)
    elif case == "forged-node":
        md = tuple((k, "b" * 32 if k == "x-exo-node" else v) for k, v in md)
    elif case == "replay":
        assert receiver.check(INFO, md) is None
    return receiver.check(INFO, md)


REFUSALS = [
    # (case, receiver secret, seconds the receiver's clock is ahead, expected reason fragment)
    pytest.param("missing", "k", 0, "not signed", id="no-metadata"),
    pytest.param("missing-sig", "k", 0, "not signed", id="no-signature"),
    pytest.param("plain", "other", 0, "invalid signature", id="wrong-secret"),
    pytest.param("other-method", "k", 0, "invalid signature", id="signature-of-another-method"),
    pytest.param("forged-node", "k", 0, "invalid signature", id="forged-node-id"),
    pytest.param("malformed-ts", "k", 0, "malformed signature timestamp", id="malformed-timestamp"),
    pytest.param("plain", "k", REPLAY_WINDOW_S + 1, "off this node's clock", id="stale"),
    pytest.param("plain", "k", -(REPLAY_WINDOW_S + 1), "off this node's clock", id="from-the-future"),
    pytest.param("replay", "k", 0, "replayed call", id="replayed-nonce"),
]


@pytest.mark.parametrize(("case", "secret", "skew", "reason"), REFUSALS)
def test_refused(case, secret, skew, reason):
    sender_clock, receiver_clock = Clock(), Clock()
    receiver_clock.now += skew
    got = _refusal(ClusterAuth("k", clock=sender_clock), ClusterAuth(secret, clock=receiver_clock), case)
    assert got is not None and reason in got, got


def test_refusal_reasons_are_distinct():
    reasons = set()
    for case, secret, skew in [
        ("missing", "k", 0),
        ("plain", "other", 0),
        ("plain", "k", 60),
        ("replay", "k", 0),
    ]:
        clock = Clock(1000.0 + skew)
        reasons.add(_refusal(ClusterAuth("k", clock=Clock(1000.0)), ClusterAuth(secret, clock=clock), case))
    assert None not in reasons and len(reasons) == 4, reasons


def test_stale_reason_says_how_far_off():
    md = ClusterAuth("k", clock=Clock(1000.0)).metadata(INFO, NODE)
    assert "+45 s off" in ClusterAuth("k", clock=Clock(1045.0)).check(INFO, md)
    assert "-45 s off" in ClusterAuth("k", clock=Clock(955.0)).check(INFO, md)


def test_inside_the_window_is_accepted():
    md = ClusterAuth("k", clock=Clock(1000.0)).metadata(INFO, NODE)
    assert ClusterAuth("k", clock=Clock(1000.0 + REPLAY_WINDOW_S - 1)).check(INFO, md) is None


def test_nonce_is_remembered_while_it_could_be_replayed():
    clock = Clock(1000.0)
    receiver = ClusterAuth("k", clock=clock)
    md = ClusterAuth("k", clock=Clock(1000.0)).metadata(INFO, NODE)
    assert receiver.check(INFO, md) is None
    clock.now += REPLAY_WINDOW_S - 1  # still inside the window: the replay must be caught
    # Other calls in between make the receiver prune its memory; the live nonce must survive that.
    sender = ClusterAuth("k", clock=clock)
    for _ in range(3):
        assert receiver.check(INFO, sender.metadata(INFO, NODE)) is None
    assert "replayed" in receiver.check(INFO, md)


def test_no_secret_allows_everything():
    open_ = ClusterAuth(None)
    assert not open_.enabled and ClusterAuth("").enabled is False
    assert open_.metadata(INFO, NODE) == ()
    assert open_.check(INFO, None) is None
    assert open_.check(INFO, ()) is None
    assert open_.check(INFO, ClusterAuth("k").metadata(INFO, NODE)) is None
    assert open_.proof("challenge", NODE) == ""
    assert open_.check_proof("challenge", NODE, "") is True


def test_proof():
    mine, peer, stranger = ClusterAuth("k"), ClusterAuth("k"), ClusterAuth("other")
    assert mine.enabled
    proof = peer.proof("c1", NODE)
    assert len(proof) == 64 and proof == mine.proof("c1", NODE)
    assert mine.check_proof("c1", NODE, proof)
    assert not mine.check_proof("c2", NODE, proof)  # another challenge
    assert not mine.check_proof("c1", "b" * 32, proof)  # another node id
    assert not mine.check_proof("c1", NODE, stranger.proof("c1", NODE))  # another secret
    assert not mine.check_proof("c1", NODE, "")  # a node without a secret
    assert not mine.check_proof("c1", NODE, ClusterAuth(None).proof("c1", NODE))


# -- AuthInterceptor on a real server ---------------------------------------------------------------------


class Node(pb_grpc.NodeServicer):
    async def GetNodeInfo(self, request, context):
        return pb.NodeInfo(node_id=NODE, name="server", namespace=request.caller.namespace)

    async def Generate(self, request, context):
        for word in ("hello", " world"):
            yield pb.GenerateChunk(text=word)
        yield pb.GenerateChunk(finish_reason="stop")


async def _serve(secret: str | None) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(interceptors=[AuthInterceptor(ClusterAuth(secret))])
    pb_grpc.add_NodeServicer_to_server(Node(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def _calls(secret: str | None, client_auth: ClusterAuth, replay: bool = False) -> dict[str, object]:
    """Outcome (status code name or the answer) of a unary and a streaming call signed by ``client_auth``."""
    server, port = await _serve(secret)
    out: dict[str, object] = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.NodeStub(channel)
            md = client_auth.metadata(INFO, "c" * 32)
            try:
                info = await stub.GetNodeInfo(
                    pb.NodeInfoRequest(caller=pb.Caller(namespace="ns")), metadata=md, timeout=5
                )
                out["unary"] = info.namespace
            except grpc.aio.AioRpcError as e:
                out["unary"] = e.code().name
                out["unary_details"] = e.details()
            if replay:
                try:
                    await stub.GetNodeInfo(pb.NodeInfoRequest(), metadata=md, timeout=5)
                    out["replay"] = "OK"
                except grpc.aio.AioRpcError as e:
                    out["replay"] = e.code().name
                    out["replay_details"] = e.details()
            try:
                chunks = [
                    c
                    async for c in stub.Generate(
                        pb.GenerateRequest(model="m"),
                        metadata=client_auth.metadata(GENERATE, "c" * 32),
                        timeout=5,
                    )
                ]
                out["stream"] = "".join(c.text for c in chunks)
            except grpc.aio.AioRpcError as e:
                out["stream"] = e.code().name
                out["stream_details"] = e.details()
    finally:
        await server.stop(None)
    return out


def test_server_refuses_unsigned_calls():
    out = asyncio.run(_calls("k", ClusterAuth(None)))
    assert out["unary"] == "UNAUTHENTICATED" and "not signed" in out["unary_details"]
    assert out["stream"] == "UNAUTHENTICATED" and "not signed" in out["stream_details"]


def test_server_accepts_signed_calls():
    out = asyncio.run(_calls("k", ClusterAuth("k")))
    assert out["unary"] == "ns"
    assert out["stream"] == "hello world"


def test_server_refuses_another_secret():
    out = asyncio.run(_calls("k", ClusterAuth("not-k")))
    assert out["unary"] == "UNAUTHENTICATED" and "invalid signature" in out["unary_details"]
    assert out["stream"] == "UNAUTHENTICATED" and "invalid signature" in out["stream_details"]


def test_server_refuses_a_replayed_call():
    out = asyncio.run(_calls("k", ClusterAuth("k"), replay=True))
    assert out["unary"] == "ns"
    assert out["replay"] == "UNAUTHENTICATED" and "replayed" in out["replay_details"]


def test_server_without_secret_accepts_anything():
    out = asyncio.run(_calls(None, ClusterAuth("whatever")))
    assert out["unary"] == "ns" and out["stream"] == "hello world"
    out = asyncio.run(_calls(None, ClusterAuth(None)))
    assert out["unary"] == "ns" and out["stream"] == "hello world"


@pytest.mark.parametrize("ts", ["nan", "inf", "-inf", "soon"])
def test_a_non_finite_or_malformed_timestamp_is_refused(ts):
    auth = ClusterAuth("s3cret", clock=lambda: 1000.0)
    # A correct signature over the odd timestamp: only the timestamp check can refuse it.
    sig = auth._mac("/exo.v1.Node/Health", ts, "node", "n1")
    meta = (("x-exo-node", "node"), ("x-exo-ts", ts), ("x-exo-nonce", "n1"), ("x-exo-sig", sig))
    assert auth.check("/exo.v1.Node/Health", meta) == "malformed signature timestamp"
