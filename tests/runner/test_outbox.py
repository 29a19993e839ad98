"""A stream's outbox (runner/outbox.py): the device thread wakes the call's thread for a first token, a last chunk
and anything not a token at once, for other tokens only once the interval since the last take is up."""

from __future__ import annotations

import threading
import time

from exo.engine.request import GenerationChunk
from exo.runner.device import Failed, Started
from exo.runner.outbox import Outbox
from exo.runner.service import DONE


def _token(i: int) -> GenerationChunk:
    return GenerationChunk(str(i), [i], None, None, None)


def _end(i: int) -> GenerationChunk:
    return GenerationChunk(str(i), [i], "length", None, None)


def test_without_an_interval_every_token_wakes_the_call():
    box = Outbox(0.0)
    for i in range(3):
        box.put(_token(i))
    assert box.wakes == 3
    assert box.take(1.0) == [_token(0), _token(1), _token(2)]
    box.put(_token(3))
    assert box.take(1.0) == [_token(3)] and box.wakes == 4


def test_tokens_inside_the_interval_wait_and_go_together():
    box = Outbox(5.0)
    box.put(Started(3, 8, 0.0))
    assert box.wakes == 1 and box.take(1.0) == [Started(3, 8, 0.0)]
    box.put(_token(1))  # the first token: at once
    assert box.wakes == 2 and box.take(1.0) == [_token(1)]
    box.put(_token(2))
    box.put(_token(3))
    assert box.wakes == 2  # inside the interval: nobody woken
    taken: list = []
    reader = threading.Thread(target=lambda: taken.extend(box.take(30.0)))
    start = time.monotonic()
    reader.start()
    time.sleep(0.2)
    assert not taken  # the call waits for the interval's end
    box.put(_end(4))  # the last chunk goes at once, with the tokens before it
    reader.join(30.0)
    assert taken == [_token(2), _token(3), _end(4)]
    assert time.monotonic() - start < 2.5  # not the 5 s interval
    box.put(DONE)
    assert box.take(1.0) == [DONE]


def test_a_token_after_the_interval_wakes_the_call_and_a_lone_one_goes_at_the_interval():
    box = Outbox(0.05)
    box.put(_token(1))
    assert box.take(1.0) == [_token(1)]
    box.put(_token(2))  # inside the interval
    assert box.wakes == 1
    assert box.take(5.0) == [_token(2)]  # taken when the interval is up, without a wake
    time.sleep(0.1)
    box.put(_token(3))  # the interval is over: at once
    assert box.wakes == 2 and box.take(1.0) == [_token(3)]


def test_a_failure_goes_at_once_and_an_idle_stream_times_out_empty():
    box = Outbox(5.0)
    box.put(_token(1))
    box.take(1.0)
    box.put(_token(2))
    box.put(Failed(RuntimeError("x")))
    items = box.take(1.0)
    assert items[0] == _token(2) and isinstance(items[1], Failed)
    start = time.monotonic()
    assert box.take(0.1) == []  # nothing came: a heartbeat's turn
    assert time.monotonic() - start >= 0.1
