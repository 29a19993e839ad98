"""The step header between pipeline stages: named fields in a fixed int32 message, a version and a step
number that every stage checks, so stages that disagree stop with ``StepHeaderError`` instead of computing
on the wrong input (a wrong token)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from exo.engine import load_checkpoint
from exo.engine.forward import MOE_MODES
from exo.engine.pipeline import (
    HEADER_LEN,
    HEADER_VERSION,
    NO_ROLLBACK,
    OP_END,
    OP_SHUTDOWN,
    StageSpec,
    StepHeader,
    StepHeaderError,
    serve_stage,
)
from exo.engine.verify import VerifyMode

HEADERS = [
    StepHeader.forward(0, 20, None, None),  # a prefill chunk: its ids follow the header
    StepHeader.forward(1, 1, None, None, (42,)),
    StepHeader.forward(7, 3, VerifyMode("batched", per_row_attention=True), (4, 2), (1, 2, 3)),
    StepHeader.forward(2**31 - 1, 8, VerifyMode("safe"), (8, 0), tuple(range(100, 108))),
    StepHeader(OP_END, 12),
    StepHeader(OP_SHUTDOWN, 13),
]


@pytest.mark.parametrize("header", HEADERS, ids=lambda h: f"op{h.op}-rows{h.rows}")
def test_a_header_survives_the_wire(header):
    message = header.encode()
    assert message.dtype == mx.int32 and message.shape == (HEADER_LEN,)
    assert StepHeader.decode(message.tolist()) == header
    if header.tokens:  # the leader's path: the ids as a (lazy) array, not read back to the host
        inline = header.encode(mx.array([list(header.tokens)], dtype=mx.uint32))
        assert inline.tolist() == message.tolist()


def test_every_moe_mode_round_trips():
    for mode in MOE_MODES:
        header = StepHeader.forward(3, 2, VerifyMode(mode), None, (5, 6))
        decoded = StepHeader.decode(header.encode().tolist())
        assert decoded.verify_mode == VerifyMode(mode) and decoded.keep_rows == NO_ROLLBACK


def _fields(**changes) -> list[int]:
    values = StepHeader.forward(0, 2, None, None, (5, 6)).encode().tolist()
    names = ["version", "op", "step", "rows", "verify", "moe", "per_row", "keep_rows", "keep_kept"]
    for name, value in changes.items():
        values[names.index(name)] = value
    return values


@pytest.mark.parametrize("changes, match", [
    ({"version": HEADER_VERSION + 1}, "version"),
    ({"version": 0}, "version"),
    ({"op": 9}, "unknown step op"),
    ({"rows": 0}, "malformed"),
    ({"verify": 1}, "malformed"),  # a verify step without its MoE mode
    ({"moe": len(MOE_MODES) + 1, "verify": 1}, "malformed"),
    ({"keep_rows": 2, "keep_kept": 3}, "malformed"),
])
def test_a_header_this_stage_cannot_act_on_is_a_typed_error(changes, match):
    with pytest.raises(StepHeaderError, match=match):
        StepHeader.decode(_fields(**changes))
    with pytest.raises(StepHeaderError, match="int32"):
        StepHeader.decode(_fields()[:-1])


class _ScriptedLink:
    """The leader's side of a stage's link, scripted: the messages it will receive, in order; what it sends."""

    def __init__(self, messages: list[mx.array]) -> None:
        self.messages = list(messages)
        self.sent: list[tuple[int, ...]] = []

    def send(self, x, dst: int) -> None:
        mx.eval(x)
        self.sent.append(tuple(x.shape))

    def recv(self, shape, dtype, src: int):
        message = self.messages.pop(0)
        assert tuple(message.shape) == tuple(shape) and message.dtype == dtype
        return message


@pytest.mark.parametrize("bad, match", [
    (StepHeader.forward(2, 1, None, None, (9,)), "step 2 arrived, expected step 1"),  # step 1 was lost
    (StepHeader.forward(0, 1, None, None, (9,)), "step 0 arrived, expected step 1"),  # step 0 again
    (StepHeader.forward(1, 1, None, None, (9,)).encode().tolist(), "version"),
])
def test_a_stage_fed_a_skipped_step_or_another_version_stops_before_computing(checkpoint, bad, match):
    loaded = load_checkpoint(checkpoint("qwen3_5", dtype="float32"), layers=(0, 2))
    if isinstance(bad, list):
        bad[0] = HEADER_VERSION + 1
        message = mx.array(bad, dtype=mx.int32)
    else:
        message = bad.encode()
    link = _ScriptedLink([StepHeader.forward(0, 2, None, None, (5, 6)).encode(), message])
    with pytest.raises(StepHeaderError, match=match):
        serve_stage(loaded.model, StageSpec(0, 2, 0, 2), link)
    assert link.sent == [(1, 2, loaded.model.hidden_size)]  # step 0's hiddens; nothing for the bad step


def test_a_stage_follows_the_steps_in_order_through_end_and_shutdown(checkpoint):
    loaded = load_checkpoint(checkpoint("qwen3_5", dtype="float32"), layers=(0, 2))
    link = _ScriptedLink([
        StepHeader.forward(0, 2, None, None, (5, 6)).encode(),
        StepHeader.forward(1, 1, None, None, (7,)).encode(),
        StepHeader(OP_END, 2).encode(),
        StepHeader.forward(3, 1, None, None, (5,)).encode(),
        StepHeader(OP_SHUTDOWN, 4).encode(),
    ])
    serve_stage(loaded.model, StageSpec(0, 2, 0, 2), link)
    h = loaded.model.hidden_size
    assert link.sent == [(1, 2, h), (1, 1, h), (1, 1, h)] and not link.messages
