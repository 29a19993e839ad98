"""A tensor-sharded instance through real daemons: ``POST /v1/instances {"sharding": "tensor"}`` places one runner
per member (every layer's slice on each, over MLX's ring on 127.0.0.1), the instance and the placement say
``"sharding": "tensor"``, ``usage.native_mtp.mode`` says ``tensor``, greedy output is the same with native MTP off
and on, and a card that forbids tensor sharding gets a clear 400.

A member's runner killed mid-stream (a killed process, the way a crash or an out-of-memory kill ends it): the
stream gets its error within 1 s (the others' collective fails at once, and the leader sees the closed connection),
no survivor is left waiting in a collective, and the instance is placed again, as a tensor group, with no manual
step. The same when the leader itself is killed."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from .daemons import Daemon, start_all, wait_for
from .test_pipeline_failover import PEER_TIMING, Stream, alive

pytestmark = pytest.mark.timeout(300)
MODEL = "exo-demo"
ERROR_WITHIN_S = 1.0


FORBIDDING = "exo-demo-no-tensor"  # a user's card for the bundled demo model that forbids tensor sharding


def daemons(tmp_path, names: str) -> list[Daemon]:
    out = [Daemon(tmp_path / f"node-{n}", f"node-{n}", env=dict(PEER_TIMING)) for n in names]
    for d in out:
        cards = d.home / "model_cards"
        cards.mkdir(parents=True, exist_ok=True)
        text = _bundled_card_text().replace(f'id = "{MODEL}"', f'id = "{FORBIDDING}"\ntensor_sharding = false')
        (cards / f"{FORBIDDING}.toml").write_text(text)
    start_all(out, [d.address for d in out])
    wait_for(lambda: all(len(d.node_ids()) == len(out) for d in out), 30, "the nodes to see each other")
    return out


def _bundled_card_text() -> str:
    from importlib.resources import files

    return (files("exo.assets") / "model_cards" / f"{MODEL}.toml").read_text()


def ready_group(api: Daemon, without: str | None = None) -> dict | None:
    for inst in api.get("/v1/instances").json()["instances"]:
        if (inst["model"] == MODEL and inst["state"] == "ready" and inst["sharding"] == "tensor"
                and all(s["pid"] for s in inst["stages"]) and inst["id"] != without):
            return inst
    return None


def chat(api: Daemon, content: str, **fields) -> dict:
    reply = api.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": content}],
                                               "max_tokens": 24, "temperature": 0, **fields})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_a_tensor_instance_places_serves_and_refuses_a_card_that_forbids_it(tmp_path):
    a, b = daemons(tmp_path, "ab")
    try:
        preview = a.get(f"/v1/instances/preview?model={MODEL}&min_nodes=2&sharding=tensor").json()["placement"]
        assert preview["sharding"] == "tensor" and preview["backend"] == "ring"
        options = {o["sharding"]: o for o in preview["options"]}
        assert set(options) == {"pipeline", "tensor"}
        assert all(o["estimated_tokens_per_s"] > 0 and o["estimate_basis"] for o in options.values()), options
        assert preview["estimated_tokens_per_s"] == options["tensor"]["estimated_tokens_per_s"]

        created = a.post("/v1/instances", {"model": MODEL, "min_nodes": 2, "sharding": "tensor", "wait": True})
        assert created.status_code == 201, created.text
        instance, placement = created.json()["instance"], created.json()["placement"]
        assert instance["state"] == "ready" and instance["sharding"] == "tensor" and placement["sharding"] == "tensor"
        assert [(s["start_layer"], s["end_layer"], s["rank"]) for s in instance["stages"]] == [(0, 8, 0), (0, 8, 1)]
        listed = [i for i in b.get("/v1/instances").json()["instances"] if i["id"] == instance["id"]]
        assert listed and listed[0]["sharding"] == "tensor"  # every node lists it as one tensor instance

        plain = chat(a, "Write a haiku about the sea.", native_mtp={"enabled": False})
        drafted = chat(b, "Write a haiku about the sea.", native_mtp={"k": 2})
        assert drafted["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
        stats = drafted["usage"]["native_mtp"]
        assert stats["mode"] == "tensor" and stats["stages"] == 2 and stats["drafted_tokens"] > 0, stats

        refused = a.post("/v1/instances", {"model": FORBIDDING, "min_nodes": 2, "sharding": "tensor"})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "tensor_sharding_unavailable" and error["param"] == "sharding"
        assert "forbids tensor sharding" in error["message"]
        auto = a.get(f"/v1/instances/preview?model={FORBIDDING}&min_nodes=2&sharding=auto").json()["placement"]
        assert auto["sharding"] == "pipeline"
        assert [o["error"] is not None for o in auto["options"]] == [False, True]
    finally:
        for daemon in (a, b):
            daemon.stop()


def test_a_killed_member_ends_the_stream_within_a_second_and_the_group_is_placed_again(tmp_path):
    a, b, c = daemons(tmp_path, "abc")
    try:
        created = a.post("/v1/instances", {"model": MODEL, "nodes": [b.node_id, c.node_id], "sharding": "tensor",
                                           "wait": True})
        assert created.status_code == 201 and created.json()["instance"]["state"] == "ready", created.text
        old = wait_for(lambda: ready_group(a), 10, "the members' pids")
        for role in ("follower", "leader"):
            victim, survivor = ((0, 1) if role == "follower" else (1, 0))
            victim, survivor = old["stages"][victim]["pid"], old["stages"][survivor]["pid"]
            stream = Stream(a)  # through A, which holds no member
            assert stream.first_token.wait(60), stream.lines
            killed = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            assert stream.ended.wait(ERROR_WITHIN_S + 10), f"the stream did not end ({role} killed)"
            assert stream.ended_at - killed <= ERROR_WITHIN_S, (role, stream.ended_at - killed, b.log(), c.log())
            data = [line[6:] for line in stream.lines if line.startswith("data: ")]
            assert data[-1] == "[DONE]" and "error" in json.loads(data[-2]), data[-3:]
            assert json.loads(data[-2])["error"]["code"] == "node_unavailable", data[-2]
            # No survivor is left waiting in a collective: it ends (its collective failed, or it was told).
            wait_for(lambda survivor=survivor: not alive(survivor), 15, f"the surviving member to end ({role} killed)")
            # Placed again, as a tensor group, with no manual step.
            new = wait_for(lambda old=old: ready_group(a, without=old["id"]), 120, "the group to be placed again")
            assert len(new["stages"]) == 2
            assert chat(a, "Hi")["usage"]["native_mtp"]["mode"] == "tensor"
            old = new
    finally:
        for daemon in (a, b, c):
            daemon.stop()
