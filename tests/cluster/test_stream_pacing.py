"""A node's runner paces a stream's tokens as ``EXO_STREAM_INTERVAL_S`` says (runner/outbox.py), through
``exo serve`` to an OpenAI client: with an interval longer than the generation, the first token comes alone and
every later one with the last chunk, and the text is the same as unstreamed."""

from __future__ import annotations

import openai
import pytest

from .daemons import Daemon, serving

pytestmark = pytest.mark.timeout(240)
MODEL = "exo-demo"


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with serving(Daemon(tmp_path_factory.mktemp("pacing"), "pacing", extra_args=["--model", MODEL],
                         env={"EXO_STREAM_INTERVAL_S": "1.0", "EXO_NATIVE_MTP_ENABLED": "0"})) as d:
        yield d


def test_a_paced_stream_sends_the_first_token_alone_and_the_rest_with_the_end(node):
    client = openai.OpenAI(base_url=node.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Count from one to twenty."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert whole.usage.completion_tokens == 24, whole  # (a generation of 24 tokens decodes well inside 1 s here)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    deltas = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    # The first token; then the 23 others with the finish (here in ~0.1 s: a machine 10x slower still sends them
    # in one more message, not 23)
    assert 2 <= len(deltas) <= 3, deltas
    assert "".join(deltas) == whole.choices[0].message.content
