"""One model across several `exo serve` daemons on 127.0.0.1: pipelined instances, with native MTP.

Four daemons (A holds no stage; B, C, D hold stages) serve fixture checkpoints of the three families from
a shared Hugging Face cache, described by user model cards. Their runners prefill in chunks of 8 tokens
(EXO_PREFILL_CHUNK), so the prompt crosses chunk edges. Requests go through A; at temperature 0 a
pipeline's output is single-node plain decoding's, at every depth and adaptive, for every family at 2 and
3 stages; with a seed it samples what one node samples; a client that goes away mid-stream ends the
generation on the leader.
"""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import httpx2 as httpx
import pytest

from exo.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, load_checkpoint

from .daemons import Daemon, start_all, wait_for

pytestmark = pytest.mark.timeout(600)

# card id -> (fixture arch, repo in the shared cache)
MODELS = {
    "pipe-dense": ("qwen3_5", "exo-test/pipe-dense"),
    "pipe-moe": ("qwen3_5_moe", "exo-test/pipe-moe"),
    "pipe-next": ("qwen3_next", "exo-test/pipe-next"),
}
CARD = """
id = "{id}"
name = "pipeline test {arch}"
arch = "{model_type}"
repo = "{repo}"
n_layers = 4
hidden_size = 64
kv_heads = 2
head_dim = 32
context_length = 4096
storage_bytes = 1000000

[native_mtp]
num_layers = 1
default_k = 2
max_k = 3
"""
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fib"
MAX_TOKENS = 16
CHUNK = 8  # the daemons' runners' prefill chunk (EXO_PREFILL_CHUNK); PROMPT is 49 tokens: 6 chunks and 1
LONG = "0 0 0"  # the dense fixture repeats "22, " after this for thousands of tokens (no EOS)


def hf_cache_entry(cache: Path, repo: str, source: Path) -> None:
    """A Hugging Face cache snapshot of ``repo`` holding the files of ``source`` (the hub's own layout)."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / "0123456789abcdef"
    snapshot.mkdir(parents=True)
    for file in source.iterdir():
        (snapshot / file.name).symlink_to(file)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("0123456789abcdef")


@pytest.fixture(scope="module")
def sources(checkpoint) -> dict[str, Path]:
    return {card: checkpoint(arch, dtype="float32") for card, (arch, _) in MODELS.items()}


@pytest.fixture(scope="module")
def quartet(tmp_path_factory, sources):
    root = tmp_path_factory.mktemp("pipeline-cluster")
    cache = root / "hf-cache"
    for card, (_, repo) in MODELS.items():
        hf_cache_entry(cache, repo, sources[card])
    daemons = []
    for name in "abcd":
        home = root / f"node-{name}"
        (home / "model_cards").mkdir(parents=True)
        for card, (arch, repo) in MODELS.items():
            model_type = "qwen3_5_moe" if arch == "qwen3_5_moe" else arch
            (home / "model_cards" / f"{card}.toml").write_text(
                textwrap.dedent(CARD.format(id=card, arch=arch, model_type=model_type, repo=repo)))
        daemons.append(Daemon(home, f"node-{name}", env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
                                                        "EXO_PREFILL_CHUNK": str(CHUNK)}))
    start_all(daemons, [d.address for d in daemons])
    try:
        wait_for(lambda: all(len(d.node_ids()) == 4 for d in daemons), 30, "four nodes to see each other")
        wait_for(lambda: all(card in _models_of(daemons[0], d.node_id) for d in daemons for card in MODELS), 30,
                 "every node to list the test models")
        yield daemons
    finally:
        for d in daemons:
            d.stop()


def _models_of(api: Daemon, node_id: str) -> set[str]:
    return next(set(n["models"]) for n in api.cluster()["nodes"] if n["id"] == node_id)


_engines: dict[Path, Engine] = {}


def single_node(path: Path) -> Engine:
    if path not in _engines:
        _engines[path] = Engine(load_checkpoint(path), EngineConfig(prefill_chunk=CHUNK))
    return _engines[path]


def complete(api: Daemon, model: str, **fields) -> dict:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, **fields}
    response = api.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    return response.json()


def test_preview_and_placement_errors(quartet):
    a, b, c, d = quartet
    preview = a.get("/v1/instances/preview?model=pipe-dense&min_nodes=3")
    assert preview.status_code == 200, preview.text
    stages = preview.json()["placement"]["stages"]
    assert [s["rank"] for s in stages] == [0, 1, 2] and len({s["node"] for s in stages}) == 3
    assert stages[0]["start_layer"] == 0 and stages[-1]["end_layer"] == 4
    assert all(s["end_layer"] == t["start_layer"] for s, t in zip(stages, stages[1:], strict=False))
    exact = a.get(f"/v1/instances/preview?model=pipe-dense&nodes={d.node_id},{b.node_id}").json()["placement"]
    assert [s["node"] for s in exact["stages"]] == [d.node_id, b.node_id] and exact["node"] == b.node_id
    assert a.get("/v1/instances").json()["instances"] == []  # a preview changes nothing
    cases = [
        ({"model": "pipe-dense", "min_nodes": 5}, 400, "too_few_nodes", "spread over 5 nodes"),
        ({"model": "pipe-dense", "nodes": [b.node_id, "nope"]}, 404, "node_not_found", "no node 'nope'"),
        ({"model": "pipe-dense", "node": b.node_id, "nodes": [c.node_id, d.node_id]}, 400, "invalid_value", "node"),
        ({"model": "pipe-dense", "nodes": [b.node_id, b.node_id]}, 400, "invalid_value", "more than once"),
        ({"model": "pipe-dense", "min_nodes": 0}, 400, None, "min_nodes"),
    ]
    for body, status, code, text in cases:
        response = a.post("/v1/instances", body)
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert code is None or error["code"] == code, (body, error)
        assert text in error["message"], (body, error)


@pytest.mark.parametrize(
    ("card", "stages"),
    [("pipe-dense", 2), ("pipe-dense", 3), ("pipe-moe", 2), ("pipe-moe", 3), ("pipe-next", 2), ("pipe-next", 3)],
    ids=["dense-2", "dense-3", "moe-2", "moe-3", "next-2", "next-3"],
)
def test_a_pipeline_is_one_instance_and_decodes_like_one_node(quartet, sources, card, stages):
    a, b, c, d = quartet
    nodes = [b.node_id, c.node_id, d.node_id][:stages]
    leader = quartet[stages]  # the last stage's daemon
    created = a.post("/v1/instances", {"model": card, "nodes": nodes, "wait": True})
    assert created.status_code == 201, created.text
    instance = created.json()["instance"]
    try:
        assert instance["state"] == "ready", instance
        assert [s["node"] for s in instance["stages"]] == nodes and instance["node"] == nodes[-1]
        assert [s["rank"] for s in instance["stages"]] == list(range(stages))
        listed = [i for i in a.get("/v1/instances").json()["instances"] if i["model"] == card]
        assert len(listed) == 1 and listed[0]["id"] == instance["id"]  # ONE instance, with its stages
        wait_for(lambda: all(s["state"] == "ready" for s in a.get(f"/v1/instances/{instance['id']}").json()["stages"]),
                 10, "every stage to be reported ready")
        engine = single_node(sources[card])
        prompt = engine.loaded.tokenizer.encode(PROMPT)
        assert len(prompt) > CHUNK and len(prompt) % CHUNK, len(prompt)  # across prefill chunk edges
        if (card, stages) == ("pipe-dense", 2):
            _a_client_that_goes_away_ends_the_generation_on_the_leader(a, leader, card)
        plain = engine.complete(GenerationRequest(prompt, max_tokens=MAX_TOKENS, native_mtp="off"))
        for mtp in ({"enabled": False}, {"k": 1}, {"k": 2}, {"k": 3}, None):
            fields = {} if mtp is None else {"native_mtp": mtp}
            result = complete(a, card, **fields)  # A holds no stage
            assert result["choices"][0]["text"] == plain.text, mtp
            usage = result["usage"]
            assert usage["completion_tokens"] == len(plain.token_ids), mtp
            stats = usage["native_mtp"]
            assert stats["mode"] == "pipeline" and stats["stages"] == stages, stats
            assert stats["enabled"] == (mtp != {"enabled": False}), stats
            if mtp is None:  # adaptive: its depth policy measured the pipeline's own round costs
                assert stats["costs"] is not None and stats["costs"]["stages"] == stages, stats
                assert stats["k_histogram"], stats
        stream = a.post("/v1/completions", {"model": card, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                             "temperature": 0, "stream": True, "native_mtp": {"k": 2}})
        events = [json.loads(line[6:]) for line in stream.text.splitlines()
                  if line.startswith("data: {")]
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == plain.text
        assert stream.text.rstrip().endswith("data: [DONE]")
        if stages == 3 and card != "pipe-dense":
            _samples_like_one_node(a, card, engine, prompt, seeds=8)
    finally:
        assert a.delete(f"/v1/instances/{instance['id']}").status_code == 200
    wait_for(lambda: not [i for i in a.get("/v1/instances").json()["instances"]
                          if i["model"] == card and i["state"] != "gone"], 30, "the pipeline to be deleted")


def _a_client_that_goes_away_ends_the_generation_on_the_leader(a: Daemon, leader: Daemon, card: str) -> None:
    """Streamed through A (no stage), the client disconnects after a few tokens: the leader's running
    generations drop to 0 within a round plus the leader daemon's status poll of its runner (1 s)."""
    # ignore_eos: the generation must still run when the client leaves, whatever a fixture says first.
    body = {"model": card, "prompt": LONG, "max_tokens": 4000, "temperature": 0, "stream": True,
            "native_mtp": {"k": 2}, "ignore_eos": True}
    with httpx.stream("POST", a.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        tokens = 0
        lines = response.iter_lines()
        for line in lines:
            tokens += line.startswith("data: {")
            if tokens >= 3:
                break
        try:
            wait_for(lambda: leader.get("/health").json()["running"] == 1, 10, "the leader to report the generation",
                     interval=0.1)
        except AssertionError:
            started = time.monotonic()
            rest = list(lines)
            raise AssertionError(f"the leader never reported the generation; the stream then ended after "
                                 f"{time.monotonic() - started:.1f} s more with {len(rest)} lines: {rest[-3:]}") from None
        closed = time.monotonic()
    wait_for(lambda: leader.get("/health").json()["running"] == 0, 30, "the leader to end the generation",
             interval=0.05)
    # The 4000 tokens would run for minutes: ending within seconds of the close is the cancellation.
    assert time.monotonic() - closed < 10.0, time.monotonic() - closed


def _samples_like_one_node(a: Daemon, card: str, engine: Engine, prompt: list[int], seeds: int) -> None:
    """With a seed, a pipeline samples exactly what one node samples with the same depth (whose
    distribution is plain sampling's: tests/engine/test_sampling_equivalence.py)."""
    for seed in range(seeds):
        result = complete(a, card, temperature=1.0, seed=seed, max_tokens=6, native_mtp={"k": 2})
        alone = engine.complete(GenerationRequest(prompt, max_tokens=6, mtp_k=2,
                                                  sampling=SamplingParams(temperature=1.0, seed=seed)))
        assert result["choices"][0]["text"] == alone.text, (card, seed)


def test_pipeline_sampling_is_single_node_mtp_sampling(quartet, sources):
    """Dense over 2 stages here; MoE and Qwen3-Next over 3 in the identity test above."""
    a, b, c, _ = quartet
    created = a.post("/v1/instances", {"model": "pipe-dense", "nodes": [c.node_id, b.node_id], "wait": True})
    assert created.status_code == 201, created.text
    try:
        engine = single_node(sources["pipe-dense"])
        _samples_like_one_node(a, "pipe-dense", engine, engine.loaded.tokenizer.encode(PROMPT), seeds=12)
    finally:
        assert a.delete(f"/v1/instances/{created.json()['instance']['id']}").status_code == 200


def test_a_pipelines_next_request_restores_its_prefix_on_every_stage(quartet, sources):
    """The prefix cache through real stage runners: the same prompt again restores all of it but its last
    token on both stages (each its own layers' part), and decodes as one node does, MTP off and on."""
    a, b, c, _ = quartet
    card = "pipe-next"
    created = a.post("/v1/instances", {"model": card, "nodes": [c.node_id, b.node_id], "wait": True})
    assert created.status_code == 201, created.text
    instance = created.json()["instance"]
    try:
        engine = single_node(sources[card])
        text = PROMPT * 3
        prompt = engine.loaded.tokenizer.encode(text)
        assert len(prompt) > 64  # a snapshot at its last token is worth taking
        plain = engine.complete(GenerationRequest(prompt, max_tokens=MAX_TOKENS, native_mtp="off"))
        # A run that drafts needs the head's cache too, which only a run that drafted stored.
        for i, (mtp, hit) in enumerate(((({"enabled": False}), False), ({"enabled": False}, True), ({"k": 2}, False),
                                        ({"k": 2}, True))):
            result = complete(a, card, prompt=text, native_mtp=mtp)
            assert result["choices"][0]["text"] == plain.text, (i, mtp)
            assert result["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(prompt) - 1 if hit else 0), i
    finally:
        assert a.delete(f"/v1/instances/{instance['id']}").status_code == 200
    wait_for(lambda: not [i for i in a.get("/v1/instances").json()["instances"]
                          if i["model"] == card and i["state"] != "gone"], 30, "the pipeline to be deleted")


def test_concurrent_requests_to_a_pipeline_decode_as_one_batch_like_one_node(quartet, sources):
    """Requests sent at once to a 2-stage instance batch on its leader (continuous batching through the
    pipeline: every stage mirrors the batch's caches); each one's text is still single-node plain decoding's,
    with native MTP off, forced and adaptive. A client streaming among them goes away mid-stream: the others
    are unharmed, and the instance (the same one, never placed anew) serves the next request."""
    import concurrent.futures

    a, b, c, _ = quartet
    created = a.post("/v1/instances", {"model": "pipe-dense", "nodes": [b.node_id, c.node_id], "wait": True})
    assert created.status_code == 201, created.text
    instance_id = created.json()["instance"]["id"]

    def goes_away() -> int:
        body = {"model": "pipe-dense", "prompt": LONG, "max_tokens": 400, "temperature": 0, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", a.url + "/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            seen = 0
            for line in response.iter_lines():
                seen += line.startswith("data: {")
                if seen >= 4:
                    break
        return seen

    try:
        engine = single_node(sources["pipe-dense"])
        prompts = [PROMPT, "The quick brown fox", "import numpy as np\nx = np.", "1, 2, 3,", PROMPT[:20], "Once upon"]
        modes = [{"enabled": False}, {"k": 2}, None, {"k": 1}, {"enabled": False}, {"k": 3}]
        with concurrent.futures.ThreadPoolExecutor(len(prompts) + 1) as pool:
            leaving = pool.submit(goes_away)
            results = list(pool.map(
                lambda pm: complete(a, "pipe-dense", prompt=pm[0], max_tokens=24,
                                    **({"native_mtp": pm[1]} if pm[1] is not None else {})),
                zip(prompts, modes, strict=True)))
        sizes = []
        for prompt, mode, result in zip(prompts, modes, results, strict=True):
            ids = engine.loaded.tokenizer.encode(prompt)
            plain = engine.complete(GenerationRequest(ids, max_tokens=24, native_mtp="off"))
            assert result["choices"][0]["text"] == plain.text, (prompt, mode)
            stats = result["usage"]["native_mtp"]
            assert stats["mode"] == "pipeline" and stats["stages"] == 2, stats
            sizes += [int(n) for n in stats["batch_sizes"]]
        assert sizes and max(sizes) >= 2, sizes  # they decoded together
        assert leaving.result() >= 4
        assert a.get(f"/v1/instances/{instance_id}").json()["state"] == "ready"
        after = complete(a, "pipe-dense", prompt=PROMPT, max_tokens=24, native_mtp={"k": 2})
        ids = engine.loaded.tokenizer.encode(PROMPT)
        assert after["choices"][0]["text"] == engine.complete(GenerationRequest(ids, max_tokens=24, native_mtp="off")).text
        assert a.get(f"/v1/instances/{instance_id}").json()["state"] == "ready"
    finally:
        assert a.delete(f"/v1/instances/{instance_id}").status_code == 200
