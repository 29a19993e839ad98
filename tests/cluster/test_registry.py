"""PeerRegistry against real grpc.aio servers on 127.0.0.1: joining, filtering, duplicate ids, expiry, deadlines."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc
import pytest

from exo.cluster.auth import AuthInterceptor, ClusterAuth
from exo.cluster.identity import NODE_ID_FILE, NodeIdentity
from exo.cluster.registry import EXPIRE_S, POLL_S, Peer, PeerRegistry
from exo.wire.proto_gen import node_pb2 as pb
from exo.wire.proto_gen import node_pb2_grpc as pb_grpc

NS = "test-ns"
HOST = "127.0.0.1"


class PeerNode(pb_grpc.NodeServicer):
    """A real Node service on 127.0.0.1 that answers GetNodeInfo with the identity the test gives it."""

    def __init__(
        self,
        node_id: str,
        *,
        namespace: str = NS,
        boot_nonce: int = 42,
        secret: str | None = None,
        proof_secret: str | None = None,
        delay_s: float = 0.0,
    ) -> None:
        self.node_id, self.namespace, self.boot_nonce = node_id, namespace, boot_nonce
        self.auth = ClusterAuth(secret)  # checks our calls (interceptor)
        self.prover = ClusterAuth(proof_secret if proof_secret is not None else secret)  # signs its answers
        self.delay_s = delay_s
        self.callers: list[pb.Caller] = []
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def GetNodeInfo(self, request, context):
        self.callers.append(request.caller)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return pb.NodeInfo(
            node_id=self.node_id,
            name=f"peer-{self.node_id[:4]}",
            namespace=self.namespace,
            boot_nonce=self.boot_nonce,
            grpc_port=self.port,
            proof=self.prover.proof(request.challenge, self.node_id),
            secured=self.auth.enabled,
        )

    async def start(self) -> None:
        interceptors = [AuthInterceptor(self.auth)] if self.auth.enabled else []
        self.server = grpc.aio.server(interceptors=interceptors)
        pb_grpc.add_NodeServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port(f"{HOST}:0")
        await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(None)
            self.server = None


@dataclass
class Events:
    joined: list[Peer] = field(default_factory=list)
    lost: list[Peer] = field(default_factory=list)
    id_changed: list[str] = field(default_factory=list)


def make_registry(
    tmp_path, *, secret: str | None = None, boot_nonce: int = 1000, **timing
) -> tuple[PeerRegistry, Events]:
    identity = NodeIdentity(tmp_path / "home", boot_nonce=boot_nonce)
    events = Events()
    # A first call opens the channel: on a loaded 2-core CI machine that took over 0.5 s once (a peer that
    # had not joined after its first poll); no test here waits for a call to time out.
    timing = {"poll_s": 0.2, "expire_s": 0.4, "call_timeout_s": 3.0, **timing}
    registry = PeerRegistry(
        identity,
        ClusterAuth(secret),
        NS,
        caller=lambda: pb.Caller(
            node_id=identity.node_id, boot_nonce=identity.boot_nonce, grpc_port=1, namespace=NS
        ),
        on_joined=events.joined.append,
        on_lost=events.lost.append,
        on_id_changed=events.id_changed.append,
        **timing,
    )
    return registry, events


def run(scenario, tmp_path, servers: list[PeerNode], **registry_kwargs):
    """Start ``servers``, run ``scenario(registry, events)``, always stop everything."""

    async def main():
        registry, events = make_registry(tmp_path, **registry_kwargs)
        for s in servers:
            await s.start()
        try:
            return await scenario(registry, events)
        finally:
            await registry.close()
            for s in servers:
                await s.stop()

    return asyncio.run(main())


def pid(n: int) -> str:
    return f"{n:032x}"


def test_peer_joins_once(tmp_path):
    peer = PeerNode(pid(1))

    async def scenario(registry, events):
        registry.add_address(HOST, peer.port, "static")
        await registry.poll_once()
        first = registry.get(pid(1))
        seen = first.last_seen
        await asyncio.sleep(0.01)
        await registry.poll_once()
        return first, seen, registry.peers(), events

    first, seen, peers, events = run(scenario, tmp_path, [peer])
    assert [p.node_id for p in peers] == [pid(1)]
    assert first.address == (HOST, peer.port) and first.source == "static"
    assert first.info.name == "peer-0000" and first.rtt_ms > 0
    assert first.last_seen > seen  # the second answer refreshed it
    assert [p.node_id for p in events.joined] == [pid(1)]  # joined once, not per poll
    assert events.lost == [] and events.id_changed == []
    # The peer learnt who we are from our call.
    assert peer.callers[0].namespace == NS and peer.callers[0].boot_nonce == 1000
    assert len(peer.callers[0].node_id) == 32


def test_other_namespace_is_ignored(tmp_path):
    peer = PeerNode(pid(2), namespace="someone-else")

    async def scenario(registry, events):
        registry.add_address(HOST, peer.port, "zeroconf")
        await registry.poll_once()
        return registry.peers(), registry.rejected(), events

    peers, rejected, events = run(scenario, tmp_path, [peer])
    assert peers == [] and events.joined == []
    assert "namespace 'someone-else'" in rejected[(HOST, peer.port)]


def test_secret_decides_who_joins(tmp_path):
    member = PeerNode(pid(1), secret="k")
    open_node = PeerNode(pid(2))  # answers anyone, but cannot prove it knows the secret
    forger = PeerNode(pid(3), proof_secret="guess")  # answers with a proof under another secret
    outsider = PeerNode(pid(4), secret="other")  # refuses our signature
    servers = [member, open_node, forger, outsider]

    async def scenario(registry, events):
        for s in servers:
            registry.add_address(HOST, s.port, "static")
        await registry.poll_once()
        return registry.peers(), registry.rejected()

    peers, rejected = run(scenario, tmp_path, servers, secret="k")
    assert [p.node_id for p in peers] == [pid(1)]
    assert (HOST, member.port) not in rejected
    assert "does not hold this cluster's secret" in rejected[(HOST, open_node.port)]
    assert "does not hold this cluster's secret" in rejected[(HOST, forger.port)]
    assert (
        rejected[(HOST, outsider.port)].startswith("refused our call")
        and "invalid signature" in rejected[(HOST, outsider.port)]
    )
    assert outsider.callers == []  # the interceptor stopped the call before the servicer


def test_without_our_secret_a_secured_peer_refuses_us(tmp_path):
    member = PeerNode(pid(1), secret="k")

    async def scenario(registry, events):
        registry.add_address(HOST, member.port, "static")
        await registry.poll_once()
        return registry.peers(), registry.rejected()

    peers, rejected = run(scenario, tmp_path, [member])
    assert peers == [] and "not signed" in rejected[(HOST, member.port)]


def test_own_address_is_ignored(tmp_path):
    # Our identity file exists first so that the server can answer with our id and boot nonce.
    me = NodeIdentity(tmp_path / "home", boot_nonce=1000)
    itself = PeerNode(me.node_id, boot_nonce=1000)

    async def scenario(registry, events):
        registry.add_address(HOST, itself.port, "static")
        await registry.poll_once()
        return registry.peers(), registry.rejected(), registry.identity.node_id, events

    peers, rejected, node_id, events = run(scenario, tmp_path, [itself], boot_nonce=1000)
    assert peers == [] and events.joined == [] and events.id_changed == []
    assert node_id == me.node_id and (tmp_path / "home" / NODE_ID_FILE).read_text().strip() == me.node_id
    assert rejected[(HOST, itself.port)] == "this node itself"


def test_duplicate_id_with_larger_nonce_regenerates(tmp_path):
    original = NodeIdentity(tmp_path / "home", boot_nonce=1).node_id
    twin = PeerNode(original, boot_nonce=7)  # a copied EXO_HOME: same id, smaller nonce

    async def scenario(registry, events):
        registry.add_address(HOST, twin.port, "static")
        await registry.poll_once()
        after_first = (registry.peers(), registry.identity.node_id, list(events.id_changed))
        await registry.poll_once()  # now the ids differ: the twin joins under the id it kept
        return after_first, registry.peers(), events

    (peers1, new_id, changed1), peers2, events = run(scenario, tmp_path, [twin], boot_nonce=1000)
    assert new_id != original and len(new_id) == 32
    assert (tmp_path / "home" / NODE_ID_FILE).read_text().strip() == new_id
    assert changed1 == [original] and peers1 == []
    assert [p.node_id for p in peers2] == [original]
    assert events.id_changed == [original]
    # Our second call introduced us under the new id.
    assert [c.node_id for c in twin.callers] == [original, new_id]


def test_duplicate_id_with_smaller_nonce_keeps_it(tmp_path):
    original = NodeIdentity(tmp_path / "home", boot_nonce=1).node_id
    twin = PeerNode(original, boot_nonce=10**6)  # the twin has the larger nonce: it must move

    async def scenario(registry, events):
        registry.add_address(HOST, twin.port, "static")
        await registry.poll_once()
        await registry.poll_once()
        return registry.peers(), registry.identity.node_id, events

    peers, node_id, events = run(scenario, tmp_path, [twin], boot_nonce=1000)
    assert node_id == original and (tmp_path / "home" / NODE_ID_FILE).read_text().strip() == original
    assert peers == [] and events.id_changed == [] and events.joined == []


def test_stopped_peer_leaves_after_expire(tmp_path):
    peer = PeerNode(pid(5))

    async def scenario(registry, events):
        registry.add_address(HOST, peer.port, "static")
        await registry.poll_once()
        joined = [p.node_id for p in registry.peers()]
        await peer.stop()
        await registry.poll_once()  # no answer, but not silent for expire_s yet
        still_there = [p.node_id for p in registry.peers()]
        await asyncio.sleep(registry.expire_s + 0.1)
        start = time.monotonic()
        await registry.poll_once()
        return joined, still_there, registry.peers(), registry.addresses(), events, time.monotonic() - start

    joined, still_there, peers, addresses, events, _ = run(scenario, tmp_path, [peer], expire_s=0.4)
    assert joined == [pid(5)] and still_there == [pid(5)]
    assert peers == [] and [p.node_id for p in events.lost] == [pid(5)]
    assert addresses == {(HOST, peer.port): {"static"}}  # a static address is kept and retried


def test_slow_peer_never_blocks_a_poll(tmp_path):
    slow = PeerNode(pid(6), delay_s=3.0)
    fast = PeerNode(pid(7))

    async def scenario(registry, events):
        registry.add_address(HOST, slow.port, "static")
        registry.add_address(HOST, fast.port, "static")
        start = time.monotonic()
        await registry.poll_once()
        return time.monotonic() - start, registry.peers(), slow.callers

    elapsed, peers, slow_callers = run(scenario, tmp_path, [slow, fast], call_timeout_s=0.3)
    assert len(slow_callers) == 1  # the call did reach it: it was the answer that took too long
    # Waiting for the slow peer would take its 3 s; the deadline (0.3 s) plus a generous margin stays well under.
    assert elapsed < 0.3 + 2.0, f"poll_once took {elapsed:.2f} s with a 0.3 s deadline"
    assert [p.node_id for p in peers] == [pid(7)]


def test_inbound_address_goes_with_its_peer(tmp_path):
    inbound = PeerNode(pid(8))
    both = PeerNode(pid(9))  # also a static peer: its address stays

    async def scenario(registry, events):
        registry.add_address(HOST, inbound.port, "inbound")
        registry.add_address(HOST, both.port, "inbound")
        registry.add_address(HOST, both.port, "static")
        await registry.poll_once()
        sources = {p.node_id: p.source for p in registry.peers()}
        await inbound.stop()
        await both.stop()
        await asyncio.sleep(registry.expire_s + 0.1)
        await registry.poll_once()
        return sources, registry.addresses(), events

    sources, addresses, events = run(scenario, tmp_path, [inbound, both], expire_s=0.3)
    assert sources == {pid(8): "inbound", pid(9): "static"}
    assert sorted(p.node_id for p in events.lost) == [pid(8), pid(9)]
    assert addresses == {(HOST, both.port): {"static"}}


def test_background_loop_polls_a_new_address_at_once(tmp_path):
    peer = PeerNode(pid(10))

    async def scenario(registry, events):
        await registry.start()
        await asyncio.sleep(0.05)  # the first (empty) poll is done; the next is poll_s = 30 s away
        start = time.monotonic()
        registry.add_address(HOST, peer.port, "zeroconf")  # wakes the loop
        while not events.joined and time.monotonic() - start < 15:
            await asyncio.sleep(0.02)
        return time.monotonic() - start, events

    elapsed, events = run(scenario, tmp_path, [peer], poll_s=30.0)
    assert [p.node_id for p in events.joined] == [pid(10)] and events.joined[0].source == "zeroconf"
    assert elapsed < 15.0  # at once, not at the next poll (30 s): half of it leaves a loaded machine room


def test_restarted_static_peer_rejoins(tmp_path):
    peer = PeerNode(pid(11))

    async def scenario(registry, events):
        registry.add_address(HOST, peer.port, "static")
        await registry.poll_once()
        port = peer.port
        await peer.stop()
        await asyncio.sleep(registry.expire_s + 0.1)
        await registry.poll_once()
        lost = [p.node_id for p in events.lost]
        # The same node comes back on the same port (a restart with a new boot nonce).
        peer.boot_nonce += 1
        peer.server = grpc.aio.server()
        pb_grpc.add_NodeServicer_to_server(peer, peer.server)
        assert peer.server.add_insecure_port(f"{HOST}:{port}") == port
        await peer.server.start()
        start = time.monotonic()
        while registry.get(pid(11)) is None and time.monotonic() - start < 30:  # a deadline: it ends on the event
            await registry.poll_once()
            await asyncio.sleep(0.05)
        return lost, registry.get(pid(11)), events

    lost, back, events = run(scenario, tmp_path, [peer], expire_s=0.3)
    assert lost == [pid(11)]
    assert back is not None and back.info.boot_nonce == 43
    assert [p.node_id for p in events.joined] == [pid(11), pid(11)]


def test_poll_and_expiry_come_from_the_environment_where_set(tmp_path, monkeypatch):
    """EXO_PEER_POLL_S / EXO_PEER_EXPIRE_S (tests that kill daemons set them) replace the defaults of a
    registry built without explicit timings (a daemon's); anything but a positive number is refused."""
    registry, _ = make_registry(tmp_path / "default", poll_s=None, expire_s=None)
    assert (registry.poll_s, registry.expire_s) == (POLL_S, EXPIRE_S) == (1.5, 7.5)
    monkeypatch.setenv("EXO_PEER_POLL_S", "0.5")
    monkeypatch.setenv("EXO_PEER_EXPIRE_S", "4")
    registry, _ = make_registry(tmp_path / "env", poll_s=None, expire_s=None)
    assert (registry.poll_s, registry.expire_s) == (0.5, 4.0)
    registry, _ = make_registry(tmp_path / "explicit", poll_s=0.2, expire_s=0.4)  # an explicit value wins
    assert (registry.poll_s, registry.expire_s) == (0.2, 0.4)
    for bad in ("0", "-1", "soon", "nan", "inf"):
        monkeypatch.setenv("EXO_PEER_EXPIRE_S", bad)
        with pytest.raises(ValueError, match="EXO_PEER_EXPIRE_S must be a positive number of seconds"):
            make_registry(tmp_path / "bad", poll_s=None, expire_s=None)
