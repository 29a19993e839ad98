"""The in-process service paces a stream's tokens as ``EXO_STREAM_INTERVAL_S`` says (``api.local.Channel``, the rule
of ``runner.outbox.Pacing``): the handler's event loop is woken for a first token, a last chunk and anything not a
token at once, for other tokens once the interval is up."""

from __future__ import annotations

import asyncio
import time

from exo.api.local import Channel
from exo.engine.request import GenerationChunk


def _token(i: int) -> GenerationChunk:
    return GenerationChunk(str(i), [i], None, None, None)


def _end(i: int) -> GenerationChunk:
    return GenerationChunk(str(i), [i], "length", None, None)


def test_a_channel_holds_tokens_inside_the_interval_and_lets_a_last_chunk_through_at_once():
    async def main() -> None:
        loop = asyncio.get_running_loop()
        channel = Channel(loop, interval_s=5.0)
        deadline = loop.time() + 30
        channel.put(_token(1))  # the first token: at once
        assert await asyncio.wait_for(channel.get_batch(deadline), 2) == [_token(1)]
        channel.put(_token(2))
        channel.put(_token(3))
        getter = asyncio.ensure_future(channel.get_batch(deadline))
        await asyncio.sleep(0.2)
        assert not getter.done()  # inside the interval: held
        start = time.monotonic()
        await asyncio.to_thread(channel.put, _end(4))  # from another thread, as the device's
        assert await asyncio.wait_for(getter, 2.5) == [_token(2), _token(3), _end(4)]
        assert time.monotonic() - start < 2.5

    asyncio.run(main())


def test_held_tokens_go_at_the_interval_s_end_and_an_empty_channel_times_out():
    async def main() -> None:
        loop = asyncio.get_running_loop()
        channel = Channel(loop, interval_s=0.2)
        channel.put(_token(1))
        assert await channel.get_batch(loop.time() + 5) == [_token(1)]
        channel.put(_token(2))
        start = time.monotonic()
        assert await channel.get_batch(loop.time() + 5) == [_token(2)]  # no wake: the interval's end
        assert 0.05 < time.monotonic() - start < 3
        try:
            await channel.get_batch(loop.time() + 0.1)
        except TimeoutError:
            pass
        else:
            raise AssertionError("an empty channel past its deadline must time out")

    asyncio.run(main())


def test_the_service_streams_paced_as_its_settings_say(make_server, model_dir, reference):
    """``EXO_STREAM_INTERVAL_S`` reaches the in-process service's streams: the first token wakes the handler at once,
    the rest go with the end (a 24-token generation decodes well inside 1 s here; 24 batches without the
    interval), the tokens the engine's. The first batch holds the first token and whatever the device added before
    the handler's loop ran (a loaded machine: a few), never the whole generation (that would be the interval's
    end, not the first token's wake-up); ``Channel``'s own tests pin the first token alone."""
    from exo.engine.prompt import GenerateParams, Prompt

    server = make_server(model_dir, env={"EXO_STREAM_INTERVAL_S": "1.0", "EXO_NATIVE_MTP_ENABLED": "0"})
    prompt = reference.tokenizer.encode("Count to twenty.")

    async def main() -> list[list[int]]:
        params = GenerateParams(max_tokens=24, default_max_tokens=24, native_mtp="off")
        stream = server.service.generate(server.model, Prompt(token_ids=prompt), params, timeout_s=60,
                                         arrived=time.monotonic())
        await stream.start()
        batches = []
        while not stream.finished:
            batches.append([t for chunk in await stream.next_batch() for t in chunk.token_ids])
        return batches

    batches = asyncio.run(main())
    assert 2 <= len(batches) <= 3 and 1 <= len(batches[0]) < 12, batches
    assert [t for b in batches for t in b] == reference(prompt, max_tokens=24).token_ids
