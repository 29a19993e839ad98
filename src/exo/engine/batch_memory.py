"""What a batch of runs may hold in memory, and whether it fits an instance's KV budget.

A batch's attention KV is left-padded to its longest row, so n runs hold about n x the longest horizon
(prompt + max_tokens) of KV rows, plus each run's GatedDeltaNet state (fixed per sequence). ``batch_bytes``
is that estimate, ``sequence_bytes`` measures its two rates on the model itself; the device queue admits a
run into a batch only while the estimate stays within the instance's KV budget (``batch_fits``) and the room
set aside for a full batch's recurrent states (``state_room``: ``max_batch`` of them where the node has
them free at load; none otherwise, and the states count against the KV budget).

Why the room: a Qwen3.5-9B sequence's GatedDeltaNet states are ~50 MB (24 layers of 32 x 128 x 128 float32),
as much as ~1,600 tokens of its attention KV, so within the default KV budget (32,768 tokens, 1 GiB at 9B) a
batch held at most 19 short chats: 32 clients on an H200 queued for seconds with 100+ GB free (issue 51).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .generate import Engine


def stage_bytes(engine: Engine) -> list[tuple[int, int]]:
    """Per stage of ``engine``'s model (one on a single node; a pipeline's leader last): (bytes of attention
    KV per token, bytes of recurrent state per sequence), each measured where its layers are, once (on the
    device thread), and kept on the engine."""
    measured = getattr(engine, "_stage_bytes", None)
    if measured is None:
        measured = engine._stage_bytes = engine.forward.memory_rates()  # type: ignore[attr-defined]
    return measured


def sequence_bytes(engine: Engine) -> tuple[int, int]:
    """(bytes of attention KV per token, bytes of recurrent state per sequence) of the layers in this process
    (the whole model on a single node; a pipeline's leader: its stage's)."""
    return stage_bytes(engine)[-1]


def batch_bytes(horizons: list[int], per_token: int, per_sequence: int) -> int:
    """The memory a batch of runs with these horizons (prompt + max_tokens each) may reach: every row
    padded to the longest, plus each run's recurrent state."""
    if not horizons:
        return 0
    return len(horizons) * (max(horizons) * per_token + per_sequence)


def batch_fits(engine: Engine, horizons: list[int], budget_tokens: int) -> bool:
    """Whether runs with these horizons may decode together within ``budget_tokens`` tokens of the model's
    KV on every stage (each stage's memory holds its own layers' KV budget, as placement reserved it; a lone
    run always may: its own context limit bounds it), their recurrent states within ``engine.state_room``
    (``state_room``; beyond it, they count against the KV budget)."""
    if len(horizons) < 2:
        return True
    rates = stage_bytes(engine)
    for stage, (per_token, per_sequence) in enumerate(rates):
        # A stage without attention layers holds only the fixed states, which max_batch bounds. The engine's room
        # is its own stage's (the last); a pipeline's other stages report no state bytes where their node set
        # room aside (``serve_stage``'s ``states_room``).
        room = engine.state_room if stage == len(rates) - 1 else 0
        over = max(0, len(horizons) * per_sequence - room)  # the states that have no room of their own take KV budget
        if per_token and batch_bytes(horizons, per_token, 0) + over > budget_tokens * per_token:
            return False
    return True


def state_room(per_sequence: int, max_batch: int, free_bytes: int) -> int:
    """The bytes to set aside for the recurrent states of a batch of ``max_batch`` sequences of ``per_sequence``
    bytes each: all of them where ``free_bytes`` (what the node has free now, its weights loaded, less what the
    instance will still take: the KV budget and the activation margin; the runner reads it as placement does)
    holds them; else 0 (and ``batch_fits`` counts the states against the KV budget)."""
    want = max_batch * per_sequence
    return want if max_batch > 1 and want and free_bytes >= want else 0
