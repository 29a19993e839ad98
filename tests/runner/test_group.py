"""The stages' link: messages over the mx.distributed ring, announced on a doorbell; a member that goes
away is an error at once for the one waiting on it, never a receive that spins forever."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from exo.runner.group import free_port

MEMBER = textwrap.dedent(
    """
    import os, sys, time
    import mlx.core as mx
    from exo.runner.group import GroupError, join_group

    rank, hosts, mode = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3]
    link = join_group(hosts, rank, timeout_s=30)
    peer = (rank + 1) % 2
    if rank == 0:
        for i in range(20):  # ping-pong: what is sent is what arrives, in order, both ways
            link.send(mx.arange(i, i + 4096, dtype=mx.int32).reshape(1, -1), peer)
            back = link.recv((1, 4096), mx.int32, peer)
            assert back.tolist()[0] == list(range(i + 1, i + 4097)), i
        big = mx.ones((1, 2048, 1024), dtype=mx.bfloat16)  # larger than the socket buffers
        link.send(big, peer)
        print("rank 0 done", flush=True)
        if mode == "vanish":
            os._exit(0)  # gone without a word, as a killed process
        link.send(mx.array([7], dtype=mx.int32), peer)
    else:
        for i in range(20):
            x = link.recv((1, 4096), mx.int32, peer)
            link.send(x + 1, peer)
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


def run_pair(mode: str) -> list[str]:
    hosts = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen([sys.executable, "-c", MEMBER, str(rank), hosts, mode], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for rank in (0, 1)
    ]
    outs = []
    deadline = time.monotonic() + 60
    for p in procs:
        out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        assert p.returncode == 0, err
        outs.append(out.strip())
    return outs


def test_messages_arrive_in_order_both_ways_and_a_vanished_member_is_an_error_at_once() -> None:
    assert run_pair("stay") == ["rank 0 done", "rank 1 got 7"]
    first, second = run_pair("vanish")
    assert first == "rank 0 done"
    assert second.startswith("rank 1 GroupError after") and "gone" in second, second
    # At once, not at the group's 30 s timeout: a third of it leaves a loaded machine room.
    assert float(second.split("after ")[1].split("s:")[0]) < 10.0, second


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
