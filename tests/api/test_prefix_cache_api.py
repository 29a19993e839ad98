"""The prefix cache through the HTTP API: OpenAI's ``usage.prompt_tokens_details.cached_tokens`` on chat and
completions (streaming included), the same reply as a cold engine, and the cache's figures on /metrics."""

from __future__ import annotations

SYSTEM = "You are a careful coding agent. You may call read(path), grep(pattern) and run(cmd). " * 3
TURN1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Find the bug in parser.py"}]


def _ids(reference, messages) -> list[int]:
    return list(reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def test_cached_tokens_on_chat_and_completions(make_server, model_dir, reference):
    server = make_server(model_dir, env={"EXO_PREFIX_CACHE_BLOCK_TOKENS": "16"})
    client = server.openai()
    first = client.chat.completions.create(model=server.model, messages=TURN1, temperature=0, max_tokens=8)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    turn2 = TURN1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Tool result: line 12 divides by zero"}]
    cold = reference(_ids(reference, turn2), max_tokens=8)
    second = client.chat.completions.create(model=server.model, messages=turn2, temperature=0, max_tokens=8,
                                            extra_body={"prompt_cache_key": "session-1"})  # Codex sends one
    cached = second.usage.prompt_tokens_details.cached_tokens
    p1 = _ids(reference, TURN1)
    header = len(p1) - len(reference.tokenizer.encode("<|im_start|>assistant\n"))
    assert p1[header] == p1[0] and cached == header  # restored at turn 1's generation header
    assert second.choices[0].message.content == cold.text
    assert second.usage.model_extra["native_mtp"]["cached_tokens"] == cached

    # Streaming: the usage chunk carries it.
    stream = client.chat.completions.create(model=server.model, messages=turn2, temperature=0, max_tokens=8,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    p2 = _ids(reference, turn2)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == max(i for i, t in enumerate(p2) if t == p2[0])
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == cold.text

    # Completions share the cache (the same tokens are the same prefix).
    text = reference.tokenizer.decode(p1)
    whole = client.completions.create(model=server.model, prompt=text, temperature=0, max_tokens=4)
    assert whole.usage.prompt_tokens_details.cached_tokens > 0

    assert server.metric("exo_prefix_cache_hits_total", model=server.model) >= 3
    assert server.metric("exo_prefix_cache_cached_tokens_total", model=server.model) >= 2 * header
    assert 0 < server.metric("exo_prefix_cache_token_hit_rate", model=server.model) < 1
    assert server.metric("exo_prefix_cache_bytes", model=server.model, tier="ram") > 0
    # The budgets the tiers keep to: RAM's shrunk to fit the node (tests/runner/test_prefix_store.py).
    assert 0 < server.metric("exo_prefix_cache_budget_bytes", model=server.model, tier="ram") <= 2 << 30
    assert server.metric("exo_prefix_cache_budget_bytes", model=server.model, tier="disk") == 16 << 30
    # The disk tier under EXO_HOME gets the same entries (written off the device thread).
    server.wait_for(lambda: len(list((server.home / "prefix-cache").rglob("*.safetensors"))) > 3)


def test_the_next_turn_restores_through_the_reply(make_server, model_dir, reference):
    # An agent's next turn resends the reply: kept when turn 1 ended (a reply of a block or more), so turn 2
    # prefills only what follows it, and replies as a cold engine does.
    server = make_server(model_dir, env={"EXO_PREFIX_CACHE_BLOCK_TOKENS": "16"})
    client = server.openai()
    first = client.chat.completions.create(model=server.model, messages=TURN1, temperature=0, max_tokens=40)
    reply = first.choices[0].message.content
    turn2 = TURN1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Tool result: no such file"}]
    p1, p2 = _ids(reference, TURN1), _ids(reference, turn2)
    generated = first.usage.completion_tokens
    assert generated > 16 and p2[: len(p1) + generated - 1] == p1 + reference.tokenizer.encode(reply)[: generated - 1]
    second = client.chat.completions.create(model=server.model, messages=turn2, temperature=0, max_tokens=12)
    assert second.usage.prompt_tokens_details.cached_tokens >= len(p1) + generated - 1
    assert second.choices[0].message.content == reference(p2, max_tokens=12).text


def test_cache_off_reports_zero(make_server, model_dir):
    server = make_server(model_dir, env={"EXO_PREFIX_CACHE_ENABLED": "0"})
    client = server.openai()
    for _ in range(2):
        response = client.chat.completions.create(model=server.model, messages=TURN1, temperature=0, max_tokens=4)
        assert response.usage.prompt_tokens_details.cached_tokens == 0
    assert server.metric("exo_prefix_cache_lookups_total", model=server.model) == 0


def test_prompt_cache_key_is_never_an_error_and_groups_the_entries(make_server, model_dir):
    # Codex sends one on Responses and chat completions; any value is a hint, never a 400. It reaches the
    # prefix cache: the summary the runner reports lists it (the router's key affinity), and the RAM tier
    # keeps its entries in one group.
    from exo.engine import prefix_cache as pc

    server = make_server(model_dir, env={"EXO_PREFIX_CACHE_BLOCK_TOKENS": "16"})
    client = server.openai()
    keys = ["session-1", "k" * 5000, 42, {"conversation": 7}, "", None]
    for key in keys:
        extra = {"prompt_cache_key": key}
        chat = client.chat.completions.create(model=server.model, messages=TURN1, max_tokens=2, extra_body=extra)
        assert chat.choices[0].finish_reason == "length"
        text = client.completions.create(model=server.model, prompt="def f(x):", max_tokens=2, extra_body=extra)
        assert text.choices[0].finish_reason == "length"
        answer = client.responses.create(model=server.model, input="Hi", max_output_tokens=2, extra_body=extra)
        assert answer.status in ("completed", "incomplete")
    engine = server.service._engines[server.model]
    summary = engine.prefix_cache.summary()
    assert set(summary.keys) == {pc.key_hash(k) for k in ("session-1", "k" * 5000, "42", '{"conversation": 7}')}
    ram = engine.prefix_cache.store.ram
    groups = {ram.group_of(key) for key in ram.keys()}
    assert f"{pc.key_hash('session-1'):016x}" in groups
