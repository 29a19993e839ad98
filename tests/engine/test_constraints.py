"""Constrained decoding and logprobs in the generation loop, with native MTP on and off.

At temperature 0 a constrained MTP generation is token for token constrained plain decoding at every
depth (drafts and verify rows see the grammar after the accepted prefix; rejected drafts roll it back);
with sampling the tokens follow the masked target distribution (chi-squared against the exact one, and
against plain sampling). Logprobs are the distribution each token was chosen from, checked against a
full forward pass of the emitted sequence, and the same with MTP on and off.
"""

from __future__ import annotations

import json

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from scipy.stats import chi2_contingency, chisquare

from exo.cards import bundled_model_dir
from exo.engine import Engine, GenerationRequest, SamplingParams
from exo.engine.constraints import ConstraintSpec, ToolSpec, compile_grammar
from exo.engine.prompt import tokenize
from exo.engine.sampling import filtered_logprobs
from tests.fixtures.engines import fresh_engine

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days"],
}
ADD = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
}
TOOLS = ConstraintSpec(tools=(ToolSpec("get_weather", WEATHER), ToolSpec("add", ADD)))
SCHEMA = ConstraintSpec(json_schema=PERSON)
PROMPTS = ("What is the weather in Paris?", "Tell me something.")


def _engine(path) -> Engine:
    return fresh_engine(path)


@pytest.fixture(scope="module")
def engine(checkpoint) -> Engine:
    """A float32 fixture (tight logprob tolerances; its 512-token vocabulary spells JSON nearly by character)."""
    return _engine(checkpoint("qwen3_5", dtype="float32"))


@pytest.fixture(scope="module")
def demo() -> Engine:
    """The bundled demo model (a 4096-token vocabulary: tool calls in a few dozen tokens)."""
    return _engine(bundled_model_dir("exo-demo"))


def _grammar(engine: Engine, spec: ConstraintSpec, fmt: str = "json", closing: bool = True):
    return compile_grammar(spec, engine.grammar_tokenizer, engine.vocab_size, fmt,
                           engine.closing_tokens if closing else None)


def _prompt(engine: Engine, text: str, tools: bool = False) -> list[int]:
    definitions = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}] if tools else None
    return tokenize(engine.loaded.tokenizer, messages=[{"role": "user", "content": text}], tools=definitions)


def _check_output(spec: ConstraintSpec, text: str) -> None:
    if spec.json_schema is not None:
        jsonschema.validate(json.loads(text), spec.json_schema)
        return
    schemas = {t.name: t.parameters for t in spec.tools}
    head, _, rest = text.partition("<tool_call>\n")
    assert head == "" and rest.endswith("\n</tool_call>"), text
    call = json.loads(rest.removesuffix("\n</tool_call>"))
    jsonschema.validate(call["arguments"], schemas[call["name"]])


@pytest.mark.parametrize("spec", [TOOLS, SCHEMA], ids=["tool_call", "json_schema"])
def test_constrained_mtp_is_constrained_plain_token_for_token(demo, spec):
    engine = demo
    grammar = _grammar(engine, spec)
    drafted = accepted = 0
    for i, text in enumerate(PROMPTS[:1] if spec.tools else PROMPTS):  # a tools prompt is long to prefill here
        prompt = _prompt(engine, text, tools=spec.tools != ())
        sampling = SamplingParams(presence_penalty=0.5) if i == 1 else SamplingParams()
        plain = engine.complete(
            GenerationRequest(prompt, max_tokens=64, native_mtp="off", constraint=grammar, sampling=sampling)
        )
        assert plain.finish_reason == "stop", plain.text
        _check_output(spec, plain.text)
        for k in (1, 2, 3, None):
            mtp = engine.complete(GenerationRequest(prompt, max_tokens=64, mtp_k=k, constraint=grammar, sampling=sampling))
            assert mtp.token_ids == plain.token_ids, (text, k)
            drafted += mtp.stats.drafted_tokens
            accepted += mtp.stats.accepted_tokens
    assert 0 < accepted < drafted, "both accepted and rejected drafts (grammar rollbacks) must occur"


def test_a_constraint_that_runs_out_of_tokens_closes_its_json(demo):
    engine = demo
    """An unbounded array of strings: with a budget too small to finish freely, the answer still parses."""
    spec = ConstraintSpec(json_schema={"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}},
                                       "required": ["items"]})
    grammar = _grammar(engine, spec)
    prompt = _prompt(engine, "List many things.")
    for max_tokens in (10, 16, 24):
        for k in (None, 2):
            result = engine.complete(GenerationRequest(prompt, max_tokens=max_tokens, mtp_k=k, constraint=grammar))
            assert result.finish_reason == "stop" and len(result.token_ids) <= max_tokens, result
            _check_output(spec, result.text)


def _reference_logprobs(engine: Engine, prompt: list[int], tokens: list[int]) -> mx.array:
    """log_softmax of the model's logits at every emitted position, from one forward pass: [len(tokens), V]."""
    model = engine.model
    ids = mx.array([prompt + tokens[:-1]], dtype=mx.uint32)
    logits = model.logits(model.hidden(ids, model.make_cache()))[0, len(prompt) - 1 :].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _check_against(reference: mx.array, result, eos: frozenset[int], top: int) -> None:
    tokens = [t for t in result.token_ids if t not in eos]
    assert [e.token for e in result.logprobs] == tokens
    ref = np.array(reference)
    for i, entry in enumerate(result.logprobs):
        assert entry.logprob == pytest.approx(float(ref[i, entry.token]), abs=2e-4)
        assert entry.bytes == bytes(entry.bytes)
        expected = np.sort(ref[i])[::-1][:top]
        assert [t.logprob for t in entry.top] == pytest.approx(list(expected), abs=2e-4)
        assert entry.top[0].logprob >= entry.top[-1].logprob


def test_logprobs_are_the_chosen_distribution_with_mtp_on_and_off(engine):
    prompt = _prompt(engine, "Tell me something.")
    eos = engine.loaded.eos_token_ids
    plain = engine.complete(GenerationRequest(prompt, max_tokens=24, native_mtp="off", logprobs=5))
    _check_against(_reference_logprobs(engine, prompt, plain.token_ids), plain, eos, 5)
    for k in (1, 2, 3):
        mtp = engine.complete(GenerationRequest(prompt, max_tokens=24, mtp_k=k, logprobs=5))
        assert mtp.token_ids == plain.token_ids
        for a, b in zip(mtp.logprobs, plain.logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t.token for t in a.top] == [t.token for t in b.top]
    # Sampling: the filtered, tempered distribution the token was drawn from (drafts, corrections, bonuses).
    params = SamplingParams(temperature=0.7, top_k=40, seed=3)
    for request in ({"native_mtp": "off"}, {"mtp_k": 2}):
        sampled = engine.complete(GenerationRequest(prompt, max_tokens=16, sampling=params, logprobs=3, **request))
        reference = _reference_logprobs(engine, prompt, sampled.token_ids)
        _check_against(filtered_logprobs(reference, params), sampled, eos, 3)
        assert sampled.stats.drafted_tokens > 0 or request.get("native_mtp") == "off"


def test_logprobs_under_a_grammar_are_the_masked_distribution(engine):
    grammar = _grammar(engine, SCHEMA)
    prompt = _prompt(engine, "Who are you?")
    result = engine.complete(GenerationRequest(prompt, max_tokens=64, mtp_k=2, constraint=grammar, logprobs=2))
    assert result.finish_reason == "stop"
    _check_output(SCHEMA, result.text)
    reference = np.array(_reference_logprobs(engine, prompt, result.token_ids))
    matcher = grammar.matcher(64)
    for i, entry in enumerate(result.logprobs):
        allowed = matcher.allowed()
        masked = np.where(allowed, reference[i], -np.inf)
        masked = masked - np.logaddexp.reduce(masked[allowed])
        assert entry.logprob == pytest.approx(float(masked[entry.token]), abs=2e-4)
        assert all(allowed[t.token] or t.logprob == -9999.0 for t in entry.top)
        matcher.consume(entry.token)


RUNS = 300


def _samples(engine, prompt, grammar, **request) -> tuple[np.ndarray, int, int]:
    rows, drafted, accepted = [], 0, 0
    for seed in range(RUNS):
        result = engine.complete(GenerationRequest(
            prompt, max_tokens=3, sampling=SamplingParams(temperature=1.0, seed=seed), constraint=grammar, **request
        ))
        rows.append((result.token_ids + [-1] * 3)[:3])
        drafted += result.stats.drafted_tokens
        accepted += result.stats.accepted_tokens
    return np.array(rows), drafted, accepted


def _pooled(counts: np.ndarray, expected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cells expected fewer than 5 times pooled into one (goodness of fit needs expected counts >= 5)."""
    common = expected >= 5
    if expected[~common].sum() == 0:
        return counts[common], expected[common]
    return (np.append(counts[common], counts[~common].sum()), np.append(expected[common], expected[~common].sum()))


def test_constrained_sampling_is_the_masked_target_distribution(engine, record_property):
    """A JSON string of digits (where the model would rather write letters): token 0 is the forced quote, tokens 1 and 2 come from speculative
    rounds. Token 1 follows the exact masked distribution; (token 1, token 2) match plain sampling."""
    spec = ConstraintSpec(json_schema={"type": "string", "pattern": "^[0-9]{2,12}$"})
    grammar = _grammar(engine, spec, closing=False)  # 3 tokens: the mask alone (no budget closing)
    prompt = _prompt(engine, "Say a word.")
    plain, _, _ = _samples(engine, prompt, grammar, native_mtp="off")
    mtp, drafted, accepted = _samples(engine, prompt, grammar, mtp_k=2)
    assert len(set(plain[:, 0])) == 1 and (mtp[:, 0] == plain[0, 0]).all()  # the opening quote, forced
    # Token 1 against the exact masked target distribution.
    matcher = grammar.matcher(3)
    matcher.consume(int(plain[0, 0]))
    allowed = matcher.allowed()
    reference = np.array(_reference_logprobs(engine, prompt, [int(plain[0, 0]), 0]))[1].astype(np.float64)
    p = np.where(allowed, np.exp(reference - reference[allowed].max()), 0.0)
    p /= p.sum()
    counts = np.bincount(mtp[:, 1], minlength=p.shape[0]).astype(float)
    assert counts[~allowed].sum() == 0
    observed, expected = _pooled(counts[allowed], p[allowed] * RUNS)
    expected *= observed.sum() / expected.sum()
    gof = float(chisquare(observed, expected).pvalue)
    # (token 1, token 2): MTP against plain sampling, two-sample, rare outcomes pooled.
    keys_a, keys_b = [tuple(r) for r in plain[:, 1:]], [tuple(r) for r in mtp[:, 1:]]
    outcomes = sorted(set(keys_a) | set(keys_b))
    table = np.array([[keys_a.count(o) for o in outcomes], [keys_b.count(o) for o in outcomes]])
    common = table.sum(axis=0) >= 10
    table = np.column_stack([table[:, common], table[:, ~common].sum(axis=1)])
    two_sample = float(chi2_contingency(table[:, table.sum(axis=0) > 0]).pvalue)
    record_property("pvalues", (gof, two_sample))
    assert 0 < accepted < drafted, "both the accept and the reject path must run"
    assert gof > 1e-3 and two_sample > 1e-3, (gof, two_sample)
