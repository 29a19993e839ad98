"""The step header between pipeline stages: named fields in a fixed int32 message, a version and a step
number that every stage checks, so stages that disagree stop with ``StepHeaderError`` instead of computing
on the wrong input (a wrong token)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from exo.engine import load_checkpoint
from exo.engine.forward import MOE_MODES
from exo.engine.pipeline import (
    DROP,
    FILTER,
    HEADER_LEN,
    HEADER_NAMES,
    HEADER_VERSION,
    JOIN,
    OP_END,
    OP_SHUTDOWN,
    ROLLBACK,
    STORE_END,
    Op,
    StageSpec,
    StepHeader,
    StepHeaderError,
    serve_stage,
)
from exo.engine.verify import VerifyMode
from tests.fixtures.memory import kept_buffer

HEADERS = [
    StepHeader.forward(0, 0, 1, 200, None),  # a prefill chunk: its ids follow the header
    StepHeader.forward(1, 0, 1, 1, None, tokens=(42,)),
    StepHeader.forward(7, 3, 1, 3, VerifyMode("batched", per_row_attention=True), (Op(ROLLBACK, 3, (4, 2)),), (1, 2, 3)),
    StepHeader.forward(2**31 - 1, 5, 1, 8, VerifyMode("safe"), (Op(ROLLBACK, 5, (8, 0)),), tuple(range(100, 108))),
    # A batch of 4 at K = 2 after a round and a member leaving: every record and the 12 ids inline.
    StepHeader.forward(9, 2, 3, 3, VerifyMode("route_locked"),
                       (Op(ROLLBACK, 2, (3, 1, 3, 0, 2)), Op(FILTER, 2, (0, 1, 3)), Op(JOIN, 2, (6,))),
                       tuple(range(9)), invariant=True),
    # 64 members: too many ids for the header, they follow it.
    StepHeader.forward(10, 2, 64, 1, None, (Op(DROP, 4),)),
    StepHeader(OP_END, 12, slot=7, ops=(Op(ROLLBACK, 7, (2, 1)),)),
    StepHeader(OP_SHUTDOWN, 13),
]


@pytest.mark.parametrize("header", HEADERS, ids=lambda h: f"op{h.op}-{h.batch}x{h.rows}-ops{len(h.ops)}")
def test_a_header_survives_the_wire(header):
    message = header.encode()
    assert message.dtype == mx.int32 and message.shape == (HEADER_LEN,) and header.ops_message() is None
    assert StepHeader.decode(message.tolist()) == header
    if header.tokens:  # the leader's path: the ids as a (lazy) array, not read back to the host
        inline = header.encode(mx.array([list(header.tokens)], dtype=mx.uint32))
        assert inline.tolist() == message.tolist()


def test_op_records_that_do_not_fit_follow_the_header():
    """A rollback of a batch of 60 (60 kept counts) does not fit in the header: its records follow it, and the
    step's ids (which fit alone) follow too, to the first stage."""
    ops = (Op(ROLLBACK, 1, (3, *[i % 4 for i in range(60)])), Op(FILTER, 1, tuple(range(59))))
    header = StepHeader.forward(4, 1, 59, 1, None, ops, ())
    assert not header.ops_inline and not header.tokens_inline
    message, records = header.encode(), header.ops_message()
    assert records is not None and records.shape == (header.ops_length,) == (3 + 61 + 3 + 59,)
    assert StepHeader.ops_length_of(message.tolist()) == header.ops_length
    assert StepHeader.decode(message.tolist(), records.tolist()) == header
    with pytest.raises(StepHeaderError, match="followed it"):
        StepHeader.decode(message.tolist())
    with pytest.raises(StepHeaderError, match="followed it"):
        StepHeader.decode(message.tolist(), records.tolist()[:-1])


def test_every_moe_mode_round_trips():
    for mode in MOE_MODES:
        header = StepHeader.forward(3, 0, 1, 2, VerifyMode(mode), (), (5, 6))
        decoded = StepHeader.decode(header.encode().tolist())
        assert decoded.verify_mode == VerifyMode(mode) and not decoded.ops


def _fields(**changes) -> list[int]:
    values = StepHeader.forward(0, 0, 1, 2, None, (), (5, 6)).encode().tolist()
    for name, value in changes.items():
        values[HEADER_NAMES.index(name)] = value
    return values


@pytest.mark.parametrize("changes, match", [
    ({"version": HEADER_VERSION + 1}, "version"),
    ({"version": 0}, "version"),
    ({"op": 9}, "unknown step op"),
    ({"rows": 0}, "malformed"),
    ({"batch": 0}, "malformed"),
    ({"slot": -1}, "malformed"),
    ({"verify": 1}, "malformed"),  # a verify step without its MoE mode
    ({"moe": len(MOE_MODES) + 1, "verify": 1}, "malformed"),
    ({"invariant": 2}, "malformed"),
    ({"ops": 2}, "malformed op record|truncated"),  # the ids read as records
])
def test_a_header_this_stage_cannot_act_on_is_a_typed_error(changes, match):
    with pytest.raises(StepHeaderError, match=match):
        StepHeader.decode(_fields(**changes))
    with pytest.raises(StepHeaderError, match="int32"):
        StepHeader.decode(_fields()[:-1])


@pytest.mark.parametrize("record", [
    [9, 0, 0],  # an unknown code
    [ROLLBACK, 0, 1, 3],  # a rollback without kept counts
    [ROLLBACK, 0, 3, 2, 1, 3],  # a sequence keeping more rows than the call had
    [JOIN, 0, 1, 0],  # a slot joining itself
    [JOIN, 0, 0],
    [FILTER, 0, 0],  # a filter keeping nothing (the batch ends with DROP / END)
    [FILTER, 0, 2, 1, 1],  # a row kept twice
    [DROP, 0, 1, 5],
    [ROLLBACK, 0, 5, 1],  # truncated
    [STORE_END, 0, 1, -1],  # a stored reply of no tokens
    [STORE_END, 0, 2, -2, 7],  # a row below -1 (a one-sequence slot)
    [STORE_END, 0, 2, 0, -7],  # a negative token id
])
def test_an_op_record_this_stage_cannot_act_on_is_a_typed_error(record):
    with pytest.raises(StepHeaderError, match="op record"):
        Op.parse(record)


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
    (StepHeader.forward(2, 0, 1, 1, None, tokens=(9,)), "step 2 arrived, expected step 1"),  # step 1 was lost
    (StepHeader.forward(0, 0, 1, 1, None, tokens=(9,)), "step 0 arrived, expected step 1"),  # step 0 again
    (StepHeader.forward(1, 0, 1, 1, None, tokens=(9,)).encode().tolist(), "version"),
    (StepHeader.forward(1, 0, 2, 1, None, tokens=(9, 9)), "2 sequences on slot 0 of 1"),  # slot 0 is no batch
    (StepHeader.forward(1, 1, 1, 1, None, (Op(ROLLBACK, 1, (2, 1)),), (9,)), "does not hold"),  # nothing on slot 1
    (StepHeader.forward(1, 0, 1, 1, None, (Op(ROLLBACK, 0, (2, 1, 1)),), (9,)), "2 sequences on slot 0 of 1"),
    (StepHeader.forward(1, 0, 1, 1, None, (Op(FILTER, 0, (0,)),), (9,)), "not a batch"),
    (StepHeader.forward(1, 3, 1, 1, None, (Op(JOIN, 3, (2,)),), (9,)), "does not hold"),
    (StepHeader.forward(1, 0, 1, 1, None, (Op(STORE_END, 0, (0, 9)),), (9,)), "not a batch"),  # a row of no batch
    (StepHeader.forward(1, 1, 1, 1, None, (Op(STORE_END, 1, (-1, 9)),), (9,)), "does not hold"),
])
def test_a_stage_fed_a_skipped_step_another_version_or_a_slot_it_lacks_stops_before_computing(checkpoint, bad, match):
    loaded = load_checkpoint(checkpoint("qwen3_5", dtype="float32"), layers=(0, 2))
    if isinstance(bad, list):
        bad[0] = HEADER_VERSION + 1
        message = mx.array(bad, dtype=mx.int32)
    else:
        message = bad.encode()
    link = _ScriptedLink([StepHeader.forward(0, 0, 1, 2, None, tokens=(5, 6)).encode(), message])
    with pytest.raises(StepHeaderError, match=match):
        serve_stage(loaded.model, StageSpec(0, 2, 0, 2), link)
    assert link.sent == [(1, 2, loaded.model.hidden_size)]  # step 0's hiddens; nothing for the bad step


def test_a_stage_follows_the_steps_in_order_through_end_and_shutdown(checkpoint):
    loaded = load_checkpoint(checkpoint("qwen3_5", dtype="float32"), layers=(0, 2))
    link = _ScriptedLink([
        StepHeader.forward(0, 0, 1, 2, None, tokens=(5, 6)).encode(),
        StepHeader.forward(1, 0, 1, 1, None, tokens=(7,)).encode(),
        StepHeader(OP_END, 2, slot=0).encode(),
        StepHeader.forward(3, 1, 1, 1, None, tokens=(5,)).encode(),
        StepHeader(OP_SHUTDOWN, 4).encode(),
    ])
    serve_stage(loaded.model, StageSpec(0, 2, 0, 2), link)
    h = loaded.model.hidden_size
    assert link.sent == [(1, 2, h), (1, 1, h), (1, 1, h)] and not link.messages


def test_a_stage_keeps_room_in_its_bounded_buffer_cache(checkpoint, bounded_cache):
    """A member's loop keeps room in MLX's bounded cache as the leader's device loop does (``keep_cache_room``): a
    large buffer left there (a prompt step's, the load's warm-up's) is gone once the stage has served its steps."""
    loaded = load_checkpoint(checkpoint("qwen3_5", dtype="float32"), layers=(0, 2))
    kept_buffer(6 << 20)
    assert mx.get_cache_memory() >= 6 << 20
    link = _ScriptedLink([StepHeader.forward(0, 0, 1, 2, None, tokens=(5, 6)).encode(),
                          StepHeader.forward(1, 0, 1, 1, None, tokens=(7,)).encode(), StepHeader(OP_SHUTDOWN, 2).encode()])
    serve_stage(loaded.model, StageSpec(0, 2, 0, 2), link)
    assert mx.get_cache_memory() < 4 << 20


def test_a_stage_mirrors_the_leaders_batch_operations_on_its_own_caches(checkpoint):
    """Two sequences prefill on slots of their own, join batch slot 2, step together, roll back per sequence
    after a verify call, the first leaves (a filter) and the batch ends: the stage's hiddens for the batch
    equal those of its one-node twin doing the same operations directly (``LocalForward``), and a slot that
    ended holds nothing."""
    from exo.engine.forward import LocalForward

    loaded = load_checkpoint(checkpoint("qwen3_5", dtype="float32"), layers=(0, 2))
    twin = LocalForward(load_checkpoint(checkpoint("qwen3_5", dtype="float32"), layers=(0, 2)).model)
    h = loaded.model.hidden_size
    a, b = [5, 6, 7], [8, 9]
    messages = [
        StepHeader.forward(0, 0, 1, 3, None, tokens=tuple(a)).encode(),
        StepHeader.forward(1, 1, 1, 2, None, tokens=tuple(b)).encode(),
        StepHeader.forward(2, 2, 2, 1, None, (Op(JOIN, 2, (0,)), Op(JOIN, 2, (1,))), (10, 11)).encode(),
        StepHeader.forward(3, 2, 2, 3, VerifyMode("route_locked"), (), (12, 13, 14, 15, 16, 17)).encode(),
        StepHeader.forward(4, 2, 1, 1, None, (Op(ROLLBACK, 2, (3, 1, 3)), Op(FILTER, 2, (1,))), (18,)).encode(),
        StepHeader(OP_END, 5, slot=2).encode(),
        StepHeader(OP_SHUTDOWN, 6).encode(),
    ]
    sent: list[mx.array] = []

    class Recording(_ScriptedLink):
        def send(self, x, dst: int) -> None:
            super().send(x, dst)
            sent.append(x)

    serve_stage(loaded.model, StageSpec(0, 2, 0, 2), Recording(messages))
    ca, cb = twin.new_cache(), twin.new_cache()
    twin_out = [twin.hidden(mx.array([a], dtype=mx.uint32), ca), twin.hidden(mx.array([b], dtype=mx.uint32), cb)]
    batch = twin.join(twin.join(None, ca), cb)
    twin_out.append(twin.hidden(mx.array([[10], [11]], dtype=mx.uint32), batch))
    twin_out.append(twin.hidden(mx.array([[12, 13, 14], [15, 16, 17]], dtype=mx.uint32), batch, verify=True))
    twin.rollback_per_sequence(batch, 3, [1, 3])
    twin.filter(batch, [1])
    twin_out.append(twin.hidden(mx.array([[18]], dtype=mx.uint32), batch))
    assert [tuple(x.shape) for x in sent] == [(1, 3, h), (1, 2, h), (2, 1, h), (2, 3, h), (1, 1, h)]
    for got, want in zip(sent, twin_out, strict=True):
        assert mx.array_equal(got, want).item()


def _member(kind: str, checkpoint):
    """A member that does not lead, in this process: a pipeline's first stage (layers 0-1), or member 0 of a tensor
    group of 2 (its slice of every layer; alone here, its collectives sum its own part)."""
    from exo.engine.pipeline import OP_FORWARD, OP_GRAPH_FORWARD
    from exo.engine.sharding import TensorShare
    from exo.engine.tensor import serve_tensor

    path = checkpoint("qwen3_5", dtype="float32")
    if kind == "pipeline":
        model = load_checkpoint(path, layers=(0, 2)).model
        return model, StageSpec(0, 2, 0, 2), serve_stage, OP_FORWARD, OP_GRAPH_FORWARD
    model = load_checkpoint(path, tensor=TensorShare(None, 0, 2)).model
    return model, StageSpec(0, 2, 0, model.num_layers), serve_tensor, OP_GRAPH_FORWARD, OP_FORWARD


def _step(op: int, step: int, slot: int, rows: int, verify=None, ops=(), batch: int = 1) -> mx.array:
    """A forward step's header: a pipeline's carries its ids (the first stage's input), a tensor group's does not
    (its members take them in a collective)."""
    from exo.engine.pipeline import OP_FORWARD

    tokens = tuple(range(5, 5 + batch * rows)) if op == OP_FORWARD else ()
    return StepHeader.forward(step, slot, batch, rows, verify, ops, tokens, op=op).encode()


class _Replies(_ScriptedLink):
    """A scripted link that also keeps the int32 messages the member sends (its replies), as lists."""

    def __init__(self, messages: list[mx.array]) -> None:
        super().__init__(messages)
        self.replies: list[list[int]] = []

    def send(self, x, dst: int) -> None:
        super().send(x, dst)
        if x.dtype == mx.int32:
            self.replies.append(x.tolist())


def test_a_tensor_member_and_a_pipeline_stage_act_alike_on_every_header_op(checkpoint):
    """Both kinds of member run one loop (``pipeline.serve_member``): every op of the header, and every op record,
    is handled by both alike, and each refuses the other kind's forward step. The script covers ``HEADER_OPS``
    whole: an op added to the header is added here, for both."""
    from exo.engine.forward import cache_rates
    from exo.engine.pipeline import (
        HEADER_OPS,
        OP_MEASURE,
        OP_PREFIX_BEGIN,
        OP_PREFIX_LOOKUP,
        StageSlots,
        _pack_rates,
    )
    from exo.engine.sharding import collectives

    lookup = [2, 5, 6, 1, 2]  # [n, tokens(n), m, candidates(m)]
    begin = [1, 2, 0, 0, 0, 0, 0, 0]  # [ok, position, has_group, group(4), e]
    replies: dict[str, list[list[int]]] = {}
    held: dict[str, set[int]] = {}
    for kind in ("pipeline", "tensor"):
        model, member, serve, forward_op, other_op = _member(kind, checkpoint)

        script = [
            _step(forward_op, 0, 0, 2),
            _step(forward_op, 1, 0, 3, VerifyMode("route_locked")),
            StepHeader(OP_MEASURE, 2, ops=(Op(ROLLBACK, 0, (3, 1)),)).encode(),
            StepHeader(OP_PREFIX_LOOKUP, 3, 1, 1, len(lookup)).encode(), mx.array(lookup, dtype=mx.int32),
            StepHeader(OP_PREFIX_BEGIN, 4, 1, 1, len(begin)).encode(), mx.array(begin, dtype=mx.int32),
            _step(forward_op, 5, 1, 1),
            _step(forward_op, 6, 2, 1, ops=(Op(JOIN, 2, (0,)), Op(JOIN, 2, (1,))), batch=2),
            StepHeader(OP_END, 7, 3, ops=(Op(STORE_END, 2, (1, 9)), Op(FILTER, 2, (0,)), Op(DROP, 2))).encode(),
            StepHeader(OP_SHUTDOWN, 8).encode(),
        ]
        ops = {StepHeader.decode(m.tolist()).op for m in script if m.shape == (HEADER_LEN,)}
        assert ops | {other_op} == set(HEADER_OPS)  # every op: this kind's (and the other kind's forward, below)
        link, slots = _Replies(script), StageSlots(model, 0)
        serve(model, member, link, slots=slots)  # returns at the SHUTDOWN
        assert not link.messages
        with collectives(model):  # (what a member measures on: a tensor member's slice with its collectives)
            assert link.replies[0] == _pack_rates(cache_rates(model))
        replies[kind], held[kind] = link.replies[1:], set(slots.caches)

        with pytest.raises(StepHeaderError, match="is not a"):
            serve(model, member, _ScriptedLink([_step(other_op, 0, 0, 1)]))
    assert replies["pipeline"] == replies["tensor"] == [[2, 5, 6, 1, -1], [0, *begin[1:]]]
    assert held["pipeline"] == held["tensor"] == set()


# -- the graph wire (WIRE_GRAPH): a step's input and output as ops of the stage's graph -------------------------


def test_a_graph_wire_header_carries_no_ids_and_round_trips():
    from exo.engine.pipeline import OP_FORWARD, WIRE_GRAPH

    header = StepHeader.forward(3, 1, 2, 1, None, (Op(ROLLBACK, 1, (2, 1, 0)),), wire=WIRE_GRAPH)
    assert not header.tokens_inline  # one row: it would fit, but its ids are still being computed: an op sends them
    assert StepHeader.decode(header.encode().tolist()) == header
    with pytest.raises(ValueError, match="follow it"):
        StepHeader.forward(3, 1, 1, 1, None, tokens=(5,), wire=WIRE_GRAPH).encode()
    for changes in ({"wire": 3}, {"wire": WIRE_GRAPH, "op": OP_END}, {"wire": 2, "op": OP_END}):
        values = header.encode().tolist()
        for name, value in changes.items():
            values[HEADER_NAMES.index(name)] = value
        with pytest.raises(StepHeaderError, match="malformed"):
            StepHeader.decode(values)
    assert header.op == OP_FORWARD


def test_which_wire_a_leader_chooses():
    from exo.engine.pipeline import WIRE_COLLECTIVE, WIRE_GRAPH, WIRE_HOST, pipeline_wire

    class Ops:
        graph_ops, collective_ops = True, False

    class NoOps:
        graph_ops = False

    class Pair:  # a ring group of two: both kinds of ops, its all-sums on a CPU stream
        graph_ops, collective_ops, device_collectives = True, True, False

    class Nccl:  # an NCCL group of two: all-sums on the device, no send and receive
        graph_ops, collective_ops, device_collectives = False, True, True

    assert pipeline_wire(Ops(), "graph") == WIRE_GRAPH and pipeline_wire(Ops(), "host") == WIRE_HOST
    assert pipeline_wire(NoOps(), "graph") == pipeline_wire(object(), "graph") == WIRE_HOST  # (a tensor group's, a test's link)
    assert pipeline_wire(Ops(), "auto", cuda=True) == WIRE_GRAPH and pipeline_wire(Ops(), "auto", cuda=False) == WIRE_HOST
    assert pipeline_wire(NoOps(), "auto", cuda=True) == WIRE_HOST and pipeline_wire(Ops(), "host", cuda=True) == WIRE_HOST
    assert pipeline_wire(Ops(), "auto") == WIRE_HOST  # this CPU: the host wire
    # The collective wire: where asked and the link has it; auto takes it only where the all-sums run on the device
    assert pipeline_wire(Pair(), "collective") == WIRE_COLLECTIVE and pipeline_wire(Ops(), "collective") == WIRE_GRAPH
    assert pipeline_wire(NoOps(), "collective") == WIRE_HOST and pipeline_wire(Nccl(), "graph") == WIRE_HOST
    assert pipeline_wire(Nccl(), "auto", cuda=True) == WIRE_COLLECTIVE and pipeline_wire(Pair(), "auto", cuda=True) == WIRE_GRAPH
    assert pipeline_wire(Nccl(), "auto", cuda=False) == WIRE_HOST and pipeline_wire(Nccl(), "host", cuda=True) == WIRE_HOST
    with pytest.raises(ValueError, match="EXO_PIPELINE_WIRE"):
        pipeline_wire(Ops(), "fast")


class _GraphLink(_ScriptedLink):
    """A scripted link with graph ops: a receive is the next message, still lazy; a send returns its op (here the
    array itself) and records it."""

    graph_ops = True

    def __init__(self, messages: list[mx.array], inputs: list[mx.array]) -> None:
        super().__init__(messages)
        self.inputs = list(inputs)
        self.graph_sent: list[mx.array] = []

    def recv_op(self, shape, dtype, src: int):
        x = self.inputs.pop(0)
        assert tuple(x.shape) == tuple(shape) and x.dtype == dtype
        return x * 1  # lazy, as a receive is

    def send_op(self, x, dst: int):
        self.graph_sent.append(x)
        return x


def test_a_stage_on_the_graph_wire_computes_what_it_would_on_the_host_wire(checkpoint):
    """The same steps (a prompt, a decode step, a verify call and its rollback) as graph-wire headers: the stage
    takes its ids from the link's receive op, hands its hiddens to its send op, never sends them as host messages,
    and they are the host wire's bits; a link without graph ops refuses the header (``StepHeaderError``)."""
    from exo.engine.pipeline import WIRE_GRAPH, WIRE_HOST

    outputs = {}
    for wire in (WIRE_HOST, WIRE_GRAPH):
        loaded = load_checkpoint(checkpoint("qwen3_5", dtype="float32"), layers=(0, 2))
        h = loaded.model.hidden_size
        steps = [((5, 6, 7), None, ()), ((8,), None, ()), ((9, 10, 11), VerifyMode("route_locked"), ()),
                 ((12,), None, (Op(ROLLBACK, 0, (3, 1)),))]
        graph = wire == WIRE_GRAPH
        messages = [StepHeader.forward(i, 0, 1, len(ids), verify, ops, () if graph else ids, wire=wire).encode()
                    for i, (ids, verify, ops) in enumerate(steps)] + [StepHeader(OP_SHUTDOWN, len(steps)).encode()]
        inputs = [mx.array(list(ids), dtype=mx.uint32) for ids, _, _ in steps]
        link = _GraphLink(messages, inputs)
        sent: list[mx.array] = []
        if not graph:
            original = link.send

            def send(x, dst, original=original, sent=sent):
                original(x, dst)
                sent.append(x)

            link.send = send
        serve_stage(loaded.model, StageSpec(0, 2, 0, 2), link)
        outputs[wire] = link.graph_sent if graph else sent
        assert not link.inputs if graph else len(link.inputs) == len(steps)
        assert link.sent == ([] if graph else [(1, len(ids), h) for ids, _, _ in steps])
    assert len(outputs[WIRE_GRAPH]) == 4
    for a, b in zip(outputs[WIRE_HOST], outputs[WIRE_GRAPH], strict=True):
        assert mx.array_equal(a, b).item()
    loaded = load_checkpoint(checkpoint("qwen3_5", dtype="float32"), layers=(0, 2))
    link = _ScriptedLink([StepHeader.forward(0, 0, 1, 1, None, wire=WIRE_GRAPH).encode()])
    with pytest.raises(StepHeaderError, match="graph wire"):
        serve_stage(loaded.model, StageSpec(0, 2, 0, 2), link)


def test_the_leader_starts_a_dropped_steps_receive_before_its_next_exchange(checkpoint, monkeypatch):
    """On the graph wire the leader's receive runs with the step built on it. A step the loop builds and never
    evaluates (past a finished sequence) would leave its receive unstarted while the stage before sent its
    hiddens: the next exchange first starts it (``_settle``), so the link's transfers keep both ends' order."""
    from exo.engine import pipeline
    from exo.engine.pipeline import WIRE_GRAPH, PipelineForward

    loaded = load_checkpoint(checkpoint("qwen3_5", dtype="float32"), layers=(2, 4))
    h = loaded.model.hidden_size
    events: list[tuple[str, object]] = []
    receives: list[mx.array] = []

    class Leader(_GraphLink):
        def send(self, x, dst: int) -> None:
            header = StepHeader.decode(x.tolist())
            assert header.wire == WIRE_GRAPH and not header.tokens
            events.append(("send", header.step))

        def recv_op(self, shape, dtype, src: int):
            receives.append(mx.zeros(shape, dtype=dtype) + len(receives))
            return receives[-1]

    started = pipeline.mx.async_eval

    def async_eval(*arrays):
        events.append(("started", [next((i for i, r in enumerate(receives) if a is r), None) for a in arrays]))
        return started(*arrays)

    monkeypatch.setattr(pipeline.mx, "async_eval", async_eval)
    monkeypatch.setenv("EXO_PIPELINE_WIRE", "graph")
    forward = PipelineForward(loaded.model, StageSpec(1, 2, 2, 4), Leader([], []))
    assert forward.graph
    cache = forward.new_cache()
    forward.hidden(mx.array([[5]], dtype=mx.uint32), cache)  # built and dropped: never evaluated
    assert ("started", [0]) not in events  # (its receive is left to the step's evaluation)
    forward.hidden(mx.array([[6]], dtype=mx.uint32), cache)
    second_header = events.index(("send", 1))
    assert ("started", [0]) in events[:second_header]  # the dropped step's receive, before the next header
    assert len(receives) == 2 and receives[0].shape == (1, 1, h)


def test_a_graph_wire_stage_times_its_steps_where_asked(checkpoint):
    """EXO_PIPELINE_PHASES=1 (the link's ``timed_receives``): a stage on the graph wire notes, per forward step, the
    time from the header to its step launched (graph.build) and, from its second step, the wait for the header
    (graph.wait); untimed, nothing is noted."""
    from exo.engine.pipeline import WIRE_GRAPH

    for timed in (True, False):
        loaded = load_checkpoint(checkpoint("qwen3_5", dtype="float32"), layers=(0, 2))
        steps = [(5, 6, 7), (8,), (9,)]
        messages = [StepHeader.forward(i, 0, 1, len(ids), None, wire=WIRE_GRAPH).encode() for i, ids in enumerate(steps)]
        link = _GraphLink([*messages, StepHeader(OP_SHUTDOWN, len(steps)).encode()],
                          [mx.array(list(ids), dtype=mx.uint32) for ids in steps])
        notes: list[tuple[str, float]] = []
        link.timed_receives = timed
        link.note = lambda phase, seconds, notes=notes: notes.append((phase, seconds))
        serve_stage(loaded.model, StageSpec(0, 2, 0, 2), link)
        if timed:
            assert [p for p, _ in notes] == ["graph.build", "graph.wait", "graph.build", "graph.wait", "graph.build"]
            assert all(seconds >= 0 for _, seconds in notes)
        else:
            assert notes == []
