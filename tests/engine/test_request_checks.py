"""A request is validated by one rule whichever way it was built: a server's parameters (``prompt.
generation_request``, which fills the budget in) or a ``GenerationRequest`` made by hand (``Engine.start``)
meet the same ``check_request`` / ``check_budget``, with the same error and message."""

from __future__ import annotations

import pytest

from exo.engine import GenerationRequest
from exo.engine.prompt import GenerateParams, Prompt, generation_request
from exo.engine.request import ContextLengthError, GenerationRequestError
from tests.fixtures.engines import fresh_engine


@pytest.fixture
def engine(checkpoint):
    return fresh_engine(checkpoint("qwen3_5"))


def _both(engine, tokens: list[int], max_tokens: int, **params) -> tuple[BaseException, BaseException]:
    errors = []
    with pytest.raises(GenerationRequestError) as served:
        generation_request(engine, Prompt(token_ids=tokens), GenerateParams(max_tokens, 16, **params))
    errors.append(served.value)
    with pytest.raises(GenerationRequestError) as direct:
        engine.start(GenerationRequest(prompt_tokens=tokens, max_tokens=max_tokens, **params))
    errors.append(direct.value)
    return errors[0], errors[1]


def test_a_request_past_the_context_meets_the_same_rule_served_or_built_by_hand(engine):
    limit = engine.loaded.context_length
    assert limit is not None
    served, direct = _both(engine, [1, 2, 3], limit)
    assert type(served) is type(direct) is ContextLengthError
    assert str(served) == str(direct) == (
        f"this model's maximum context length is {limit} tokens, but {limit + 3} were requested (3 in the "
        "prompt, "f"{limit} for the completion); shorten the prompt or lower max_tokens")
    assert served.param == "prompt" and direct.param == "messages"  # the served prompt's own field


def test_a_budget_below_one_meets_the_same_rule(engine):
    served, direct = _both(engine, [1, 2, 3], 0)
    assert str(served) == str(direct) == "max_tokens must be >= 1, got 0"
    assert served.param == direct.param == "max_tokens"


def test_a_forced_depth_out_of_range_is_refused_once_with_its_message(engine):
    with pytest.raises(GenerationRequestError, match=r"the MTP depth must be in 0\.\.8, got 9"):
        engine.start(GenerationRequest(prompt_tokens=[1, 2, 3], max_tokens=4, mtp_k=9))
