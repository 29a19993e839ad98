"""A node's identity: a stable id kept in ``$EXO_HOME/node_id`` and a per-process boot nonce.

Two nodes that meet with the same id (a copied home directory) both notice it through GetNodeInfo;
the one with the larger boot nonce takes a new id (and keeps it), the other keeps its own.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import tempfile
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

NODE_ID_FILE = "node_id"
_ID = re.compile(r"^[0-9a-f]{32}$")


class NodeIdentity:
    """``node_id`` (persisted) and ``boot_nonce`` (new at every start)."""

    def __init__(self, home: Path, *, boot_nonce: int | None = None) -> None:
        self.home = Path(home)
        self.path = self.home / NODE_ID_FILE
        self.boot_nonce = boot_nonce if boot_nonce is not None else secrets.randbits(63) + 1
        self.node_id = self._load_or_create()
        self.previous_ids: list[str] = []

    def _load_or_create(self) -> str:
        try:
            text = self.path.read_bytes().decode("utf-8", errors="replace").strip()
        except FileNotFoundError:
            text = ""
        if _ID.match(text):
            return text
        if text:
            log.warning("%s holds %r, not a node id: writing a new one", self.path, text[:40])
        node_id = uuid.uuid4().hex
        self._write(node_id)
        return node_id

    def _write(self, node_id: str) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.home, prefix=".node_id.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(node_id + "\n")
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def regenerate(self, reason: str) -> str:
        """Take (and persist) a new id; returns it."""
        old = self.node_id
        self.node_id = uuid.uuid4().hex
        self.previous_ids.append(old)
        self._write(self.node_id)
        log.warning("node id %s %s: this node is now %s (saved in %s)", old, reason, self.node_id, self.path)
        return self.node_id

    def resolve_duplicate(self, peer_nonce: int, where: str) -> bool:
        """A peer at ``where`` has our id; True when this side regenerated (it has the larger nonce)."""
        if peer_nonce == self.boot_nonce:
            return False  # that peer is this very process
        if self.boot_nonce > peer_nonce:
            self.regenerate(
                f"is also used by the node at {where} (a copied EXO_HOME?); this node has the larger boot "
                "nonce and takes a new id"
            )
            return True
        log.warning(
            "node id %s is also used by the node at %s (a copied EXO_HOME?); that node has the larger boot "
            "nonce and takes a new id",
            self.node_id,
            where,
        )
        return False
