"""The stages' link: messages over the mx.distributed ring, announced on a doorbell; a member that goes
away is an error at once for the one waiting on it, never a receive that spins forever."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from exo.runner.group import free_port
from exo.wire.runner import EXIT_GROUP_LOST

MEMBER = textwrap.dedent(
    """
    import os, sys, time
    import mlx.core as mx
    from exo.runner.group import GroupError, join_group

    rank, hosts, mode, secret = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3], sys.argv[4]
    try:
        link = join_group(hosts, rank, timeout_s=30, secret=None if secret == "-" else secret)
    except Exception as e:  # the group did not form: nothing of the other side was used
        print(f"rank {rank} {type(e).__name__} at join: {e}", flush=True)
        sys.exit(0)
    peer = (rank + 1) % 2

    def stray(port):  # a connection to a port of this member once the group has formed
        import socket
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            return "accepted"
        except ConnectionRefusedError:
            return "refused"

    if mode == "stray":  # every member's ring and doorbell ports, now, from a stranger
        print(f"rank {rank} ring {stray(int(hosts[rank].rsplit(':', 1)[1]))} doorbell {stray(link.doorbell_port)}",
              flush=True)
    if rank == 0:
        for i in range(20):  # ping-pong: what is sent is what arrives, in order, both ways
            link.send(mx.arange(i, i + 4096, dtype=mx.int32).reshape(1, -1), peer)
            back = link.recv((1, 4096), mx.int32, peer)
            assert back.tolist()[0] == list(range(i + 1, i + 4097)), i
        small = mx.arange(24, dtype=mx.float32).reshape(4, 6).T.astype(mx.bfloat16)  # not contiguous, bf16
        link.send(small, peer)
        big = mx.ones((1, 2048, 1024), dtype=mx.bfloat16)  # larger than the socket buffers: on the ring
        link.send(big, peer)
        print("rank 0 done", flush=True)
        if mode == "vanish":
            os._exit(0)  # gone without a word, as a killed process
        link.send(mx.array([7], dtype=mx.int32), peer)
    else:
        for i in range(20):
            x = link.recv((1, 4096), mx.int32, peer)
            link.send(x + 1, peer)
        small = link.recv((6, 4), mx.bfloat16, peer)
        assert small.tolist() == mx.arange(24, dtype=mx.float32).reshape(4, 6).T.tolist(), small
        big = link.recv((1, 2048, 1024), mx.bfloat16, peer)
        assert big.sum().item() == 2048 * 1024
        started = time.monotonic()
        try:
            last = link.recv((1,), mx.int32, peer)
            print("rank 1 got", last.item(), flush=True)
        except GroupError as e:
            print(f"rank 1 GroupError after {time.monotonic() - started:.2f}s: {e}", flush=True)
    """
)


def run_pair(mode: str, secrets: tuple[str, str] = ("-", "-"), *, hosts: str | None = None,
             before_rank_1=None, codes: list[int] | None = None, env: dict[str, str] | None = None) -> list[str]:
    """The two members' outputs; every member must exit 0 unless ``codes`` is given (then it gets the codes)."""
    import os

    hosts = hosts or f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    procs = []
    for rank in (0, 1):
        if rank == 1 and before_rank_1 is not None:
            before_rank_1()
        procs.append(subprocess.Popen([sys.executable, "-c", MEMBER, str(rank), hosts, mode, secrets[rank]],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env={**os.environ, **(env or {})}))
    outs = []
    deadline = time.monotonic() + 60
    for p in procs:
        out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        if codes is None:
            assert p.returncode == 0, err
        else:
            codes.append(p.returncode)
        outs.append(out.strip())
    return outs


def test_messages_arrive_in_order_both_ways_and_a_vanished_member_is_an_error_at_once() -> None:
    """Step-sized messages travel on the doorbell, larger ones on the ring; both arrive as sent, in order."""
    assert run_pair("stay") == ["rank 0 done", "rank 1 got 7"]
    assert run_pair("stay", env={"EXO_RING_INLINE_BYTES": "0"}) == ["rank 0 done", "rank 1 got 7"]  # all on the ring
    first, second = run_pair("vanish")
    assert first == "rank 0 done"
    assert second.startswith("rank 1 GroupError after") and "gone" in second, second
    # At once, not at the group's 30 s timeout: a third of it leaves a loaded machine room.
    assert float(second.split("after ")[1].split("s:")[0]) < 10.0, second


def test_members_prove_the_secret_and_once_formed_a_stray_connection_is_refused_mid_generation() -> None:
    """With the cluster secret the group forms and carries its messages as without; once it has formed, a
    stranger's connection to a member's ring or doorbell port is refused (no listener is left) and the
    messages that follow arrive as they should."""
    assert run_pair("stray", ("s3cret", "s3cret")) == [
        "rank 0 ring refused doorbell refused\nrank 0 done", "rank 1 ring refused doorbell refused\nrank 1 got 7"]


@pytest.mark.parametrize("secrets", [("s3cret", "another"), ("s3cret", "-")])
def test_a_member_without_the_secret_is_refused_before_any_message(secrets) -> None:
    """A member that does not hold the secret (or another one) completes MLX's ring, which authenticates
    nothing: the proofs that follow at once fail on both sides, before any header or tensor is used."""
    outs = run_pair("stay", secrets)
    for rank, out in enumerate(outs):
        assert out.startswith(f"rank {rank} GroupAuthError at join:") and "did not prove the cluster secret" in out, outs


def test_a_stray_on_the_ring_port_during_the_join_never_becomes_a_member() -> None:
    """MLX's ring takes the first connection to a member's ring port, whoever makes it (it offers no hook to
    authenticate it): a stranger that connects first, and sends what would be a nonce and a proof, makes the
    join fail on both sides (the daemons form the group anew); no member runs with it."""
    import socket

    hosts = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    port0 = int(hosts.split(",")[0].rsplit(":", 1)[1])
    strays: list[socket.socket] = []

    def stray_first() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                s = socket.create_connection(("127.0.0.1", port0), timeout=1)
            except OSError:
                time.sleep(0.005)
                continue
            s.sendall(bytes(range(64)) * 4)
            strays.append(s)
            return
        raise AssertionError("rank 0 never listened")

    codes: list[int] = []
    try:
        outs = run_pair("stay", ("s3cret", "s3cret"), hosts=hosts, before_rank_1=stray_first, codes=codes)
    finally:
        for s in strays:
            s.close()
    assert strays
    # Each member reports the failed join (the member the stray took the place of cannot connect; the other
    # cannot either, or waits in the proofs for bytes that never come), or the join's watchdog ends it:
    # neither ever passes a message.
    for code, out in zip(codes, outs, strict=True):
        assert code in (0, EXIT_GROUP_LOST) and (out == "" or " at join: " in out), (codes, outs)


def test_a_doorbell_takes_only_a_connection_that_proves_the_secret(monkeypatch) -> None:
    """The doorbell is exo's own socket: strays before the member (silent, a wrong proof, another secret) are
    closed and the listener waits on; the member's connection, which proves the secret, is the one taken."""
    import socket
    import threading

    from exo.runner import group

    monkeypatch.setattr(group, "DOORBELL_HANDSHAKE_S", 0.5)
    ring, key = "127.0.0.1:1,127.0.0.1:2", b"s3cret"
    with socket.create_server(("127.0.0.1", 0), backlog=8) as listener:
        address = listener.getsockname()
        silent = socket.create_connection(address)
        garbage = socket.create_connection(address)
        garbage.sendall(bytes(64))
        other = socket.create_connection(address)
        other_failed: list[BaseException] = []

        def other_secret() -> None:
            try:
                group._ring_doorbell(other, b"another", ring, 0)
            except Exception as e:  # noqa: BLE001 - what the stray saw, checked below
                other_failed.append(e)

        other_thread = threading.Thread(target=other_secret, daemon=True)
        other_thread.start()
        member = socket.create_connection(address)
        member_done: list[BaseException | None] = []
        member_thread = threading.Thread(
            target=lambda: member_done.append(group._try(group._ring_doorbell, member, key, ring, 0)), daemon=True)
        member_thread.start()
        taken = group._answer_doorbell(listener, key, ring, 0, time.monotonic() + 10)
        member_thread.join(10)
        assert member_done == [None]  # the member checked the doorbell's proof too
        with taken, member, silent, garbage, other:
            member.sendall(b"\x01")
            assert taken.recv(1) == b"\x01"  # the one taken is the member's
            for stray in (silent, garbage):
                assert _until_closed(stray) == group.NONCE_BYTES  # the challenge, then closed
            other_thread.join(10)  # the refusal reaches the other-secret side on its own thread: wait for it
    assert len(other_failed) == 1 and isinstance(other_failed[0], ConnectionError), other_failed


def _until_closed(s) -> int:
    """Bytes read from ``s`` until the other side closed it (fails if it stays open for 5 s)."""
    s.settimeout(5)
    total = 0
    while True:
        try:
            data = s.recv(4096)
        except ConnectionResetError:
            return total
        if not data:
            return total
        total += len(data)


def test_doorbells_probe_an_idle_connection() -> None:
    """A member whose machine sleeps or whose network is cut closes nothing: the doorbell's TCP keepalive
    makes the waiting member's receive fail within seconds instead of waiting for the daemons."""
    import socket

    from exo.runner.group import KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES, keep_alive

    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
        with client, peer:
            keep_alive(client)
            assert client.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE_IDLE_S
            assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == KEEPALIVE_INTERVAL_S
            assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == KEEPALIVE_PROBES
            assert KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_PROBES <= 6  # well inside the 15 s bound


def test_free_port_never_names_a_port_twice(monkeypatch, tmp_path) -> None:
    """The kernel may hand a port freed a moment ago straight back (a fresh machine's run met a daemon whose API
    and gRPC ports were the same): free_port skips every port this process handed out before. The kernel's
    choice is the outer edge simulated here."""
    import socket

    from exo.runner import group

    choices = iter([50_001, 50_001, 50_001, 50_002])

    class Kernel(socket.socket):
        def bind(self, address) -> None:
            self._port = next(choices)

        def getsockname(self):
            return ("127.0.0.1", self._port)

    monkeypatch.setattr(group, "_HANDED_OUT", set())
    monkeypatch.setattr(group, "_claims_dir", lambda: tmp_path)
    monkeypatch.setattr(group.socket, "socket", Kernel)
    assert [group.free_port(), group.free_port()] == [50_001, 50_002]


def test_free_port_skips_a_port_another_process_took_until_its_claim_is_old(monkeypatch, tmp_path) -> None:
    """Between free_port and its taker's bind the port is free, and the kernel would hand it to anyone: a
    port another process took less than PORT_CLAIM_S ago is skipped, an older claim is stale."""
    import os
    import socket

    from exo.runner import group

    choices = iter([50_011, 50_012, 50_013])

    class Kernel(socket.socket):
        def bind(self, address) -> None:
            self._port = next(choices)

        def getsockname(self):
            return ("127.0.0.1", self._port)

    (tmp_path / "50011").write_text("1")  # another process, a moment ago
    (tmp_path / "50012").write_text("1")  # another process, long ago
    old = time.time() - group.PORT_CLAIM_S - 1
    os.utime(tmp_path / "50012", (old, old))
    monkeypatch.setattr(group, "_HANDED_OUT", set())
    monkeypatch.setattr(group, "_claims_dir", lambda: tmp_path)
    monkeypatch.setattr(group.socket, "socket", Kernel)
    assert group.free_port() == 50_012
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.isdigit()) == ["50011", "50012"]
    assert (tmp_path / "50012").read_text() == str(os.getpid())


HAND_OUT = textwrap.dedent(
    """
    import sys, time
    from exo.runner.group import free_port
    time.sleep(max(0.0, float(sys.argv[1]) - time.time()))  # both start at once
    print(",".join(str(free_port()) for _ in range(300)))
    """
)


def test_processes_side_by_side_never_hand_out_the_same_port(tmp_path) -> None:
    """Two processes asking the real kernel at once (two daemons starting, test workers side by side): without
    the host-wide claims, 300 ports each out of the ~28k ephemeral range share a few on average."""
    import os

    start = str(time.time() + 1.5)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", HAND_OUT, start], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    ports = [set(map(int, p.communicate(timeout=60)[0].split(","))) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert len(ports[0]) == len(ports[1]) == 300
    assert not ports[0] & ports[1]


class _Group:
    """What RingLink asks of its mx.distributed group here: its rank and size (no collective runs)."""

    def rank(self) -> int:
        return 1

    def size(self) -> int:
        return 2


def test_a_closed_doorbell_is_a_lost_member_and_a_waiting_message_is_not() -> None:
    """``peer_lost`` (a tensor group's leader asks it after a collective failed outside its calls) and
    ``watch_hangups`` (NCCL and JACCL members, whose collectives wait without end) see a neighbour's closed
    doorbell, without taking a message from it."""
    import socket
    import threading

    from exo.runner.group import RingLink, watch_hangups

    ours_next, theirs_next = socket.socketpair()
    ours_previous, theirs_previous = socket.socketpair()
    link = RingLink(_Group(), ours_next, ours_previous)
    hung = threading.Event()
    watch_hangups(link, hung.set)
    assert not link.peer_lost()
    theirs_previous.sendall(b"\x02\x00\x00\x00\x01x")  # a message for this member: not an end
    time.sleep(0.2)
    assert not link.peer_lost() and not hung.is_set()
    assert ours_previous.recv(6) == b"\x02\x00\x00\x00\x01x"  # still there, whole
    theirs_next.close()  # the next member is gone
    assert hung.wait(5)
    assert link.peer_lost()
    theirs_previous.close()


def test_free_port_names_ports_below_the_kernel_s_ephemeral_range(monkeypatch, tmp_path) -> None:
    """A port from a bind to port 0 is an ephemeral one: any outgoing connection may take it before its taker
    binds it (a CI run lost a daemon's API port so). free_port chooses below the ephemeral range, and another
    candidate where one is taken."""
    import socket
    from pathlib import Path

    from exo.runner import group

    monkeypatch.setattr(group, "_claims_dir", lambda: tmp_path)
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [group.free_port() for _ in range(20)]
    assert all(group.PORTS_FROM <= p < low for p in ports), ports
    taken = socket.socket()
    taken.bind(("127.0.0.1", ports[0]))
    try:
        monkeypatch.setattr(group, "_HANDED_OUT", set())
        candidates = iter([ports[0], ports[1]])
        monkeypatch.setattr(group.random, "randint", lambda a, b: next(candidates))
        monkeypatch.setattr(group, "_claims_dir", lambda: tmp_path / "fresh")
        (tmp_path / "fresh").mkdir()
        assert group.free_port() == ports[1]  # the taken candidate skipped
    finally:
        taken.close()
