"""One model across several processes: pipeline stages over mx.distributed (ring, 127.0.0.1), native MTP on.

Each test starts one process per stage (exo.runner.local_pipeline): real stages, real ring. At
temperature 0 a pipeline's output is token for token single-node plain decoding's (this CPU rounds a
layer the same whoever runs it), at every depth and adaptive, across the prefill chunk edge.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from exo.engine import Engine, GenerationRequest, SamplingParams, load_checkpoint
from exo.runner.local_pipeline import run_local_pipeline
from tests.fixtures.engines import fresh_engine

CHUNK = 8
PROMPT_LENGTHS = (1, CHUNK - 1, CHUNK, 2 * CHUNK + 3)
DEPTHS = (1, 2, 3, None)
MAX_TOKENS = 16
SPLITS = {2: [[0, 2], [2, 4]], 3: [[0, 1], [1, 3], [3, 4]]}  # the fixtures have 4 layers


def run_pipeline(tmp_path: Path, model: Path, stages: list[list[int]], requests: list[dict]) -> dict:
    """Run ``requests`` on a pipeline of ``stages`` (one process each); the leader's results."""
    return run_local_pipeline(model, [tuple(s) for s in stages], requests, prefill_chunk=CHUNK, timeout_s=240)


def _single_node(path: Path, ignore_eos: bool) -> Engine:
    return fresh_engine(path, eos=not ignore_eos, prefill_chunk=CHUNK)


def _prompt(engine: Engine, length: int) -> list[int]:
    ids = engine.loaded.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return fib")
    while len(ids) < length:
        ids = ids + ids
    return ids[:length]


# -- stages in one process ------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_6_moe", "qwen3_next"])
def test_stages_compose_to_the_whole_model(checkpoint, arch):
    """Each stage loads only its part; run one after another they compute the whole model, bit for bit."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    path = checkpoint(arch, dtype="float32")
    whole = load_checkpoint(path)
    parts = [load_checkpoint(path, layers=tuple(r)) for r in SPLITS[3]]
    names = [{k for k, _ in tree_flatten(p.model.parameters())} for p in parts]
    assert all(not any(".layers.3." in n for n in names[i]) for i in (0, 1))
    assert not any(".layers.0." in n for n in names[1] | names[2])
    assert any("embed_tokens" in n for n in names[0]) and not any("embed_tokens" in n for n in names[1])
    assert any("embed_tokens" in n for n in names[2])  # the last stage's MTP head embeds tokens
    assert not any("lm_head" in n or n.endswith("model.norm.weight") for n in names[0] | names[1])
    assert parts[2].head is not None and parts[0].head is None and parts[0].tokenizer is None
    tokens = mx.array([_prompt(_single_node(path, False), 11)])
    caches = [p.model.make_cache() for p in parts]
    h = tokens
    for part, cache in zip(parts, caches, strict=True):
        h = part.model.stage_hidden(h, cache)
    assert mx.array_equal(h, whole.model.hidden(tokens, whole.model.make_cache())).item()


# -- real pipelines -------------------------------------------------------------------------------------


@pytest.mark.parametrize("stages", [2, 3], ids=["2-stages", "3-stages"])
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_6_moe", "qwen3_next"])
def test_pipeline_greedy_equals_single_node_plain(checkpoint, tmp_path, arch, stages, record_property):
    path = checkpoint(arch, dtype="float32")
    engine = _single_node(path, True)
    prompts = [_prompt(engine, n) for n in PROMPT_LENGTHS]
    requests = [{"prompt": p, "max_tokens": MAX_TOKENS, "ignore_eos": True, "native_mtp": "off"} for p in prompts]
    requests += [{"prompt": p, "max_tokens": MAX_TOKENS, "ignore_eos": True, "mtp_k": k, "native_mtp": "on"}
                 for k in DEPTHS for p in prompts]
    out = run_pipeline(tmp_path, path, SPLITS[stages], requests)
    # Single-node plain decoding of each prompt, once: every depth's requests of a prompt compare against it.
    plains = {tuple(p): engine.complete(GenerationRequest(p, max_tokens=MAX_TOKENS, native_mtp="off")) for p in prompts}
    drafted = accepted = 0
    for request, result in zip(requests, out["results"], strict=True):
        plain = plains[tuple(request["prompt"])]
        where = (len(request["prompt"]), request.get("mtp_k"), request["native_mtp"])
        assert result["token_ids"] == plain.token_ids, where
        assert result["text"] == plain.text, where
        stats = result["stats"]
        assert stats["mode"] == "pipeline" and stats["stages"] == stages
        assert stats["enabled"] == (request["native_mtp"] == "on"), where
        drafted += stats["drafted_tokens"]
        accepted += stats["accepted_tokens"]
    record_property("acceptance", accepted / drafted)
    assert drafted > 0 and accepted > 0  # the head drafted through the pipeline and was right at times


# The bundled demo model: 8 layers, full attention at layers 3 and 7. In these splits a stage that does
# not lead holds an attention layer (layer 3 on stage 0), so its KV cache must be trimmed after every
# round that rejected a draft (the fixtures' 4 layers put their one attention layer on the leader).
DEMO_SPLITS = {"2-stages": [[0, 4], [4, 8]], "3-stages": [[0, 4], [4, 6], [6, 8]]}
DEMO_TOKENS = 12


@pytest.mark.parametrize("split", list(DEMO_SPLITS), ids=list(DEMO_SPLITS))
def test_a_stage_that_does_not_lead_rolls_back_its_attention(tmp_path, split):
    from exo.cards import bundled_model_dir

    path = bundled_model_dir("exo-demo")
    stages = DEMO_SPLITS[split]
    engine = _single_node(path, True)
    prompts = [_prompt(engine, n) for n in (CHUNK + 3, 2 * CHUNK)]  # across the prefill chunk edge
    requests = [{"prompt": p, "max_tokens": DEMO_TOKENS, "ignore_eos": True, "mtp_k": k, "native_mtp": "on"}
                for k in DEPTHS for p in prompts]
    out = run_pipeline(tmp_path, path, stages, requests)["results"]
    plains = {tuple(p): engine.complete(GenerationRequest(p, max_tokens=DEMO_TOKENS, native_mtp="off")) for p in prompts}
    drafted = accepted = 0
    for request, result in zip(requests, out, strict=True):
        plain = plains[tuple(request["prompt"])]
        where = (len(request["prompt"]), request["mtp_k"])
        assert result["token_ids"] == plain.token_ids, where
        stats = result["stats"]
        assert stats["mode"] == "pipeline" and stats["stages"] == len(stages), stats
        drafted += stats["drafted_tokens"]
        accepted += stats["accepted_tokens"]
        if request["mtp_k"] is None:  # adaptive: the depth policy ran on the pipeline's own measured costs
            costs = stats["costs"]
            assert costs is not None and costs["stages"] == len(stages), costs
            assert len(costs["beta"]) == len(costs["delta"]) == 3 and min(costs["beta"]) >= 1.0, costs
            assert costs["plain_ms"] > 0, costs
            histogram = {int(k): v for k, v in stats["k_histogram"].items()}
            assert histogram and set(histogram) <= {0, 1, 2, 3}, histogram
            assert sum(v for k, v in histogram.items() if k > 0) == stats["rounds"], stats
            assert stats["rounds"] + histogram.get(0, 0) < DEMO_TOKENS  # rounds emit one token or more
    # Drafts were rejected (rows rolled back on every stage) and accepted (rows kept): both paths ran.
    assert 0 < accepted < drafted, (accepted, drafted)


def test_pipeline_penalties_stops_and_cancellation(checkpoint, tmp_path):
    """Penalties and a stop string inside accepted runs end exactly as on one node; a generation cut short
    (max_tokens inside a round) leaves no state behind for the next request on the same stages."""
    path = checkpoint("qwen3_5", dtype="float32")
    engine = _single_node(path, True)
    prompt = _prompt(engine, 10)
    full = engine.complete(GenerationRequest(prompt, max_tokens=40, native_mtp="off"))
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    penalties = {"repetition_penalty": 1.3, "presence_penalty": 0.4, "frequency_penalty": 0.3}
    requests = [
        {"prompt": prompt, "max_tokens": 40, "ignore_eos": True, "mtp_k": 3, "sampling": penalties},
        {"prompt": prompt, "max_tokens": 5, "ignore_eos": True, "mtp_k": 3},
        {"prompt": prompt, "max_tokens": 40, "ignore_eos": True, "mtp_k": 2, "stop": stop},
        {"prompt": prompt, "max_tokens": 40, "ignore_eos": True, "mtp_k": 3},
    ]
    for request in requests:
        request.setdefault("native_mtp", "on")
    out = run_pipeline(tmp_path, path, SPLITS[2], requests)["results"]
    penalised = engine.complete(GenerationRequest(prompt, max_tokens=40, native_mtp="off",
                                                  sampling=SamplingParams(**penalties)))
    assert out[0]["token_ids"] == penalised.token_ids
    assert out[1]["token_ids"] == full.token_ids[:5] and out[1]["finish_reason"] == "length"
    stopped = engine.complete(GenerationRequest(prompt, max_tokens=40, native_mtp="off", stop=[stop]))
    assert out[2]["token_ids"] == stopped.token_ids and out[2]["finish_reason"] == "stop"
    assert out[2]["text"] == stopped.text
    assert out[3]["token_ids"] == full.token_ids


def test_pipeline_constrained_decoding_and_logprobs_equal_single_node(checkpoint, tmp_path):
    """The leader runs the one loop: a grammar (compiled on the leader) and logprobs through a pipeline give
    single-node constrained plain decoding's tokens and log-probabilities."""
    from exo.engine.constraints import ConstraintSpec, compile_grammar

    path = checkpoint("qwen3_5", dtype="float32")
    engine = _single_node(path, False)
    spec = ConstraintSpec(json_schema={"type": "object", "properties": {"n": {"type": "integer"}, "ok": {
        "type": "boolean"}}, "required": ["n", "ok"]})
    grammar = compile_grammar(spec, engine.grammar_tokenizer, engine.vocab_size, "json", engine.closing_tokens)
    prompt = _prompt(engine, 12)
    plain = engine.complete(GenerationRequest(prompt, max_tokens=40, native_mtp="off", constraint=grammar, logprobs=2))
    assert plain.finish_reason == "stop" and json.loads(plain.text).keys() == {"n", "ok"}
    requests = [{"prompt": prompt, "max_tokens": 40, "mtp_k": k, "constraint": spec.to_json(), "logprobs": 2}
                for k in (2, 3)]
    for out in run_pipeline(tmp_path, path, SPLITS[2], requests)["results"]:
        assert out["token_ids"] == plain.token_ids and out["text"] == plain.text
        assert [e[0] for e in out["logprobs"]] == [e.token for e in plain.logprobs]
        assert [e[1] for e in out["logprobs"]] == pytest.approx([e.logprob for e in plain.logprobs], abs=1e-4)
    assert out["stats"]["mode"] == "pipeline"


def test_pipeline_without_a_head_runs_plain_and_says_why(checkpoint, tmp_path):
    path = checkpoint("qwen3_5", layout="mlx")  # a stock conversion: the head was dropped
    engine = _single_node(path, True)
    prompt = _prompt(engine, 9)
    out = run_pipeline(tmp_path, path, SPLITS[2], [{"prompt": prompt, "max_tokens": 8, "ignore_eos": True}])
    result = out["results"][0]
    plain = engine.complete(GenerationRequest(prompt, max_tokens=8, native_mtp="off"))
    assert result["token_ids"] == plain.token_ids
    assert not result["stats"]["enabled"] and "mtp" in result["stats"]["reason"].lower()
    assert result["stats"]["mode"] == "pipeline"


@pytest.mark.parametrize("stages", [2, 3], ids=["2-stages", "3-stages"])
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_the_graph_wire_decodes_like_one_node(checkpoint, tmp_path, arch, stages):
    """EXO_PIPELINE_WIRE=graph: a step's ids and hiddens cross the stages as ops of each stage's graph (MLX's ring send
    and receive on the link's own stream), every stage building its step before its input arrives. Greedy output
    is one node's, token for token: plain steps, MTP rounds (their rollbacks ride the next header), prompts that
    cross the prefill chunk (ids that never fit a header), and a batch whose members join it mid-decode (op
    records, wide steps), and one whose prompts prefill as rows of one call (each row's length and owner in its
    header). The host wire (the default on a CPU) serves the same requests alike, and so does the
    collective wire of a pipeline of two (EXO_PIPELINE_WIRE=collective: each transfer an all-sum of the group, the
    receiver adding zeros, as NCCL carries it on GPUs; here the ring backend's)."""
    path = checkpoint(arch, dtype="float32")
    engine = _single_node(path, True)
    prompts = [_prompt(engine, n) for n in (1, 2 * CHUNK + 3, 3 * CHUNK)]
    plain = [{"prompt": p, "max_tokens": MAX_TOKENS, "ignore_eos": True, "native_mtp": "off"} for p in prompts]
    rounds = [{"prompt": p, "max_tokens": MAX_TOKENS, "ignore_eos": True, "mtp_k": k, "native_mtp": "on"}
              for k in (1, 3) for p in prompts[1:]]
    batch = {"batch": plain, "join_at": [0, 1, 4]}
    together = {"batch": plain, "together": True}  # their prompts as rows of one call through the stages
    expected = {tuple(p): engine.complete(GenerationRequest(p, max_tokens=MAX_TOKENS, native_mtp="off")).token_ids
                for p in prompts}
    for wire in ("graph", "host", "collective")[: 3 if stages == 2 else 2]:
        out = run_local_pipeline(path, [tuple(s) for s in SPLITS[stages]], [*plain, *rounds, batch, together],
                                 prefill_chunk=CHUNK, timeout_s=240, stage_env=[{"EXO_PIPELINE_WIRE": wire}] * stages)
        assert out["wire"] == wire
        *single, batched, shared = out["results"]
        for request, result in zip([*plain, *rounds], single, strict=True):
            assert result["token_ids"] == expected[tuple(request["prompt"])], (wire, request.get("mtp_k"))
            assert result["stats"]["mode"] == "pipeline" and result["stats"]["stages"] == stages
        assert sum(r["stats"]["accepted_tokens"] for r in single) > 0  # rounds kept drafts through the stages
        assert [r["token_ids"] for r in batched] == [expected[tuple(p)] for p in prompts], wire
        assert [r["token_ids"] for r in shared] == [expected[tuple(p)] for p in prompts], wire
        assert all(r["together"] for r in shared) and not any(r["together"] for r in batched)


def test_a_pipeline_past_its_limit_is_killed_and_says_where_each_stage_was(checkpoint):
    """``run_local_pipeline``'s limit is the whole run's: past it every stage is killed and the error carries what each
    wrote, with its main thread's stack where EXO_STAGE_TRACEBACK_S asked for them (a stuck stage says where it waits)."""
    from exo.runner.local_pipeline import LocalPipelineError

    path = checkpoint("qwen3_5")
    request = {"prompt": [1, 2, 3, 4], "max_tokens": 100_000, "ignore_eos": True, "native_mtp": "off"}
    started = time.monotonic()
    with pytest.raises(LocalPipelineError, match="did not finish within 6 s") as error:
        run_local_pipeline(path, [(0, 2), (2, 4)], [request], timeout_s=6,
                           stage_env=[{"EXO_STAGE_TRACEBACK_S": "4"}] * 2)
    assert time.monotonic() - started < 30
    message = str(error.value)
    assert "stage 0:" in message and "stage 1:" in message and message.count("most recent call first") >= 2


def test_each_stage_gets_its_own_environment(checkpoint):
    """``stage_env`` (bench/pipeline.py --gpu-per-stage: CUDA_VISIBLE_DEVICES per stage) reaches the stage
    processes: EXO_ENGINE_PROFILE=1 there puts round phases in the leader's stats, absent from this process."""
    path = checkpoint("qwen3_5")
    request = {"prompt": [1, 2, 3, 4], "max_tokens": 6, "ignore_eos": True, "mtp_k": 1, "native_mtp": "on"}
    with pytest.raises(ValueError, match="2 stage environments for 3 stages"):
        run_local_pipeline(path, [(0, 1), (1, 2), (2, 4)], [request], stage_env=[{}, {}])
    assert "EXO_ENGINE_PROFILE" not in os.environ
    out = run_local_pipeline(path, [(0, 2), (2, 4)], [request, request], timeout_s=240,
                             stage_env=[{"EXO_ENGINE_PROFILE": "1"}, {"EXO_ENGINE_PROFILE": "1"}])
    assert all(result["stats"]["profile_ms"] for result in out["results"])
    out = run_local_pipeline(path, [(0, 2), (2, 4)], [request], timeout_s=240)
    assert not out["results"][0]["stats"].get("profile_ms")


RUNS = 300


def _pvalue(a: list[list[int]], b: list[list[int]]) -> float:
    """Two-sample chi-squared on the joint outcomes of tokens 1 and 2, rare outcomes pooled."""
    keys_a, keys_b = [tuple(r[1:3]) for r in a], [tuple(r[1:3]) for r in b]
    outcomes = sorted(set(keys_a) | set(keys_b))
    counts = np.array([[keys_a.count(o) for o in outcomes], [keys_b.count(o) for o in outcomes]])
    common = counts.sum(axis=0) >= 10
    table = np.column_stack([counts[:, common], counts[:, ~common].sum(axis=1)])
    return float(chi2_contingency(table[:, table.sum(axis=0) > 0]).pvalue)


def test_pipeline_sampling_keeps_plain_sampling_distribution(checkpoint, tmp_path, record_property):
    path = checkpoint("qwen3_5", dtype="float32")
    engine = _single_node(path, False)
    prompt = engine.loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me something."}], add_generation_prompt=True
    )
    requests = [{"prompt": prompt, "max_tokens": 3, "mtp_k": 2, "native_mtp": "on",
                 "sampling": {"temperature": 1.0, "seed": seed}} for seed in range(RUNS)]
    # The stages pass each step back and forth (one of them busy at a time): this process samples plainly
    # meanwhile, on the core they leave idle, rather than after them.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        piping = pool.submit(run_pipeline, tmp_path, path, SPLITS[2], requests)
        plain = [
            (engine.complete(GenerationRequest(prompt, max_tokens=3, native_mtp="off",
                                               sampling=SamplingParams(temperature=1.0, seed=RUNS + seed))).token_ids
             + [-1] * 3)[:3]
            for seed in range(RUNS)
        ]
        out = piping.result()["results"]
    piped = [(r["token_ids"] + [-1] * 3)[:3] for r in out]
    drafted = sum(r["stats"]["drafted_tokens"] for r in out)
    accepted = sum(r["stats"]["accepted_tokens"] for r in out)
    assert 0 < accepted < drafted, "both the accept and the reject path must run"
    pvalue = _pvalue(piped, plain)
    record_property("pvalue", pvalue)
    assert pvalue > 1e-3, pvalue


# -- the stage loop over an in-process link -----------------------------------------------------------------


class _QueueLink:
    """``exo.engine.pipeline.Link`` between two threads of this process: one queue per direction, every
    message's bytes counted (what a ring would carry). Messages cross as numpy copies: an MLX array's graph
    belongs to the stream of the thread that built it."""

    def __init__(self, rank: int, queues: dict[tuple[int, int], queue.Queue]) -> None:
        self.rank, self.queues = rank, queues
        self.sent: list[int] = []  # bytes of each message sent

    def send(self, x, dst: int) -> None:
        import mlx.core as mx

        mx.eval(x)
        self.sent.append(x.nbytes)
        self.queues[(self.rank, dst)].put(np.array(x))

    def recv(self, shape, dtype, src: int):
        import mlx.core as mx

        x = self.queues[(src, self.rank)].get(timeout=60)
        if isinstance(x, BaseException):
            raise RuntimeError("the other stage failed") from x
        out = mx.array(x)
        assert tuple(out.shape) == tuple(shape) and out.dtype == dtype, (out.shape, shape, out.dtype, dtype)
        return out


@pytest.mark.parametrize("moe", ["route_locked", "batched", "safe"])
def test_serve_stage_applies_the_headers_verify_mode_and_a_round_moves_header_and_hiddens(checkpoint, monkeypatch,
                                                                                           moe):
    """A stage that does not lead runs a verify step in the MoE mode its header carries (the leader's), plain
    steps with none; at its first verify header it probes its own layers once (``verify.probe``: which linear
    shapes this device computes a block of rows unlike one row); per round the leader sends the 256-byte header
    (the rows' ids and the previous round's rollback inline) and receives (K+1) x H activations: 256 B +
    (K+1) x H x dtype bytes cross the boundary (bench/pipeline.py's figures)."""
    import mlx.core as mx

    from exo.engine.models.layers import SparseMoeBlock
    from exo.engine.pipeline import HEADER_LEN, PipelineForward, StageSpec, serve_stage
    from exo.engine.verify import VerifyMode

    path = checkpoint("qwen3_5_moe", dtype="float32")
    first = load_checkpoint(path, layers=(0, 2))
    leader = load_checkpoint(path, layers=(2, 4))
    from exo.engine import pipeline

    seen: list[tuple[str | None, int]] = []  # (the MoE block's verify mode, rows) of every call on stage 0
    recording = [True]  # (off while the stage probes its layers: the probe's own calls)

    class Recording(SparseMoeBlock):
        def __call__(self, x):
            if recording[0]:
                seen.append((self.verify_mode, x.shape[1]))
            return super().__call__(x)

    real_probe = pipeline.probe

    def probing(model, moe_mode):
        seen.append(("probe", moe_mode))
        recording[0] = False
        try:
            return real_probe(model, moe_mode)
        finally:
            recording[0] = True

    monkeypatch.setattr(pipeline, "probe", probing)

    blocks = list(first.model.moe_blocks())
    assert blocks, "stage 0 of the MoE fixture holds MoE blocks"
    for block in blocks:
        block.__class__ = Recording
    queues = {(0, 1): queue.Queue(), (1, 0): queue.Queue()}
    links = [_QueueLink(0, queues), _QueueLink(1, queues)]
    errors: list[BaseException] = []

    done, park = threading.Event(), threading.Event()

    def stage0() -> None:
        try:
            serve_stage(first.model, StageSpec(0, 2, 0, 2), links[0])
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
            queues[(0, 1)].put(e)
        done.set()
        park.wait()  # parked, never ended: a thread that ran MLX may abort the process as it exits

    thread = threading.Thread(target=stage0, daemon=True)
    thread.start()
    forward = PipelineForward(leader.model, StageSpec(1, 2, 2, 4), links[1], verify=VerifyMode(moe))
    hidden_bytes = leader.model.hidden_size * mx.float32.size
    try:
        cache = forward.new_cache()
        prompt = mx.array([[5, 9, 13, 2, 7]], dtype=mx.uint32)
        mx.eval(forward.hidden(prompt, cache))
        seen.clear()
        for k in (1, 2, 3):
            sent, received = len(links[1].sent), forward.bytes_received
            rows = mx.array([[3 + i for i in range(k + 1)]], dtype=mx.uint32)
            mx.eval(forward.hidden(rows, cache, verify=True))
            forward.rollback(cache, k + 1, 1)  # the next step carries the rollback to stage 0
            assert links[1].sent[sent:] == [4 * HEADER_LEN] == [256]
            assert forward.bytes_received - received == (k + 1) * hidden_bytes
            assert links[0].sent[-1] == (k + 1) * hidden_bytes
            assert sum(links[1].sent[sent:]) + links[0].sent[-1] == 256 + (k + 1) * hidden_bytes
        mx.eval(forward.hidden(mx.array([[4]], dtype=mx.uint32), cache))  # a plain step
        forward.end(cache)
    finally:
        forward.shutdown()
        done.wait(30)
    assert not errors, errors
    assert done.is_set()  # serve_stage returned at the shutdown
    assert seen[0] == ("probe", moe) and seen.count(("probe", moe)) == 1  # once, before the first verify step
    seen.pop(0)
    per_call = [seen[i : i + len(blocks)] for i in range(0, len(seen), len(blocks))]
    assert [{m for m, _ in call} for call in per_call] == [{moe}, {moe}, {moe}, {None}], seen
    assert [call[0][1] for call in per_call] == [2, 3, 4, 1]
