"""A pipeline in a cluster with a secret (EXO_CLUSTER_SECRET): the daemons hand the secret to their stages'
runners, which prove it to each other when their group forms (runner/group.py); once formed, no stage
listens on any TCP port (a stranger's connection to a ring or doorbell port is refused), and the pipeline
decodes as one node does."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from exo.engine import GenerationRequest

from .daemons import Daemon, start_all, wait_for
from .test_pipeline_cluster import (
    CARD,
    CHUNK,
    MAX_TOKENS,
    MODELS,
    PROMPT,
    complete,
    hf_cache_entry,
    single_node,
)

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the runners' /proc entries")]
SECRET = "s3cret-pipeline"


def _listening_tcp_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on (its sockets' inodes, matched in /proc/net/tcp{,6})."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_a_pipeline_with_the_cluster_secret_forms_decodes_and_leaves_no_port_open(tmp_path, checkpoint):
    card, (arch, repo) = "pipe-dense", MODELS["pipe-dense"]
    source = checkpoint(arch, dtype="float32")
    cache = tmp_path / "hf-cache"
    hf_cache_entry(cache, repo, source)
    daemons = []
    for name in "ab":
        home = tmp_path / f"node-{name}"
        (home / "model_cards").mkdir(parents=True)
        (home / "model_cards" / f"{card}.toml").write_text(
            textwrap.dedent(CARD.format(id=card, arch=arch, model_type=arch, repo=repo)))
        daemons.append(Daemon(home, f"secret-{name}", secret=SECRET,
                              env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "EXO_PREFILL_CHUNK": str(CHUNK)}))
    a, b = daemons
    start_all(daemons, [d.address for d in daemons])
    try:
        # Both views: a pipeline placed while b has not yet seen a is broken at once ("stage 0's node left").
        wait_for(lambda: a.node_ids() == b.node_ids() == {a.node_id, b.node_id}, 30,
                 "the two nodes with the secret to meet")
        created = a.post("/v1/instances", {"model": card, "nodes": [a.node_id, b.node_id], "wait": True})
        assert created.status_code == 201, created.text
        instance = created.json()["instance"]
        assert instance["state"] == "ready", instance
        stages = wait_for(lambda: [s for s in a.get(f"/v1/instances/{instance['id']}").json()["stages"]
                                   if s["state"] == "ready" and s["pid"]], 10, "both stages ready")
        assert len(stages) == 2
        for stage in stages:
            environ = Path(f"/proc/{stage['pid']}/environ").read_bytes().split(b"\0")
            assert f"EXO_CLUSTER_SECRET={SECRET}".encode() in environ  # what the group's proofs use
            assert _listening_tcp_ports(stage["pid"]) == set(), stage  # the ring's and doorbell's listeners are gone
        engine = single_node(source)
        plain = engine.complete(GenerationRequest(engine.loaded.tokenizer.encode(PROMPT), max_tokens=MAX_TOKENS,
                                                  native_mtp="off"))
        for mtp in ({"enabled": False}, {"k": 2}):
            assert complete(a, card, native_mtp=mtp)["choices"][0]["text"] == plain.text, mtp
    finally:
        for d in daemons:
            d.stop()
