"""The peer registry: every address a peer may be reached at, and the peers alive behind them.

Addresses come from static peers (``--peers`` / ``EXO_PEERS``, kept forever and retried), zeroconf
(added and removed by discovery) and inbound calls (a peer that asked for our node info told us its
gRPC port). Every ``POLL_S`` the registry asks each address for its node info with a short deadline, all
at once; a peer of another namespace is ignored, a peer that does not prove it holds our cluster secret
is ignored, and a peer with our own node id triggers the duplicate-id rule (``NodeIdentity``). A peer
with no successful answer for ``EXPIRE_S`` leaves the registry (``on_lost``), so a dead peer is gone
within ten seconds. Readers (the API) only ever see the cached answers: a slow peer never blocks them.

``EXO_PEER_POLL_S`` and ``EXO_PEER_EXPIRE_S`` replace ``POLL_S`` and ``EXPIRE_S`` in a process's registry
(tests that kill nodes and wait for them to leave set them on their daemons; keep the expiry several polls
long). They are not settings: nothing outside the tests should need them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from exo.wire.proto_gen import node_pb2 as pb
from exo.wire.proto_gen import node_pb2_grpc as pb_grpc

from .auth import ClusterAuth
from .identity import NodeIdentity

log = logging.getLogger(__name__)

POLL_S = 1.5
CALL_TIMEOUT_S = 2.0
EXPIRE_S = 7.5
EXPIRE_CHECK_S = 0.25  # a silent peer leaves at most this long after EXPIRE_S
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Reconnect fast after a peer restarts (defaults back off up to two minutes).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.min_reconnect_backoff_ms", 200),
)

POLL_ENV, EXPIRE_ENV = "EXO_PEER_POLL_S", "EXO_PEER_EXPIRE_S"

Address = tuple[str, int]


def seconds_from_env(name: str, default: float) -> float:
    """The environment variable ``name`` as a positive number of seconds; ``default`` where it is unset or empty."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive number of seconds, got {raw!r}")
    return value


@dataclass
class Peer:
    """A live peer: its latest node info and how to reach it."""

    node_id: str
    address: Address
    source: str  # static | zeroconf | inbound: how its address was learnt
    info: pb.NodeInfo
    stub: pb_grpc.NodeStub
    last_seen: float  # time.monotonic() of the last answer
    rtt_ms: float
    joined: float = field(default_factory=time.monotonic)


class PeerRegistry:
    def __init__(
        self,
        identity: NodeIdentity,
        auth: ClusterAuth,
        namespace: str,
        *,
        caller: Callable[[], pb.Caller],
        on_joined: Callable[[Peer], None] | None = None,
        on_lost: Callable[[Peer], None] | None = None,
        on_id_changed: Callable[[str], None] | None = None,
        poll_s: float | None = None,  # None: POLL_S, or EXO_PEER_POLL_S where set
        expire_s: float | None = None,  # None: EXPIRE_S, or EXO_PEER_EXPIRE_S where set
        call_timeout_s: float = CALL_TIMEOUT_S,
    ) -> None:
        self.identity = identity
        self.auth = auth
        self.namespace = namespace
        self.caller = caller
        self.on_joined = on_joined
        self.on_lost = on_lost
        self.on_id_changed = on_id_changed
        self.poll_s = poll_s if poll_s is not None else seconds_from_env(POLL_ENV, POLL_S)
        self.expire_s = expire_s if expire_s is not None else seconds_from_env(EXPIRE_ENV, EXPIRE_S)
        self.call_timeout_s = call_timeout_s
        self._sources: dict[Address, set[str]] = {}
        self._channels: dict[Address, grpc.aio.Channel] = {}
        self._peers: dict[str, Peer] = {}
        self._rejected: dict[Address, str] = {}  # why an address is not a peer (logged once per reason)
        self._task: asyncio.Task[None] | None = None
        self._expiry_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    # -- addresses -------------------------------------------------------------------------------------------
    def add_address(self, host: str, port: int, source: str) -> None:
        address = (host, int(port))
        sources = self._sources.setdefault(address, set())
        if source not in sources:
            sources.add(source)
            log.debug("peer address %s:%d (%s)", host, port, source)
            self._wake.set()

    def remove_address(self, host: str, port: int, source: str) -> None:
        address = (host, int(port))
        sources = self._sources.get(address)
        if sources is not None:
            sources.discard(source)
            if not sources:
                del self._sources[address]

    def addresses(self) -> dict[Address, set[str]]:
        return {a: set(s) for a, s in self._sources.items()}

    # -- peers -------------------------------------------------------------------------------------------------
    def peers(self) -> list[Peer]:
        return sorted(self._peers.values(), key=lambda p: p.node_id)

    def get(self, node_id: str) -> Peer | None:
        return self._peers.get(node_id)

    def metadata(self, method: str) -> tuple[tuple[str, str], ...]:
        """The signature of one outgoing call (empty without a secret)."""
        return self.auth.metadata(method, self.identity.node_id)

    def rejected(self) -> dict[Address, str]:
        return dict(self._rejected)

    # -- lifecycle ------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="exo-peer-registry")
        self._expiry_task = asyncio.create_task(self._run_expiry(), name="exo-peer-expiry")

    async def close(self) -> None:
        for task in (self._task, self._expiry_task):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        self._task = self._expiry_task = None
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close(grace=None) for c in channels), return_exceptions=True)

    async def poll_once(self) -> None:
        """Ask every address for its node info (at once), then expire silent peers."""
        addresses = list(self._sources)
        await asyncio.gather(*(self._poll(address) for address in addresses))
        self._expire()
        for address in [a for a in self._channels if a not in self._sources]:
            await self._channels.pop(address).close(grace=None)

    async def _run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except Exception:  # noqa: BLE001 - the registry must outlive any one bad answer
                log.exception("peer poll failed")
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self.poll_s)
            except TimeoutError:
                pass

    async def _run_expiry(self) -> None:
        """Expire silent peers on time: a poll round waits up to its call deadline for a silent peer, so
        checking only after each round would let a peer stay up to a round (~3.5 s) past ``expire_s``."""
        while True:
            await asyncio.sleep(EXPIRE_CHECK_S)
            try:
                self._expire()
            except Exception:  # noqa: BLE001 - a failing on_lost callback must not stop expiry
                log.exception("peer expiry failed")

    def _channel(self, address: Address) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            host, port = address
            target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            channel = self._channels[address] = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        return channel

    async def _poll(self, address: Address) -> None:
        stub = pb_grpc.NodeStub(self._channel(address))
        challenge = secrets.token_hex(16)
        method = "/exo.v1.Node/GetNodeInfo"
        start = time.perf_counter()
        try:
            info: pb.NodeInfo = await stub.GetNodeInfo(
                pb.NodeInfoRequest(caller=self.caller(), challenge=challenge),
                timeout=self.call_timeout_s,
                metadata=self.metadata(method),
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                self._reject(address, f"refused our call: {e.details()}")
            return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a bad address or answer is that address's problem
            self._reject(address, f"{type(e).__name__}: {e}")
            return
        rtt_ms = (time.perf_counter() - start) * 1000.0
        self._accept(address, stub, info, challenge, rtt_ms)

    def _accept(self, address: Address, stub: pb_grpc.NodeStub, info: pb.NodeInfo, challenge: str, rtt: float) -> None:
        where = f"{address[0]}:{address[1]}"
        if info.namespace != self.namespace:
            self._reject(address, f"namespace {info.namespace!r}, not ours ({self.namespace!r})")
            return
        if not self.auth.check_proof(challenge, info.node_id, info.proof):
            self._reject(address, "does not hold this cluster's secret (EXO_CLUSTER_SECRET)")
            return
        if info.boot_nonce == self.identity.boot_nonce:
            self._reject(address, "this node itself")
            return
        if info.node_id == self.identity.node_id:
            old = self.identity.node_id
            if self.identity.resolve_duplicate(info.boot_nonce, where):
                if self.on_id_changed is not None:
                    self.on_id_changed(old)
            return  # the peer joins on a later poll, under whichever id differs by then
        self._rejected.pop(address, None)
        now = time.monotonic()
        sources = self._sources.get(address, {"inbound"})
        source = "static" if "static" in sources else ("zeroconf" if "zeroconf" in sources else "inbound")
        peer = self._peers.get(info.node_id)
        if peer is None:
            peer = self._peers[info.node_id] = Peer(info.node_id, address, source, info, stub, now, rtt)
            log.info("peer %s (%s) joined at %s via %s", info.name, info.node_id[:8], where, source)
            if self.on_joined is not None:
                self.on_joined(peer)
            return
        peer.info, peer.last_seen, peer.rtt_ms = info, now, rtt
        if peer.address != address and peer.address not in self._sources:
            peer.address, peer.stub, peer.source = address, stub, source  # its old address is gone

    def _reject(self, address: Address, reason: str) -> None:
        if self._rejected.get(address) != reason:
            level = logging.DEBUG if reason == "this node itself" or "Error" in reason else logging.WARNING
            log.log(level, "peer address %s:%d ignored: %s", address[0], address[1], reason)
        self._rejected[address] = reason

    def _expire(self) -> None:
        now = time.monotonic()
        for node_id, peer in list(self._peers.items()):
            if now - peer.last_seen > self.expire_s:
                del self._peers[node_id]
                # An inbound address is only as good as the peer that called from it.
                self.remove_address(*peer.address, "inbound")
                log.warning(
                    "peer %s (%s) at %s:%d left: no answer for %.1f s",
                    peer.info.name, node_id[:8], peer.address[0], peer.address[1], now - peer.last_seen,
                )
                if self.on_lost is not None:
                    self.on_lost(peer)
