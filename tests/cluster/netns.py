"""A throwaway LAN of Linux network namespaces for cluster tests.

    require(netns_unavailable())
    with NetnsLab(3) as lab:
        lab.run(0, ["ip", "-br", "addr"])
        proc = lab.popen(1, [sys.executable, "-c", "..."], stdout=subprocess.PIPE)

Layout: one namespace holds only a bridge (``br0``, multicast snooping off so mDNS floods); each node
namespace has ``lo`` up and one veth ``eth0`` plugged into that bridge, with address
``10.<a>.<b>.<i+1>/24`` and a route for 224.0.0.0/4 (multicast) on it. Nothing is added to the root
namespace, so the host's firewall and interfaces are untouched. Names carry the pid and a counter, so
parallel runs never collide; ``close()`` (also on a failed setup) kills whatever still runs inside the
namespaces and deletes them, which removes the veths and the bridge with them. Labs left behind by a
killed run (their pid is gone) are removed by the next ``NetnsLab``.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

_PREFIX = "exotest"
_NAME = re.compile(rf"^{_PREFIX}(\d+)x(\d+)-")
_counter = itertools.count()

# Prints the status line then the body; a refused or timed-out connection prints status 0.
_HTTP_GET = r"""
import sys, urllib.error, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=float(sys.argv[2])) as r:
        status, body = r.status, r.read()
except urllib.error.HTTPError as e:
    status, body = e.code, e.read()
except OSError as e:
    status, body = 0, str(e).encode()
sys.stdout.write(f"{status}\n"); sys.stdout.flush(); sys.stdout.buffer.write(body)
"""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


def require(reason: str | None) -> None:
    """Skip with ``reason`` where it is not None; under ``CI`` fail instead, as the dashboard's tests do: CI
    runs as root on a host with multicast, and a silent skip there would hide the tests that need it."""
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must run this test (as root, with iproute2 and multicast)")
    pytest.skip(reason)


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be used here (a skip reason), or None when they can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "iproute2 `ip` is not installed"
    probe = f"{_PREFIX}{os.getpid()}x{next(_counter)}-probe"
    try:
        added = _ip("netns", "add", probe, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`ip netns add` failed: {e}"
    if added.returncode != 0:
        return f"`ip netns add` not permitted here (no CAP_SYS_ADMIN?): {added.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class NetnsLab:
    """``n`` namespaces on one bridged /24. ``names[i]`` is node i's namespace, ``ips[i]`` its address."""

    def __init__(self, n: int) -> None:
        if not 1 <= n <= 250:
            raise ValueError("between 1 and 250 nodes")
        pid = os.getpid()
        self.tag = f"{_PREFIX}{pid}x{next(_counter)}"
        self.bridge_ns = f"{self.tag}-br"
        self.names = [f"{self.tag}-n{i}" for i in range(n)]
        # 10.<a>.<b>.0/24 from the pid: distinct subnets make a log line say which run it came from.
        self.subnet = f"10.{(pid >> 8) & 255}.{pid & 255}"
        self.ips = [f"{self.subnet}.{i + 1}" for i in range(n)]
        self._created: list[str] = []

    def __enter__(self) -> NetnsLab:
        self.setup()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def setup(self) -> None:
        remove_stale_labs()
        try:
            self._add_ns(self.bridge_ns)
            self._in(self.bridge_ns, "link", "add", "br0", "type", "bridge", "mcast_snooping", "0")
            self._in(self.bridge_ns, "link", "set", "br0", "up")
            for i, (ns, ip) in enumerate(zip(self.names, self.ips, strict=True)):
                self._add_ns(ns)
                # Created straight inside the two namespaces: no name ever exists in the root namespace.
                port = f"p{i}"
                _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns",
                    self.bridge_ns)  # fmt: skip
                self._in(ns, "link", "set", "lo", "up")
                self._in(ns, "addr", "add", f"{ip}/24", "dev", "eth0")
                self._in(ns, "link", "set", "eth0", "up")
                self._in(ns, "route", "add", "224.0.0.0/4", "dev", "eth0")
                self._in(self.bridge_ns, "link", "set", port, "master", "br0")
                self._in(self.bridge_ns, "link", "set", port, "up")
        except BaseException:
            self.close()
            raise

    def exec_argv(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside node i's namespace."""
        return ["ip", "netns", "exec", self.names[i], *argv]

    def run(self, i: int, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("timeout", 30)
        return subprocess.run(self.exec_argv(i, argv), **kwargs)

    def popen(self, i: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        return subprocess.Popen(self.exec_argv(i, argv), **kwargs)

    def http_get(self, i: int, url: str, timeout: float = 5.0) -> tuple[int, str]:
        """GET ``url`` from inside node i's namespace (the root namespace has no route into the lab):
        (status, body); status 0 when nothing answered."""
        result = self.run(i, [sys.executable, "-c", _HTTP_GET, url, str(timeout)], timeout=timeout + 10)
        status, _, body = result.stdout.partition("\n")
        return (int(status), body) if status.isdigit() else (0, result.stderr)

    def close(self) -> None:
        """Kill what still runs inside, delete the namespaces (with their veths and bridge)."""
        for ns in reversed(self._created):
            _delete_ns(ns)
        self._created.clear()

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._created.append(ns)

    @staticmethod
    def _in(ns: str, *args: str) -> None:
        _ip("-n", ns, *args)


def _delete_ns(ns: str) -> None:
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [int(p) for p in pids if _alive(int(p))]
        for pid in alive:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 3
        while alive and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = [p for p in alive if _alive(p)]
        if not alive:
            break
    _ip("netns", "del", ns, check=False)


def _alive(pid: int) -> bool:
    # A zombie child still "exists" for kill(0); /proc says whether it is really running.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def remove_stale_labs() -> None:
    """Delete namespaces of labs whose creating process no longer exists (a killed test run)."""
    listed = _ip("netns", "list", check=False).stdout.splitlines()
    for line in listed:
        ns = line.split()[0] if line.strip() else ""
        m = _NAME.match(ns)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            _delete_ns(ns)
