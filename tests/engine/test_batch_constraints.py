"""Constrained decoding and logprobs inside a batch (engine/batch.py): a member under a JSON schema, one
forced to call a tool, one asking for logprobs and a plain one decode together, joining at different steps,
and each gets exactly its solo output (tokens, text, logprob values), with native MTP off and on."""

from __future__ import annotations

import pytest

from exo.engine import GenerationRequest, SamplingParams
from exo.engine.batch import BatchDecoder

from .test_constraints import SCHEMA, TOOLS, _check_output, _engine, _grammar, _prompt


@pytest.fixture(scope="module")
def demo():
    from exo.cards import bundled_model_dir

    return _engine(bundled_model_dir("exo-demo"))


def _requests(engine, mtp: dict) -> list[GenerationRequest]:
    schema = _grammar(engine, SCHEMA)
    tool = _grammar(engine, TOOLS)  # a forced tool call: the output is one call of these functions
    return [
        GenerationRequest(_prompt(engine, "Who are you?"), max_tokens=40, constraint=schema, **mtp),
        GenerationRequest(_prompt(engine, "Tell me something."), max_tokens=20, logprobs=3, **mtp),
        GenerationRequest(_prompt(engine, "What is the weather in Paris?", tools=True), max_tokens=48,
                          constraint=tool, logprobs=2, **mtp),
        GenerationRequest(_prompt(engine, "Count to ten."), max_tokens=24,
                          sampling=SamplingParams(temperature=0.8, seed=5), **mtp),
        GenerationRequest(_prompt(engine, "Tell me something."), max_tokens=40, constraint=schema,
                          sampling=SamplingParams(temperature=0.7, seed=2), logprobs=1, **mtp),
    ]


def _batched(engine, requests, join_at):
    batch = BatchDecoder(engine)
    out = {i: {"tokens": [], "text": [], "logprobs": [], "finish": None, "stats": None} for i in range(len(requests))}
    index, step, waiting = {}, 0, set(range(len(requests)))

    def take(i, chunk):
        out[i]["tokens"] += chunk.token_ids
        out[i]["text"].append(chunk.text)
        out[i]["logprobs"] += chunk.logprobs or []
        if chunk.finish_reason is not None:
            out[i]["finish"], out[i]["stats"] = chunk.finish_reason, chunk.stats

    while waiting or len(batch):
        for i in sorted(waiting):
            if join_at[i] <= step:
                waiting.discard(i)
                run = engine.start(requests[i])
                for chunk in run.begin():
                    take(i, chunk)
                index[id(run)] = i
                if run.output.finish is not None:
                    take(i, run.final_chunk())
                else:
                    batch.add(run)
        for run, chunks in batch.step():
            for chunk in chunks:
                take(index[id(run)], chunk)
        batch.check_invariants()
        step += 1
    return out


@pytest.mark.parametrize("mtp", [{"native_mtp": "off"}, {"mtp_k": 2}], ids=["plain", "mtp_k2"])
def test_constrained_and_logprob_members_get_their_solo_output_in_a_batch(demo, mtp):
    engine = demo
    requests = _requests(engine, mtp)
    got = _batched(engine, requests, join_at=[0, 0, 2, 3, 5])
    for i, request in enumerate(requests):
        solo = engine.complete(request)
        mine = got[i]
        assert mine["tokens"] == solo.token_ids, f"request {i}"
        assert "".join(mine["text"]) == solo.text and mine["finish"] == solo.finish_reason
        if request.constraint is not None:
            assert solo.finish_reason == "stop"
            _check_output(SCHEMA if i in (0, 4) else TOOLS, solo.text)
        if request.logprobs is not None:
            assert solo.logprobs
            assert [(e.token, e.logprob) for e in mine["logprobs"]] == [(e.token, e.logprob) for e in solo.logprobs]
            assert [[(t.token, t.logprob) for t in e.top] for e in mine["logprobs"]] == \
                [[(t.token, t.logprob) for t in e.top] for e in solo.logprobs]
        else:
            assert not mine["logprobs"]
        assert max(mine["stats"].batch_sizes) >= 2, f"request {i} decoded in a batch"
    if "mtp_k" in mtp:
        assert all(got[i]["stats"].drafted_tokens > 0 for i in got)
