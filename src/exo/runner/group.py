"""Joining a pipeline's group: one ``mx.distributed`` ring (TCP) across the runners of an instance.

The daemons derive the hosts (one ``host:port`` per rank, in stage order) from the placement; every runner
of the group writes the same hostfile and joins. ``mx.distributed.init`` waits for every member without a
deadline of its own, so a join that does not complete within ``timeout_s`` ends the process
(``EXIT_GROUP_LOST``): the group is disposable and the daemons form it anew.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import threading
from collections.abc import Sequence

from exo.wire.runner import EXIT_GROUP_LOST

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 60.0


class GroupError(RuntimeError):
    """The group could not be formed, or a member of it was lost."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (for the ring's listener)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def join_group(hosts: Sequence[str], rank: int, timeout_s: float = JOIN_TIMEOUT_S):
    """Join the ring of ``hosts`` ("ip:port" per rank) as ``rank``; returns an ``exo.engine.pipeline.DistributedLink``."""
    import mlx.core as mx

    from exo.engine.pipeline import DistributedLink

    if not 0 <= rank < len(hosts) or len(hosts) < 2:
        raise GroupError(f"rank {rank} of a group of {len(hosts)} hosts")
    fd, path = tempfile.mkstemp(prefix="exo-ring-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump([[h] for h in hosts], f)
    os.environ["MLX_HOSTFILE"] = path
    os.environ["MLX_RANK"] = str(rank)
    joined = threading.Event()

    def watchdog() -> None:
        if not joined.wait(timeout_s):
            log.error("the pipeline group %s did not form within %.0f s", ",".join(hosts), timeout_s)
            os._exit(EXIT_GROUP_LOST)

    threading.Thread(target=watchdog, name="exo-group-join-watchdog", daemon=True).start()
    try:
        group = mx.distributed.init(strict=True, backend="ring")
    finally:
        joined.set()
        os.unlink(path)
    if group.size() != len(hosts) or group.rank() != rank:
        raise GroupError(f"joined as rank {group.rank()} of {group.size()}, expected {rank} of {len(hosts)}")
    return DistributedLink(group)
