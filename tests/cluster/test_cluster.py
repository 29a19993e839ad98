"""Three real daemons on 127.0.0.1 with static peers: one cluster, any node serves any placed model.

The model is placed on node B through node A's API; chat through A (and C) gives the same tokens and
the same native-MTP stats as asking B itself; nothing is loaded twice; a dead peer leaves within 10 s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx2 as httpx
import openai
import pytest

from .daemons import SRC, Daemon, start_all, wait_for

MODEL = "exo-demo"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    root = tmp_path_factory.mktemp("trio")
    daemons = [Daemon(root / n, n) for n in ("node-a", "node-b", "node-c")]
    # Every node gets the whole list, itself included (the usual copy-pasted config).
    start_all(daemons, [d.address for d in daemons])
    try:
        ids = {d.node_id for d in daemons}
        for d in daemons:
            wait_for(lambda d=d: d.node_ids() == ids, 20, f"{d.name} to see all three nodes")
        yield daemons
    finally:
        for d in daemons:
            d.stop()


@pytest.fixture(scope="module")
def placed(trio):
    """exo-demo placed on node B through node A (ready)."""
    a, b, _ = trio
    response = a.post("/v1/instances", {"model": MODEL, "node": b.node_id, "wait": True})
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["instance"]["node"] == b.node_id and body["placement"]["node"] == b.node_id
    assert body["instance"]["state"] == "ready", body
    return body["instance"]


def test_every_node_sees_the_cluster(trio):
    for d in trio:
        view = d.cluster()
        selves = [n for n in view["nodes"] if n["self"]]
        assert [n["id"] for n in selves] == [d.node_id]
        assert {n["name"] for n in view["nodes"]} == {"node-a", "node-b", "node-c"}
        for n in view["nodes"]:
            assert n["memory_total_bytes"] > 0 and n["backend"] in ("cpu", "metal", "cuda") and n["chip"]
            assert MODEL in n["models"]
        peers = {link["to"] for link in view["links"] if link["from"] == d.node_id}
        assert peers == {x.node_id for x in trio} - {d.node_id}


def _chat(url: str, **extra):
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120)
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Write a function that adds two numbers."}],
        max_tokens=24,
        temperature=0,
        extra_body={"native_mtp": {"k": 2}},
        **extra,
    )


def _deterministic(stats: dict) -> dict:
    keys = ("enabled", "mode", "k", "rounds", "drafted_tokens", "accepted_tokens", "per_position_acceptance",
            "k_histogram", "prompt_tokens", "completion_tokens")
    return {k: stats[k] for k in keys}


def test_chat_through_any_node_is_served_by_the_placed_instance(trio, placed):
    a, b, c = trio
    direct = _chat(b.url)
    via_a = _chat(a.url)
    via_c = _chat(c.url)
    assert direct.choices[0].message.content
    for other in (via_a, via_c):
        assert other.choices[0].message.content == direct.choices[0].message.content
        assert other.usage.completion_tokens == direct.usage.completion_tokens
        mine, theirs = other.usage.model_extra, direct.usage.model_extra
        assert _deterministic(mine["native_mtp"]) == _deterministic(theirs["native_mtp"])
        assert mine["native_mtp"]["drafted_tokens"] > 0 and mine["native_mtp"]["mode"] == "single_node"
        assert mine["ttft_ms"] > 0 and mine["decode_tokens_per_s"] > 0
    # No model named: the default (the bundled demo model), served by the same instance; listed first.
    default = c.post("/v1/completions", {"prompt": "def f(x):", "max_tokens": 4, "temperature": 0})
    assert default.status_code == 200 and default.json()["model"] == MODEL
    first = c.get("/v1/models").json()["data"][0]
    assert (first["id"], first["status"]) == (MODEL, "loaded") and first["native_mtp"]["available"]
    # Nothing was loaded again: one instance of the model in the whole cluster, on B.
    instances = [i for i in a.get("/v1/instances").json()["instances"] if i["model"] == MODEL]
    assert [(i["id"], i["node"]) for i in instances] == [(placed["id"], b.node_id)]
    for d in (a, c):
        assert not [i for i in d.cluster()["instances"] if i["node"] == d.node_id]


def test_anthropic_stop_sequence_and_count_tokens_through_another_node(trio, placed):
    """The stop string that ended the answer crosses the runner's wire and the owner's (Anthropic's
    stop_sequence), and count_tokens is the prompt the owner's model reads."""
    a, b, _ = trio
    ask = {"model": MODEL, "max_tokens": 24, "temperature": 0,
           "messages": [{"role": "user", "content": "Write a function that adds two numbers."}]}
    text = b.post("/v1/messages", ask).json()["content"][0]["text"]
    piece = text[6:10]
    assert len(text) > 12 and piece.strip(), text
    stopped = a.post("/v1/messages", {**ask, "stop_sequences": ["never in the answer \x01", piece]}).json()
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", piece), stopped
    assert "".join(block["text"] for block in stopped["content"]) == text[: text.index(piece)]
    counted = a.post("/v1/messages/count_tokens", {"model": MODEL, "messages": ask["messages"]})
    usage = stopped["usage"]
    assert counted.json()["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"] > 0


def test_streaming_through_another_node_carries_the_stats(trio, placed):
    a, _, _ = trio
    client = openai.OpenAI(base_url=a.url + "/v1", api_key="-", max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["native_mtp"]["mode"] == "single_node"
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12
    assert usage.model_extra["native_mtp"] == finals[0].model_extra["native_mtp"]


def test_errors_through_another_node_are_the_owners(trio, placed):
    a, b, _ = trio
    long_prompt = {"model": MODEL, "prompt": "x " * 5000, "max_tokens": 4}
    through, direct = a.post("/v1/completions", long_prompt), b.post("/v1/completions", long_prompt)
    assert through.status_code == direct.status_code == 400
    assert through.json()["error"]["code"] == direct.json()["error"]["code"] == "context_length_exceeded"
    assert through.json()["error"]["message"] == direct.json()["error"]["message"]
    # Token ids no int64 can carry: the same 400 as the owner's, not a relay failure.
    huge = {"model": MODEL, "prompt": [5, -(10**28), 10**20], "max_tokens": 2}
    through, direct = a.post("/v1/completions", huge), b.post("/v1/completions", huge)
    assert through.status_code == direct.status_code == 400
    assert through.json()["error"]["message"] == direct.json()["error"]["message"]
    # Absurd numbers travel (or are clamped to what means the same) and get the owner's answer.
    for absurd in ({"max_tokens": 34791732188}, {"max_tokens": 10**30}, {"top_k": 10**12, "max_tokens": 3}):
        body = {"model": MODEL, "prompt": "M", "temperature": 0, **absurd}
        through, direct = a.post("/v1/completions", body), b.post("/v1/completions", body)
        assert through.status_code == direct.status_code, (absurd, through.text, direct.text)
        assert through.json().get("error") == direct.json().get("error")
        assert through.json().get("choices") == direct.json().get("choices")
    bad = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "native_mtp": {"k": 99}}
    assert a.post("/v1/chat/completions", bad).status_code == b.post("/v1/chat/completions", bad).status_code


def test_tools_structured_output_and_logprobs_through_another_node(trio, placed):
    """Tools, tool messages, a forced call, a JSON schema and logprobs cross the gRPC hop unchanged: node A
    answers exactly as B, which runs the instance, does (MTP on, the grammar compiled on B)."""
    a, b, _ = trio
    weather = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
               "required": ["city", "days"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}]
    ask = [{"role": "user", "content": "Weather in Oslo?"}]
    forced = {"model": MODEL, "messages": ask, "tools": tools, "tool_choice": "required", "parallel_tool_calls": False,
              "temperature": 0,
              "max_tokens": 64, "logprobs": True, "top_logprobs": 2, "native_mtp": {"k": 2}}
    through, direct = a.post("/v1/chat/completions", forced).json(), b.post("/v1/chat/completions", forced).json()
    for answer in (through, direct):
        assert answer["choices"][0]["finish_reason"] == "tool_calls", answer
    call, same = through["choices"][0]["message"]["tool_calls"][0], direct["choices"][0]["message"]["tool_calls"][0]
    assert (call["function"], call["type"]) == (same["function"], same["type"])
    assert through["choices"][0]["logprobs"] == direct["choices"][0]["logprobs"]
    assert json.loads(call["function"]["arguments"]).keys() == {"city", "days"}
    # The call and its result go back through A: messages with tool_calls and tool_call_id travel too.
    follow = {"model": MODEL, "tools": tools, "temperature": 0, "max_tokens": 12, "messages": ask + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
    ]}
    through, direct = a.post("/v1/chat/completions", follow).json(), b.post("/v1/chat/completions", follow).json()
    assert through["choices"][0]["message"] == direct["choices"][0]["message"]
    assert through["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
    schema = {"model": MODEL, "messages": ask, "temperature": 0, "max_tokens": 48, "response_format": {
        "type": "json_schema", "json_schema": {"name": "w", "schema": weather}}}
    through, direct = a.post("/v1/chat/completions", schema).json(), b.post("/v1/chat/completions", schema).json()
    assert through["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    assert json.loads(through["choices"][0]["message"]["content"]).keys() == {"city", "days"}
    bad = {**schema, "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": 3}}}}
    assert a.post("/v1/chat/completions", bad).json()["error"]["param"] == "response_format.json_schema.schema"


def test_instance_endpoints(trio, placed):
    a, b, c = trio
    # Already placed: 409 that names the instance; preview has no side effects.
    again = a.post("/v1/instances", {"model": MODEL})
    assert again.status_code == 409 and placed["id"] in again.json()["error"]["message"]
    preview = c.get("/v1/instances/preview", params={"model": "exo-demo-moe"})
    assert preview.status_code == 200, preview.text
    plan = preview.json()["placement"]
    assert plan["node"] in {d.node_id for d in trio} and plan["needed_bytes"] > plan["weights_bytes"] > 0
    assert not [i for i in c.get("/v1/instances").json()["instances"] if i["model"] == "exo-demo-moe"]
    # Unknown things.
    assert a.post("/v1/instances", {"model": MODEL + "-nope"}).json()["error"]["code"] == "model_not_found"
    unknown_node = a.post("/v1/instances", {"model": "exo-demo-moe", "node": "f" * 32})
    assert unknown_node.status_code == 404 and unknown_node.json()["error"]["code"] == "node_not_found"
    assert a.get("/v1/instances/inst-000000000000").status_code == 404
    assert httpx.delete(a.url + "/v1/instances/inst-000000000000", timeout=10).status_code == 404
    home_ref = a.get("/v1/instances/preview", params={"model": "~no-such-user/x"})
    assert home_ref.status_code == 404 and home_ref.json()["error"]["code"] == "model_not_found"
    # On no disk, but its card names a hub repo: the nodes that would download it are candidates (each
    # stage marked `download`), unless none has the memory (17 GiB) or the disk to download it into (5.75 GiB):
    # this machine decides.
    not_on_disk = a.get("/v1/instances/preview", params={"model": "qwen3.5-27b-4bit"})
    if not_on_disk.status_code == 200:
        assert all(s["download"] and s["download_bytes"] > 0 for s in not_on_disk.json()["placement"]["stages"])
    else:
        reason = not_on_disk.json()["error"]["message"]
        assert not_on_disk.status_code == 507 and ("does not fit" in reason or "lack the disk" in reason), reason
    assert a.post("/v1/instances", {"model": MODEL, "extra": 1}).status_code == 400
    # One instance, as every node reports it.
    view = b.get(f"/v1/instances/{placed['id']}").json()
    assert view["state"] == "ready" and view["self"] and view["native_mtp"]["available"]


def test_on_demand_placement_loads_once(trio, placed):
    a, b, c = trio
    body = {"model": "exo-demo-moe", "prompt": "import os", "max_tokens": 6, "temperature": 0}
    first = c.post("/v1/completions", body, timeout=180)
    assert first.status_code == 200, first.text
    second = a.post("/v1/completions", body, timeout=180)
    assert second.status_code == 200 and second.json()["choices"] == first.json()["choices"]
    moe = [i for i in a.get("/v1/instances").json()["instances"] if i["model"] == "exo-demo-moe"]
    assert len(moe) == 1 and moe[0]["on_demand"] and moe[0]["state"] == "ready"
    # Deleting it through a node that does not run it stops it on its node.
    deleted = httpx.delete(a.url + f"/v1/instances/{moe[0]['id']}", timeout=60)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    wait_for(
        lambda: not [i for i in b.get("/v1/instances").json()["instances"] if i["model"] == "exo-demo-moe"],
        10, "the deleted instance to disappear everywhere",
    )
    models = {m["id"]: m for m in a.get("/v1/models").json()["data"]}
    assert models[MODEL]["status"] == "loaded" and models["exo-demo-moe"]["status"] == "local"


def test_exo_cluster_command(trio):
    a, _, _ = trio
    env = {"EXO_HOME": str(a.home), "PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-m", "exo.cli.main", "cluster", "--url", a.url], env=env, capture_output=True, text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "3 node(s)" in out.stdout and all(n in out.stdout for n in ("node-a", "node-b", "node-c"))
    assert sum(line.startswith("* ") for line in out.stdout.splitlines()) == 1
    as_json = subprocess.run(
        [sys.executable, "-m", "exo.cli.main", "cluster", "--url", a.url, "--json"], env=env, capture_output=True,
        text=True, timeout=60,
    )
    assert json.loads(as_json.stdout)["node_id"] == a.node_id
    down = subprocess.run(
        [sys.executable, "-m", "exo.cli.main", "cluster", "--url", "http://127.0.0.1:9"], env=env,
        capture_output=True, text=True, timeout=60,
    )
    assert down.returncode == 1 and "no exo daemon" in down.stderr


def test_the_owning_nodes_mtp_switch_decides_and_metrics_count_relayed_requests(trio, placed):
    a, b, _ = trio
    assert httpx.put(b.url + "/v1/settings", json={"native_mtp_enabled": False}, timeout=10).status_code == 200
    try:
        off = a.post("/v1/completions", {"model": MODEL, "prompt": "def f(x):", "max_tokens": 8, "temperature": 0})
        stats = off.json()["usage"]["native_mtp"]
        assert stats["enabled"] is False and "disabled" in stats["reason"] and stats["drafted_tokens"] == 0
    finally:
        httpx.put(b.url + "/v1/settings", json={"native_mtp_enabled": True}, timeout=10)
    on = a.post("/v1/completions", {"model": MODEL, "prompt": "def f(x):", "max_tokens": 8, "temperature": 0})
    assert on.json()["usage"]["native_mtp"]["enabled"] is True
    assert on.json()["choices"][0]["text"] == off.json()["choices"][0]["text"]  # greedy: same tokens either way
    metrics = a.get("/metrics").text
    assert any(
        line.startswith("exo_generations_total{") and 'model="exo-demo"' in line and 'finish_reason="length"' in line
        and float(line.rsplit(" ", 1)[1]) >= 2
        for line in metrics.splitlines()
    )


def test_a_client_that_goes_away_stops_the_generation_on_the_owning_node(trio, placed):
    a, b, _ = trio
    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 4000, "temperature": 0, "stream": True,
            "native_mtp": {"enabled": False}}
    with httpx.stream("POST", a.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(3):
            next(lines)
        running = lambda: b.get(f"/v1/instances/{placed['id']}").json()["running"]  # noqa: E731
        wait_for(lambda: running() == 1, 10, "B to report the generation running")
    closed = time.monotonic()
    wait_for(lambda: b.get(f"/v1/instances/{placed['id']}").json()["running"] == 0, 10, "B's runner to stop")
    assert time.monotonic() - closed < 10
    # B is free again at once: a short request is answered (it would queue behind 4000 tokens otherwise).
    started = time.monotonic()
    assert a.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}).status_code == 200
    assert time.monotonic() - started < 20


def test_a_crashed_runner_is_reported_and_restarted(trio, placed):
    a, b, _ = trio
    before = b.get(f"/v1/instances/{placed['id']}").json()
    os.kill(before["pid"], signal.SIGKILL)

    def restarted():
        view = a.get(f"/v1/instances/{placed['id']}").json()
        return view if view["restarts"] == before["restarts"] + 1 and view["state"] == "ready" else None

    view = wait_for(restarted, 60, "A to see B's runner restarted and ready")
    assert view["failure"]["exit_code"] == -9 and view["pid"] != before["pid"]
    assert "SIGKILL" in view["failure"]["message"]
    assert a.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}).status_code == 200


def test_a_slow_peer_never_blocks_the_api(trio):
    a, _, c = trio
    assert c.process is not None
    c.process.send_signal(signal.SIGSTOP)  # alive but answering nothing
    try:
        stopped = time.monotonic()
        for path in ("/v1/cluster", "/v1/models", "/v1/instances", "/health"):
            t0 = time.monotonic()
            assert a.get(path, timeout=5).status_code == 200
            assert time.monotonic() - t0 < 4.0, path  # blocked on the stopped peer: the 5 s client timeout
        wait_for(lambda: c.node_id not in a.node_ids(), 15, "the stopped node to leave")
        # Silent for EXPIRE_S (7.5 s) after its last answer, which came at most a poll (1.5 s) before the stop.
        assert time.monotonic() - stopped <= 10.0
    finally:
        c.process.send_signal(signal.SIGCONT)
    wait_for(lambda: c.node_id in a.node_ids(), 15, "the node to come back once it answers again")


def test_a_killed_peer_leaves_and_its_instances_are_gone(trio, tmp_path):
    a, _, _ = trio
    d = Daemon(tmp_path / "node-d", "node-d").start([a.address]).wait_up()
    try:
        wait_for(lambda: d.node_id in a.node_ids(), 20, "node-d to join")
        placed = a.post("/v1/instances", {"model": "exo-demo-moe", "node": d.node_id, "wait": True})
        assert placed.status_code == 201 and placed.json()["instance"]["state"] == "ready", placed.text
        runner_pid = placed.json()["instance"]["pid"]
        wait_for(lambda: any(i["node"] == d.node_id for i in a.get("/v1/instances").json()["instances"]), 10,
                 "A to see node-d's instance")
        # Mid-generation, through A: the stream must end with an error event, not hang.
        body = {"model": "exo-demo-moe", "prompt": "def f(x):", "max_tokens": 3000, "temperature": 0, "stream": True}
        with httpx.stream("POST", a.url + "/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            for _ in range(3):
                next(lines)
            d.kill()
            killed = time.monotonic()
            rest = [line for line in lines if line.startswith("data: ")]
        ended_after = time.monotonic() - killed
        assert rest[-1] == "data: [DONE]" and ended_after < 12, (ended_after, rest[-3:])
        error = json.loads(rest[-2][len("data: "):])["error"]
        assert error["code"] == "node_unavailable", error
        wait_for(lambda: d.node_id not in a.node_ids(), 15, "node-d to leave A's registry")
        left_after = time.monotonic() - killed
        assert left_after <= 10.5, f"a dead peer took {left_after:.1f} s to leave"
        instances = {i["id"]: i for i in a.get("/v1/instances").json()["instances"]}
        gone = instances[placed.json()["instance"]["id"]]
        assert gone["state"] == "gone" and "left the cluster" in gone["gone_reason"]
        # The runner died with its daemon, and a request for its model does not hang.
        wait_for(lambda: not _alive(runner_pid), 10, "node-d's runner to exit")
        response = a.post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=60)
        assert response.status_code == 200
    finally:
        if d.process is not None and d.process.poll() is None:
            d.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False
