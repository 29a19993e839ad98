"""Joining a pipeline's group: one ``mx.distributed`` ring (TCP) across the runners of an instance.

The daemons derive the hosts (one ``host:port`` per rank, in stage order) from the placement; every runner
of the group writes the same hostfile and joins. ``mx.distributed.init`` waits for every member without a
deadline of its own, so a join that does not complete within ``timeout_s`` ends the process
(``EXIT_GROUP_LOST``): the group is disposable and the daemons form it anew.

Beside the ring, each member opens one plain TCP connection to the next member: a doorbell. The ring
backend's receive polls its socket in a busy loop until the message arrives, so a stage waiting for the
others' layers would burn a core the whole time, and where the stages share cores (several on one
machine, or a busy Mac) the computing stage loses them and every hop costs a scheduler time slice
(docs/performance.md, "The code's reasons": the ring's doorbell). So a receive first blocks on the doorbell (sleeping in the kernel; a closed doorbell
means the peer is gone: ``GroupError`` at once) and only then takes the message from the ring.
The doorbells carry TCP keepalive, so a member whose machine is unreachable (asleep, its network cut)
is a ``GroupError`` within about 5 s as well.

A step's message (a header, a decode round's hiddens: up to ``INLINE_BYTES``) travels on the doorbell
itself, behind a 5-byte prefix: one write and one read on exo's own socket, where MLX's ring hands each
message between its threads and the receiver spins until the bytes are there (bench/pipeline.py's hop
breakdown measures both). A larger message (a prefill chunk's hiddens) takes the ring, a rung first.

Trust (``secret``: the cluster's ``EXO_CLUSTER_SECRET``): every member proves the secret before any of its
messages is used. MLX's ring backend opens its own sockets and takes the FIRST connection on a member's ring
port, whoever makes it, with no hook to authenticate it; so right after ``mx.distributed.init`` every member
sends a fresh nonce and then an HMAC over every member's nonce, its rank and the hosts around the ring
(``all_gather``), and checks every other member's: a group with a member that does not hold the secret (or
belongs to another group) is a ``GroupError`` before any header or tensor crosses it. The doorbells are
exo's own sockets: a connection proves the secret (challenge-response both ways) before it is taken, and a
stray one is closed while the listener waits on for the real member. Once the group has formed, neither
listener exists any more: a connection to a stage's ring or doorbell port is refused by the kernel.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import logging
import os
import random
import secrets
import socket
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from exo.wire.runner import EXIT_GROUP_LOST

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 60.0
# TCP keepalive on the doorbells: a member whose machine sleeps or whose network is cut closes nothing, so
# the one waiting on it would wait until the daemons notice (a peer is gone after 7.5 s of silence). The
# kernel answers keepalive probes even while its process computes, so only an unreachable machine misses
# them: idle 2 s, then 3 probes 1 s apart -> about 5 s.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 2, 1, 3


class GroupError(RuntimeError):
    """The group could not be formed, or a member of it was lost."""


class GroupAuthError(GroupError):
    """A member of the group (or a connection posing as one) did not prove the cluster secret."""


NONCE_BYTES = 32
DOORBELL_HANDSHAKE_S = 5.0  # a connection to a doorbell that has not proved the secret by then is closed


def _mac(key: bytes, *parts: bytes | str | int) -> bytes:
    """HMAC-SHA256 over ``parts``, each length-prefixed (no two part lists give the same message)."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        data = part if isinstance(part, bytes) else str(part).encode()
        h.update(len(data).to_bytes(4, "big") + data)
    return h.digest()


_HANDED_OUT: set[int] = set()
_HANDED_OUT_LOCK = threading.Lock()
# A port handed out is claimed host-wide for this long: other processes of this user (several runners or
# daemons starting at once, test workers side by side) skip it until its taker has had time to bind it.
PORT_CLAIM_S = 120.0


def _claims_dir() -> Path:
    path = Path(tempfile.gettempdir()) / f"exo-ports-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def _claim(claims: Path, port: int, now: float) -> bool:
    """Claim ``port`` among this host's processes (one file per port in ``claims``; the caller holds the
    claims lock). False while another process's claim of it is younger than ``PORT_CLAIM_S``."""
    path = claims / str(port)
    try:
        if now - path.stat().st_mtime < PORT_CLAIM_S:
            return False
    except FileNotFoundError:
        pass
    path.write_text(str(os.getpid()))
    return True


def _prune_claims(claims: Path, now: float) -> None:
    for entry in claims.iterdir():
        try:
            if entry.name.isdigit() and now - entry.stat().st_mtime >= PORT_CLAIM_S:
                entry.unlink()
        except FileNotFoundError:
            pass


def _below_ephemeral() -> tuple[int, int] | None:
    """Ports to choose from below the kernel's ephemeral range (Linux: ip_local_port_range, 32768 by default;
    macOS and the BSDs: 49152), or None where that leaves too few. A port the kernel hands out for a bind to
    port 0 is an ephemeral one, and any process's outgoing connection may take it before its taker binds it
    (a CI run lost a daemon's API port so, to a connection made in the seconds the daemon took to start)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 49152
    top = min(low, 49152) - 1
    return (PORTS_FROM, top) if top - PORTS_FROM >= 1000 else None


PORTS_FROM = 20000  # the lowest port free_port names (below it: services' well-known and registered ports)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (for the ring's listener, a daemon's API), chosen below the
    kernel's ephemeral range (``_below_ephemeral``), never one this process handed out before: the kernel may
    give a port freed a moment ago straight back, so two calls in a row (a daemon's API and gRPC ports, a
    pipeline's ring hosts) could otherwise name the same port twice. Nor one another process of this user took
    in the last ``PORT_CLAIM_S``: between this call and the taker's bind, anyone asking could get the same
    free port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    claims = _claims_dir()
    with _HANDED_OUT_LOCK, open(claims / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        now = time.time()
        _prune_claims(claims, now)
        span = _below_ephemeral()
        for _ in range(256):
            with socket.socket(family, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, random.randint(*span) if span else 0))
                except OSError:  # taken: another candidate
                    continue
                port = int(s.getsockname()[1])
            if port not in _HANDED_OUT and _claim(claims, port, now):
                _HANDED_OUT.add(port)
                return port
    raise OSError(f"no TCP port on {host} that this process or another has not handed out already")


# Where a member's time goes, per message of a step (``RingLink.report()``; bench/pipeline.py's breakdown):
#   send.work: since the member's previous message ended (its layers, and on the leader sampling and drafting);
#   send.ready: evaluating what is sent (on a GPU the stream's synchronisation);
#   send.ring / send.bell: the message's send (on the doorbell: the bytes to host and the socket's write; on
#     the ring: MLX's send), the rung before a message on the ring;
#   recv.gap: since the previous message ended (Python between the two);
#   recv.wait: asleep until the previous member rings (the other stages' work, the wire's latency);
#   recv.ring: taking the message into an array (host to device): for a message on the ring timed apart only
#     with ``EXO_PIPELINE_PHASES=1``, otherwise it is evaluated inside the member's next compute.
# Only step-sized messages (up to ``INLINE_BYTES``: headers, decode rounds) are sampled, not prefill chunks.
PHASES = ("send.work", "send.ready", "send.ring", "send.bell", "recv.gap", "recv.wait", "recv.ring")
# On the graph and collective wires a step's bytes never pass the host; with ``EXO_PIPELINE_PHASES=1`` each forward
# step is timed instead (``RingLink.note``): on a stage, graph.wait (from its last step's launch to the next header:
# asleep on the doorbell) and graph.build (from the header to its step launched: building the graph and MLX CUDA's
# launches); on the leader, graph.period (from one step's header to the next: what a step costs the pipeline).
GRAPH_PHASES = ("graph.wait", "graph.build", "graph.period")
# A step's message up to this size (a header, a decode round's hiddens: at depth 3 of a model with H = 4096 in
# bf16, 32 KiB) travels on the doorbell itself, after its 5-byte prefix: one write and one read of this
# member's own socket, where the ring's send and receive hand the message between MLX's threads (tens of
# microseconds each way) and the receiver spins on the ring until the bytes are there. It fits the sockets'
# buffers (a receive window of 64 KiB and more on Linux and macOS), so a send completes without its reader.
# Larger messages (prefill chunks) take the ring, announced by a rung first.
INLINE_BYTES = 32 * 1024
_ON_RING, _INLINE = 1, 2  # the doorbell's prefix: kind (1 byte), payload bytes (4, big-endian)
MAX_SAMPLES = 200_000  # per phase: a long-lived runner's link stops sampling there


class RingLink:
    """The stages' ``exo.engine.pipeline.Link``: the messages travel over the ``mx.distributed`` ring, each
    announced on the doorbell to the next member. A member sends only to the next one and receives only
    from the one before (the pipeline's ring order)."""

    def __init__(self, group: Any, to_next: socket.socket, from_previous: socket.socket, doorbell_port: int = 0,
                 *, timed_receives: bool | None = None, inline_bytes: int | None = None, backend: str = "ring") -> None:
        self.group = group
        self.doorbell_port = doorbell_port  # closed once the previous member rang in: a later connection is refused
        self.rank, self.size = group.rank(), group.size()
        self._to_next = to_next
        self._from_previous = from_previous
        self.timed_receives = (os.environ.get("EXO_PIPELINE_PHASES") == "1") if timed_receives is None else timed_receives
        # Messages up to this size travel on the doorbell (0: every one on the ring, as before it carried any).
        # A tensor group sends every message on the doorbells (``DOORBELL_ONLY``): its collectives use the
        # backend's own connections (and NCCL has no point-to-point transfers).
        self.inline_bytes = inline_bytes if inline_bytes is not None else int(
            os.environ.get("EXO_RING_INLINE_BYTES", INLINE_BYTES))
        self._buffers: dict[int, bytearray] = {}  # receive buffers by size, kept
        # The graph wire (``exo.engine.pipeline.GraphLink``): MLX's ring send and receive as ops of a step's graph.
        # Every transfer on the ring, graph or host, goes through one communication stream of this link's own, in
        # the order issued: a message the host sends on the ring after a graph send still waiting for its input
        # must not pass it on the ring's sockets (nor a receive another), nor wait behind the model's CPU ops.
        self.graph_ops = backend == "ring" and self.inline_bytes != DOORBELL_ONLY
        # The collective wire (``WIRE_COLLECTIVE``): a group of two's all-sums, on the device's stream under NCCL (no
        # point-to-point transfers there), on this link's communication stream under the ring (the tests' CPU).
        self.collective_ops = self.size == 2
        self.device_collectives = backend == "nccl"  # (auto takes the collective wire only there)
        self._backend = backend
        self._stream: Any = None
        self.samples: dict[str, list[float]] = {phase: [] for phase in (*PHASES, *GRAPH_PHASES)}  # seconds, per message
        self._mark: float | None = None  # when the last message ended

    def note(self, phase: str, seconds: float) -> None:
        """A graph-wire step's phase (``GRAPH_PHASES``), kept where ``EXO_PIPELINE_PHASES=1`` asked for timing."""
        samples = self.samples[phase]
        if self.timed_receives and len(samples) < MAX_SAMPLES:
            samples.append(seconds)

    def _sample(self, nbytes: int, **phases: float) -> None:
        if nbytes <= INLINE_BYTES and len(self.samples["recv.wait"]) < MAX_SAMPLES:
            for phase, seconds in phases.items():
                self.samples[phase.replace("_", ".", 1)].append(seconds)

    def send(self, x: Any, dst: int) -> None:
        import mlx.core as mx

        if dst != (self.rank + 1) % self.size:
            raise ValueError(f"rank {self.rank} sends to the next member only, not to {dst}")
        t0 = time.perf_counter()
        mx.eval(x)  # computed before the peer is woken: it must not wait through our compute
        t1 = time.perf_counter()
        if x.nbytes <= self.inline_bytes:
            try:
                payload = memoryview(x).cast("B")
            except TypeError:  # not contiguous
                x = mx.contiguous(x)
                mx.eval(x)
                payload = memoryview(x).cast("B")
            t2 = t1  # no rung: the message is its own
            self._write(dst, [_prefix(_INLINE, x.nbytes), payload])
            t3 = time.perf_counter()
        else:
            # On the ring: it completes only while the peer receives it, so the rung goes first.
            self._write(dst, [_prefix(_ON_RING, 0)])
            t2 = time.perf_counter()
            mx.eval(mx.distributed.send(x, dst, group=self.group, stream=self.stream))
            t3 = time.perf_counter()
        work = t0 - self._mark if self._mark is not None else 0.0
        self._mark = t3
        self._sample(x.nbytes, send_work=work, send_ready=t1 - t0, send_ring=t3 - t2, send_bell=t2 - t1)

    @property
    def stream(self) -> Any:
        """The communication stream every transfer on the ring goes through (made on first use)."""
        if self._stream is None:
            import mlx.core as mx

            self._stream = mx.new_stream(mx.cpu)
        return self._stream

    def send_op(self, x: Any, dst: int) -> Any:
        """The send of ``x`` to the next member as an op (lazy: evaluating it sends once ``x`` is computed)."""
        import mlx.core as mx

        self._check_graph(dst, (self.rank + 1) % self.size, "sends to the next member")
        return mx.distributed.send(x, dst, group=self.group, stream=self.stream)

    def recv_op(self, shape: tuple[int, ...], dtype: Any, src: int) -> Any:
        """A receive from the member before as an op (lazy: it receives when evaluated; on MLX CUDA a device op fed
        by it in the same evaluation waits for it on the host, MLX's fence, and in a later evaluation in a kernel
        spinning on the device). A lost member raises in the evaluation ("connection to a peer was lost")."""
        import mlx.core as mx

        self._check_graph(src, (self.rank - 1) % self.size, "receives from the member before")
        return mx.distributed.recv(shape, dtype, src, group=self.group, stream=self.stream)

    def collective_send(self, x: Any) -> Any:
        """The collective wire's send of ``x`` to the other member: an all-sum of the group of two (lazy)."""
        import mlx.core as mx

        return mx.distributed.all_sum(x, group=self.group, stream=self._collective_stream())

    def collective_recv(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """The collective wire's receive from the other member: the all-sum its send pairs with, this member adding
        zeros (lazy)."""
        import mlx.core as mx

        return mx.distributed.all_sum(mx.zeros(shape, dtype=dtype), group=self.group, stream=self._collective_stream())

    def _collective_stream(self) -> Any:
        if not self.collective_ops:
            raise ValueError(f"the collective wire needs a group of two, not {self.size}")
        return self.stream if self._backend == "ring" else None  # (NCCL: the device's own stream)

    def _check_graph(self, rank: int, allowed: int, what: str) -> None:
        if not self.graph_ops:
            raise ValueError("this link has no graph ops (the ring backend's, for a pipeline)")
        if rank != allowed:
            raise ValueError(f"rank {self.rank} {what} only, not rank {rank}")

    def _write(self, dst: int, parts: list[Any]) -> None:
        try:
            if len(parts) == 1:
                self._to_next.sendall(parts[0])
            else:
                _sendmsg_all(self._to_next, parts)
        except OSError as e:
            raise GroupError(f"member {dst} of the pipeline group is gone ({e})") from e

    def recv(self, shape: tuple[int, ...], dtype: Any, src: int) -> Any:
        import mlx.core as mx

        if src != (self.rank - 1) % self.size:
            raise ValueError(f"rank {self.rank} receives from the member before it only, not from {src}")
        t0 = time.perf_counter()
        try:
            kind, size = _read_prefix(self._from_previous)
        except (OSError, ConnectionError) as e:
            raise GroupError(f"member {src} of the pipeline group is gone ({e})") from e
        t1 = time.perf_counter()
        nbytes = dtype.size
        for n in shape:
            nbytes *= n
        if kind == _INLINE:
            if size != nbytes:
                raise GroupError(f"member {src} sent {size} bytes where this member expected {shape} {dtype}")
            buffer = self._buffers.get(size)
            if buffer is None:
                buffer = self._buffers[size] = bytearray(size)
            try:
                _read_into(self._from_previous, memoryview(buffer))
            except (OSError, ConnectionError) as e:
                raise GroupError(f"member {src} of the pipeline group is gone ({e})") from e
            out = _from_bytes(buffer, shape, dtype)  # a copy: the buffer is the next message's
        elif kind == _ON_RING:
            out = mx.distributed.recv(shape, dtype, src, group=self.group, stream=self.stream)
            if self.timed_receives:
                mx.eval(out)
        else:
            raise GroupError(f"member {src} sent a doorbell message of kind {kind}")
        t2 = time.perf_counter()
        gap = t0 - self._mark if self._mark is not None else 0.0
        self._mark = t2
        self._sample(nbytes, recv_gap=gap, recv_wait=t1 - t0, recv_ring=t2 - t1)
        return out

    def peer_lost(self) -> bool:
        """Whether a neighbour closed its doorbell (it exited or was killed): checked without waiting and without
        taking any message (a member reads from its neighbour only inside a call, so between calls anything
        readable on a doorbell is its end)."""
        import select

        for s in (self._from_previous, self._to_next):
            try:
                readable, _, failed = select.select([s], [], [s], 0)
                if failed or (readable and not s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)):
                    return True
            except BlockingIOError:
                continue
            except OSError:
                return True
        return False

    def hangups(self) -> list[socket.socket]:
        """The doorbells, for a watchdog that waits for either to close (``watch_hangups``)."""
        return [self._from_previous, self._to_next]

    def report(self) -> dict[str, Any]:
        """Every phase's samples (seconds per step message), for the benchmark."""
        return {"rank": self.rank, "size": self.size, "timed_receives": self.timed_receives,
                "inline_bytes": self.inline_bytes, "samples": self.samples}


def _prefix(kind: int, size: int) -> bytes:
    return bytes([kind]) + size.to_bytes(4, "big")


def _sendmsg_all(s: socket.socket, parts: list[Any]) -> None:
    """Write ``parts`` in one call where the kernel takes them whole (the usual case), else the rest after."""
    sent = s.sendmsg(parts)
    if sent < sum(len(p) for p in parts):
        s.sendall(b"".join(bytes(p) for p in parts)[sent:])


def _read_prefix(s: socket.socket) -> tuple[int, int]:
    prefix = bytearray(5)
    _read_into(s, memoryview(prefix))
    return prefix[0], int.from_bytes(prefix[1:], "big")


def _read_into(s: socket.socket, view: memoryview) -> None:
    while view:
        n = s.recv_into(view)
        if not n:
            raise ConnectionError("its connection closed")
        view = view[n:]


def _from_bytes(buffer: bytearray, shape: tuple[int, ...], dtype: Any) -> Any:
    """An MLX array of ``shape`` and ``dtype`` from its bytes (copied; bf16 through a 16-bit view)."""
    import mlx.core as mx
    import numpy as np

    carrier = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[dtype.size]
    x = mx.array(np.frombuffer(buffer, dtype=carrier))
    return (x.view(dtype) if x.dtype != dtype else x).reshape(shape)


def _prove_members(group: Any, hosts: Sequence[str], rank: int, key: bytes) -> None:
    """Every member proves the secret to every other over the ring, before the ring carries anything else:
    fresh nonces first (all of them), then each member's HMAC over all the nonces, its rank and the hosts."""
    import mlx.core as mx

    nonce = secrets.token_bytes(NONCE_BYTES)
    nonces = mx.distributed.all_gather(mx.array(list(nonce), dtype=mx.uint8), group=group)
    nonces = bytes(nonces.tolist())
    ring = ",".join(hosts)
    proof = _mac(key, "exo-ring-v1", ring, rank, nonces)
    proofs = mx.distributed.all_gather(mx.array(list(proof), dtype=mx.uint8), group=group)
    proofs = bytes(proofs.tolist())
    if nonces[rank * NONCE_BYTES : (rank + 1) * NONCE_BYTES] != nonce:
        raise GroupAuthError(f"rank {rank}: the ring did not carry this member's nonce back (a stray on the ring?)")
    for member in range(len(hosts)):
        got = proofs[member * len(proof) : (member + 1) * len(proof)]
        if not hmac.compare_digest(got, _mac(key, "exo-ring-v1", ring, member, nonces)):
            raise GroupAuthError(f"member {member} ({hosts[member]}) of the pipeline group did not prove the cluster "
                                 "secret (EXO_CLUSTER_SECRET): the group is not formed")


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed during the handshake")
        data += chunk
    return data


def _ring_doorbell(to_next: socket.socket, key: bytes, ring: str, rank: int) -> None:
    """The connecting side of a doorbell: answer the next member's challenge, then check its answer to ours."""
    challenge = _recv_exactly(to_next, NONCE_BYTES)
    own = secrets.token_bytes(NONCE_BYTES)
    to_next.sendall(_mac(key, "exo-doorbell-v1", ring, rank, challenge) + own)
    answer = _recv_exactly(to_next, 32)
    if not hmac.compare_digest(answer, _mac(key, "exo-doorbell-ack-v1", ring, rank, own)):
        raise GroupAuthError(f"the doorbell of member {(rank + 1) % len(ring.split(','))} did not prove the cluster secret")


def _answer_doorbell(listener: socket.socket, key: bytes, ring: str, previous: int, deadline: float) -> socket.socket:
    """The accepting side: take the first connection that proves the secret for ``previous``; close the others."""
    while True:
        listener.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            conn, address = listener.accept()
        except TimeoutError as e:
            raise GroupError(f"member {previous} never rang this member's doorbell") from e
        try:
            conn.settimeout(min(DOORBELL_HANDSHAKE_S, max(0.001, deadline - time.monotonic())))
            challenge = secrets.token_bytes(NONCE_BYTES)
            conn.sendall(challenge)
            reply = _recv_exactly(conn, 32 + NONCE_BYTES)
            if not hmac.compare_digest(reply[:32], _mac(key, "exo-doorbell-v1", ring, previous, challenge)):
                raise GroupAuthError("a wrong proof")
            conn.sendall(_mac(key, "exo-doorbell-ack-v1", ring, previous, reply[32:]))
            return conn
        except (OSError, GroupAuthError) as e:  # a stray (a scanner, a node without the secret): refused
            log.warning("refused a connection to the pipeline doorbell from %s: %s", address, e)
            conn.close()


def _doorbells(group: Any, hosts: Sequence[str], rank: int, timeout_s: float,
               key: bytes) -> tuple[socket.socket, socket.socket, int]:
    """Connect to the next member's doorbell and accept the previous member's (ports swapped over the ring),
    each connection proving the secret both ways before it is used."""
    import mlx.core as mx

    def address(i: int) -> tuple[str, int]:
        host, port = hosts[i].rsplit(":", 1)
        return host.strip("[]"), int(port)

    own = address(rank)[0]
    ring = ",".join(hosts)
    previous = (rank - 1) % len(hosts)
    family = socket.AF_INET6 if ":" in own else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    deadline = time.monotonic() + timeout_s
    accepted: list[socket.socket | BaseException] = []
    try:
        listener.bind((own, 0))
        listener.listen(8)
        port = int(listener.getsockname()[1])
        ports = mx.distributed.all_gather(mx.array([port], dtype=mx.int32), group=group)
        # Accepting beside connecting: every member connects first, and each handshake needs its acceptor.
        acceptor = threading.Thread(
            target=lambda: accepted.append(_try(_answer_doorbell, listener, key, ring, previous, deadline)),
            name="exo-doorbell-accept", daemon=True)
        acceptor.start()
        following = (rank + 1) % len(hosts)
        to_next = socket.create_connection((address(following)[0], int(ports[following].item())), timeout_s)
        try:
            to_next.settimeout(max(0.001, deadline - time.monotonic()))
            _ring_doorbell(to_next, key, ring, rank)
        except GroupAuthError:
            to_next.close()
            raise
        except OSError as e:
            to_next.close()
            raise GroupError(f"the doorbell of member {following}: {e}") from e
        acceptor.join(max(0.0, deadline - time.monotonic()) + 1.0)
    finally:
        listener.close()
    if not accepted:
        to_next.close()
        raise GroupError(f"member {previous} never rang this member's doorbell")
    if isinstance(accepted[0], BaseException):
        to_next.close()
        raise accepted[0]
    from_previous = accepted[0]
    for s in (to_next, from_previous):
        s.settimeout(None)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        keep_alive(s)
    return to_next, from_previous, port


def _try(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except BaseException as e:  # noqa: BLE001 - handed to the joining thread
        return e


def keep_alive(s: socket.socket) -> None:
    """Probe an idle connection so that an unreachable peer is an error within ~5 s (Linux and macOS)."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = getattr(socket, "TCP_KEEPIDLE", None) or getattr(socket, "TCP_KEEPALIVE", None)  # macOS: KEEPALIVE
    for option, value in ((idle, KEEPALIVE_IDLE_S), (getattr(socket, "TCP_KEEPINTVL", None), KEEPALIVE_INTERVAL_S),
                          (getattr(socket, "TCP_KEEPCNT", None), KEEPALIVE_PROBES)):
        if option is not None:
            s.setsockopt(socket.IPPROTO_TCP, option, value)


BACKENDS = ("ring", "nccl", "jaccl")
DOORBELL_ONLY = 2**32 - 1  # ``RingLink(inline_bytes=...)``: every message on the doorbell (its frame's limit)


def _backend_environment(backend: str, hosts: Sequence[str], rank: int) -> str | None:
    """Point MLX's ``backend`` at this group (environment variables it reads at ``init``); returns a file to remove
    afterwards. ring: a hostfile of every member's ring port. nccl: rank 0's host and port bootstrap the
    communicator. jaccl: rank 0's as its coordinator; the RDMA devices come from ``EXO_JACCL_DEVICES`` (a file in
    MLX's format, its rows in the group's rank order; docs/cluster.md)."""
    os.environ["MLX_RANK"] = str(rank)
    os.environ["MLX_WORLD_SIZE"] = str(len(hosts))
    first_host, first_port = hosts[0].rsplit(":", 1)
    if backend == "nccl":
        os.environ["NCCL_HOST_IP"] = first_host.strip("[]")
        os.environ["NCCL_PORT"] = first_port
        return None
    if backend == "jaccl":
        devices = os.environ.get("EXO_JACCL_DEVICES")
        if not devices:
            raise GroupError("the jaccl backend needs EXO_JACCL_DEVICES: a file listing each member's RDMA devices "
                             "(docs/cluster.md)")
        os.environ["MLX_IBV_DEVICES"] = devices
        os.environ["MLX_JACCL_COORDINATOR"] = f"{first_host.strip('[]')}:{first_port}"
        return None
    fd, path = tempfile.mkstemp(prefix="exo-ring-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump([[h] for h in hosts], f)
    os.environ["MLX_HOSTFILE"] = path
    return path


def join_group(hosts: Sequence[str], rank: int, timeout_s: float = JOIN_TIMEOUT_S, *,
               secret: str | None = None, backend: str = "ring", inline_bytes: int | None = None) -> RingLink:
    """Join the group of ``hosts`` ("ip:port" per rank) as ``rank``; returns the member's ``RingLink``. With
    ``secret`` (the cluster's), every member proves it before the group carries anything (``GroupAuthError``);
    without, the proofs still tie the members to this group's hosts (a member of another group is refused).
    ``backend``: MLX's distributed backend (``BACKENDS``; a pipeline's is the ring, a tensor group's may be NCCL
    on NVIDIA GPUs or JACCL over Thunderbolt RDMA); its port is the member's ``hosts`` port (nccl and jaccl use
    rank 0's). ``inline_bytes``: ``RingLink``'s (a tensor group: ``DOORBELL_ONLY``)."""
    import mlx.core as mx

    if not 0 <= rank < len(hosts) or len(hosts) < 2:
        raise GroupError(f"rank {rank} of a group of {len(hosts)} hosts")
    if backend not in BACKENDS:
        raise GroupError(f"unknown distributed backend {backend!r} (one of {', '.join(BACKENDS)})")
    path = _backend_environment(backend, hosts, rank)
    joined = threading.Event()

    def watchdog() -> None:
        if not joined.wait(timeout_s):
            log.error("the pipeline group %s did not form within %.0f s", ",".join(hosts), timeout_s)
            os._exit(EXIT_GROUP_LOST)

    threading.Thread(target=watchdog, name="exo-group-join-watchdog", daemon=True).start()
    try:
        group = mx.distributed.init(strict=True, backend=backend)
        if group.size() != len(hosts) or group.rank() != rank:
            raise GroupError(f"joined as rank {group.rank()} of {group.size()}, expected {rank} of {len(hosts)}")
        key = secret.encode() if secret else b""
        _prove_members(group, hosts, rank, key)
        to_next, from_previous, doorbell_port = _doorbells(group, hosts, rank, timeout_s, key)
    finally:
        joined.set()
        if path is not None:
            os.unlink(path)
    return RingLink(group, to_next, from_previous, doorbell_port, inline_bytes=inline_bytes, backend=backend)


def watch_hangups(link: RingLink, on_hangup: Any) -> None:
    """Call ``on_hangup()`` (on a thread of its own) once a neighbour's doorbell closes. For backends whose
    collectives wait for a lost member without end (NCCL, JACCL): a member blocked in one is ended by its
    watchdog instead (the ring backend raises in the collective itself)."""
    import select

    def watch() -> None:
        poller = select.poll()
        ended = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0)  # (macOS: a read of 0 bytes)
        sockets = {s.fileno(): s for s in link.hangups()}
        for s in sockets.values():
            poller.register(s, ended | select.POLLIN)
        while True:
            events = poller.poll()
            if any(event & ended for _, event in events):
                break
            try:  # readable: a message for the main thread, or the end (nothing to peek)
                if any(not sockets[fd].recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) for fd, _ in events):
                    break
            except BlockingIOError:
                pass
            except OSError:
                break
            time.sleep(0.05)  # the main thread takes the message
        on_hangup()

    threading.Thread(target=watch, name="exo-group-hangup-watch", daemon=True).start()
