"""placement(): which node runs a model, or why none can. Table-driven over hand-built rows and real cards."""

from __future__ import annotations

import dataclasses
import re

import pytest

from exo.cards import load_catalog
from exo.cluster.placement import (
    ACTIVATION_MARGIN_BYTES,
    CONTEXT_BUDGET_TOKENS,
    AlreadyPlacedError,
    ExistingInstance,
    InvalidPlacementRequest,
    ModelNotOnDiskError,
    ModelRequirement,
    NodeCapacity,
    NoDiskRoomError,
    NoPlacementError,
    ShardAssignment,
    TooFewNodesError,
    UnknownNodeError,
    gib,
    placement,
)

GiB = 1 << 30
MiB = 1 << 20


@pytest.fixture(scope="module")
def catalog(tmp_path_factory):
    # An empty home: only the bundled cards, whatever the machine's $EXO_HOME holds.
    return load_catalog(home=tmp_path_factory.mktemp("home"))


def req(
    model_id: str = "m", weights_gib: float = 4, kv_per_token: int = 0, context: int = 0, layers: int = 8
):
    return ModelRequirement(model_id, int(weights_gib * GiB), kv_per_token, context, n_layers=layers)


def node(node_id: str, free_gib: float, models: set[str] | None = None, name: str = "") -> NodeCapacity:
    return NodeCapacity(
        node_id,
        int(free_gib * GiB),
        64 * GiB,
        name=name,
        models=frozenset(models) if models is not None else None,
    )


def inst(model_id: str, node_id: str, state: str, reserved_gib: float = 0, instance_id: str = "i1"):
    return ExistingInstance(instance_id, model_id, node_id, state, int(reserved_gib * GiB))


# -- which node wins ---------------------------------------------------------------------------------------

# needed = 4 GiB weights + 0.5 GiB activations = 4.5 GiB for req() below.
WINNER_CASES = [
    pytest.param([node("a", 8)], [], "a", 8, id="single-node-fits"),
    pytest.param([node("a", 4.5)], [], "a", 4.5, id="exact-fit"),
    pytest.param([node("a", 6), node("b", 20), node("c", 10)], [], "b", 20, id="most-free-wins"),
    pytest.param([node("b", 10), node("a", 10), node("c", 10)], [], "a", 10, id="tie-smallest-id"),
    pytest.param(
        [node("a", 30, models={"other"}), node("b", 6, models={"m"})],
        [],
        "b",
        6,
        id="skip-node-without-weights",
    ),
    pytest.param(
        [node("a", 30, models=None), node("b", 6, models={"m"})],
        [],
        "a",
        30,
        id="unknown-disk-counts-as-holder",
    ),
    pytest.param(
        [node("a", 20), node("b", 12)],
        [inst("x", "a", "loading", 10)],
        "b",
        12,
        id="loading-reservation-subtracted",
    ),
    pytest.param(
        [node("a", 20), node("b", 12)],
        [inst("x", "a", "loading", 3, "i1"), inst("y", "a", "loading", 6, "i2")],
        "b",
        12,
        id="reservations-add-up",
    ),
    pytest.param(
        [node("a", 20), node("b", 12)],
        [inst("x", "a", "ready", 10)],
        "a",
        20,
        id="ready-reservation-already-counted",
    ),
    pytest.param(
        [node("a", 20), node("b", 12)], [inst("x", "a", "failed", 10)], "a", 20, id="failed-reserves-nothing"
    ),
    pytest.param(
        [node("a", 20), node("b", 12)],
        [inst("x", "b", "loading", 10)],
        "a",
        20,
        id="reservation-on-other-node",
    ),
]


@pytest.mark.parametrize(("nodes", "existing", "winner", "free_gib"), WINNER_CASES)
def test_winner(nodes, existing, winner, free_gib):
    r = req()
    p = placement(r, nodes, existing)
    assert p.node_id == winner
    assert p.model_id == "m"
    assert p.node_free_bytes == int(free_gib * GiB)
    assert p.headroom_bytes == int(free_gib * GiB) - r.needed_bytes
    assert p.requirement == r


def test_one_shard_covers_every_layer():
    p = placement(req(layers=48), [node("a", 8), node("b", 9)])
    assert p.shards == (ShardAssignment("b", 0, 48, 0, 1),)
    assert p.shards[0].end_layer - p.shards[0].start_layer == 48


# -- why it cannot be placed ------------------------------------------------------------------------------


def _gib_in(message: str, label: str) -> str:
    m = re.search(label + r" ([0-9.]+ GiB)", message)
    assert m, f"{label!r} not in {message!r}"
    return m.group(1)


NO_ROOM_CASES = [
    # (nodes, existing, best node, best free bytes): needed is 4.5 GiB
    pytest.param([node("a", 3)], [], "a", 3 * GiB, id="single-too-small"),
    # Spread over every holder it still does not fit (4 GiB of layers, 0.5 GiB per stage).
    pytest.param([node("a", 1), node("b", 2), node("c", 1)], [], "b", 2 * GiB, id="best-of-several"),
    pytest.param(
        [node("a", 8)], [inst("x", "a", "loading", 5)], "a", 3 * GiB, id="reservation-leaves-too-little"
    ),
    pytest.param([node("a", 8)], [inst("x", "a", "loading", 20)], "a", 0, id="over-reserved-is-zero"),
]


@pytest.mark.parametrize(("nodes", "existing", "best", "best_free"), NO_ROOM_CASES)
def test_no_room_says_needed_best_and_missing(nodes, existing, best, best_free):
    r = req()
    with pytest.raises(NoPlacementError) as exc:
        placement(r, nodes, existing)
    e = exc.value
    assert not isinstance(e, ModelNotOnDiskError)
    assert e.needed_bytes == r.needed_bytes == int(4.5 * GiB)
    assert e.best_node == best
    assert e.best_free_bytes == best_free
    msg = str(e)
    assert _gib_in(msg, "needs") == "4.50 GiB"
    assert _gib_in(msg, "most free memory is") == gib(best_free)
    assert f"on node {best}:" in msg
    assert f"{gib(r.needed_bytes - best_free)} missing" in msg
    assert "weights 4.00 GiB" in msg and "activations 0.50 GiB" in msg
    if len(nodes) > 1:  # and it says a pipeline would not fit either
        total = sum(n.memory_available_bytes for n in nodes)
        assert f"spread over all {len(nodes)} nodes that hold it ({gib(total)} free in all)" in msg


def test_no_room_message_names_the_node_and_the_kv_budget():
    r = ModelRequirement("big", 10 * GiB, 64 * 1024, 32768, n_layers=64)  # 2 GiB of KV cache
    with pytest.raises(NoPlacementError) as exc:
        placement(r, [node("0123456789abcdef", 11, name="studio")])
    msg = str(exc.value)
    assert "KV cache for 32768 tokens 2.00 GiB" in msg
    assert "needs 12.50 GiB" in msg
    assert "most free memory is 11.00 GiB on node studio (01234567): 1.50 GiB missing" in msg


@pytest.mark.parametrize(
    ("nodes", "asked"),
    [
        pytest.param([node("a", 30, models={"x"}), node("b", 30, models=set())], None, id="nobody-has-it"),
        pytest.param([], None, id="empty-cluster"),
        pytest.param(
            [node("a", 30, models={"x"}), node("b", 30, models={"m"})], "a", id="asked-node-lacks-it"
        ),
    ],
)
def test_model_not_on_disk(nodes, asked):
    with pytest.raises(ModelNotOnDiskError) as exc:
        placement(req(), nodes, node=asked)
    msg = str(exc.value)
    assert msg.startswith("m is not on the disk of ")
    assert ("node a" in msg) if asked else ("any node of the cluster" in msg)
    assert exc.value.needed_bytes == req().needed_bytes


# -- instances that already exist -------------------------------------------------------------------------


@pytest.mark.parametrize("state", ["loading", "ready"])
def test_live_instance_of_the_same_model_is_already_placed(state):
    existing = [inst("other", "b", "ready", instance_id="i0"), inst("m", "a", state, instance_id="i7")]
    with pytest.raises(AlreadyPlacedError) as exc:
        placement(req(), [node("a", 30), node("b", 30)], existing, node="b")
    assert exc.value.existing.instance_id == "i7"
    assert f"instance i7 ({state}) on node a" in str(exc.value)


@pytest.mark.parametrize("state", ["failed", "gone", "stopping"])
def test_dead_instance_does_not_block(state):
    p = placement(req(), [node("a", 30), node("b", 20)], [inst("m", "a", state, reserved_gib=25)])
    assert p.node_id == "a" and p.node_free_bytes == 30 * GiB


# -- node= ------------------------------------------------------------------------------------------------


def test_unknown_node_lists_known_nodes():
    with pytest.raises(UnknownNodeError) as exc:
        placement(req(), [node("b", 30), node("a", 30)], node="zz")
    assert exc.value.node_id == "zz"
    assert str(exc.value) == "no node 'zz' in the cluster; nodes: a, b"


def test_unknown_node_in_empty_cluster():
    with pytest.raises(UnknownNodeError, match="nodes: none"):
        placement(req(), [], node="a")


def test_named_node_is_used_even_if_another_has_more_room():
    p = placement(req(), [node("a", 30), node("b", 6)], node="b")
    assert p.node_id == "b" and p.shards[0].node_id == "b"


def test_named_node_without_room_fails_even_if_another_has_room():
    with pytest.raises(NoPlacementError) as exc:
        placement(req(), [node("a", 30), node("b", 3)], node="b")
    assert not isinstance(exc.value, ModelNotOnDiskError)
    assert exc.value.best_node == "b" and exc.value.best_free_bytes == 3 * GiB


# -- requirements from real cards -------------------------------------------------------------------------


def test_requirement_from_qwen35_27b(catalog):
    card = catalog.get("qwen3.5-27b-4bit")
    assert card.context_length > CONTEXT_BUDGET_TOKENS  # the budget, not the full 262k context, is reserved
    r = ModelRequirement.from_card(card)
    # 64 layers, one in 4 full attention -> 16 layers x 4 KV heads x 256 dims x (K + V) x 2 bytes.
    assert r.kv_bytes_per_token == 16 * 4 * 256 * 2 * 2 == 65536
    assert r.context_tokens == CONTEXT_BUDGET_TOKENS
    assert r.kv_bytes == 2 * GiB
    assert r.weights_bytes == card.storage_bytes == 16054266848
    assert r.activation_bytes == ACTIVATION_MARGIN_BYTES
    assert r.needed_bytes == 16054266848 + 2 * GiB + 512 * MiB
    assert r.n_layers == 64 and r.model_id == "qwen3.5-27b-4bit"


def test_requirement_from_demo_card_uses_its_short_context(catalog):
    card = catalog.get("exo-demo")
    r = ModelRequirement.from_card(card)
    assert r.context_tokens == card.context_length == 4096
    assert r.kv_bytes_per_token == 2 * 2 * 64 * 2 * 2  # 8 layers / 4 -> 2 full-attention layers
    assert r.kv_bytes == 4096 * 1024


@pytest.mark.parametrize(
    ("budget", "tokens"), [(1000, 1000), (4096, 4096), (10**6, 4096)], ids=["below", "equal", "above"]
)
def test_context_budget_is_capped_by_the_context_length(catalog, budget, tokens):
    assert ModelRequirement.from_card(catalog.get("exo-demo"), context_budget=budget).context_tokens == tokens


def test_weights_bytes_override_replaces_card_size(catalog):
    card = catalog.get("qwen3.5-27b-4bit")  # storage_bytes: 14.95 GiB
    on_disk = 16 * GiB  # e.g. a checkpoint with extra files
    r = ModelRequirement.from_card(card, weights_bytes=on_disk)
    assert r.weights_bytes == on_disk
    assert r.needed_bytes == on_disk + 2 * GiB + 512 * MiB
    # 18 GiB free: room for the card's size (17.45 GiB needed) but not for the size on disk (18.5 GiB).
    nodes = [NodeCapacity("a", 18 * GiB, 64 * GiB)]
    assert placement(card, nodes).node_id == "a"
    with pytest.raises(NoPlacementError) as exc:
        placement(r, nodes)
    assert exc.value.needed_bytes == int(18.5 * GiB)


def test_card_is_sized_like_its_requirement(catalog):
    card = catalog.get("qwen3.5-27b-4bit")
    needed = ModelRequirement.from_card(card).needed_bytes
    fits = NodeCapacity("a", needed, 64 * GiB)
    short = NodeCapacity("b", needed - 1, 64 * GiB)
    p = placement(card, [short, fits])
    assert p.node_id == "a" and p.headroom_bytes == 0
    assert p.shards == (ShardAssignment("a", 0, 64, 0, 1),)
    with pytest.raises(NoPlacementError) as exc:
        placement(card, [short])
    assert exc.value.best_free_bytes == needed - 1
    assert str(exc.value).endswith("0.00 GiB missing")


def test_demo_model_fits_a_small_node(catalog):
    p = placement(
        catalog.get("exo-demo"), [NodeCapacity("laptop", 1 * GiB, 8 * GiB, models=frozenset({"exo-demo"}))]
    )
    assert p.node_id == "laptop" and p.requirement.needed_bytes < 1 * GiB


# -- pipelines: one model over several nodes ---------------------------------------------------------------


def layered(layers: int = 8, layer_gib: float = 0.5, embed_gib: float = 0.0, output_gib: float = 0.0,
            mtp_gib: float = 0.0, kv_per_token: int = 0, context: int = 0, interval: int = 4) -> ModelRequirement:
    weights = layers * layer_gib + embed_gib + output_gib + mtp_gib
    return ModelRequirement(
        "m", int(weights * GiB), kv_per_token, context, n_layers=layers,
        layer_bytes=tuple(int(layer_gib * GiB) for _ in range(layers)), embed_bytes=int(embed_gib * GiB),
        output_bytes=int(output_gib * GiB), mtp_bytes=int(mtp_gib * GiB), full_attention_interval=interval,
    )


def stages(p) -> list[tuple[str, int, int]]:
    return [(s.node_id, s.start_layer, s.end_layer) for s in p.shards]


# (requirement, nodes, kwargs, expected stages (node, start, end) in rank order). Layers are split in
# proportion to what each node has left once a stage's fixed part is counted (0.5 GiB of activations
# per stage; the embedding on the first; output, MTP head and embedding on the last), largest remainder.
PIPELINE_CASES = [
    pytest.param(layered(), [node("a", 3), node("b", 3)], {},
                 [("a", 0, 4), ("b", 4, 8)], id="fits-nowhere-alone-even-split"),
    pytest.param(layered(), [node("a", 2.5), node("b", 4)], {},
                 [("b", 0, 5), ("a", 5, 8)], id="proportional-to-room-most-free-first"),
    pytest.param(layered(), [node("a", 2), node("b", 2), node("c", 2), node("d", 1)], {},
                 [("a", 0, 3), ("b", 3, 6), ("c", 6, 8)], id="fewest-nodes-that-hold-it"),
    pytest.param(layered(), [node("a", 30), node("b", 30)], {"min_nodes": 2},
                 [("a", 0, 4), ("b", 4, 8)], id="min-nodes-spreads-what-fits-on-one"),
    pytest.param(layered(), [node("a", 30), node("b", 30), node("c", 30)], {"min_nodes": 3},
                 [("a", 0, 3), ("b", 3, 6), ("c", 6, 8)], id="min-nodes-3-largest-remainder"),
    pytest.param(layered(), [node("a", 30), node("b", 30), node("c", 30)], {"nodes_in_order": ["c", "a"]},
                 [("c", 0, 4), ("a", 4, 8)], id="nodes-exactly-in-order"),
    pytest.param(layered(layers=4, layer_gib=0.25, embed_gib=1, output_gib=0.5, mtp_gib=0.5),
                 [node("a", 3), node("b", 3)], {},
                 [("a", 0, 3), ("b", 3, 4)], id="last-stage-carries-output-head-and-embedding"),
    pytest.param(layered(layers=3), [node("a", 30), node("b", 30), node("c", 1.0)], {"min_nodes": 3},
                 [("a", 0, 1), ("b", 1, 2), ("c", 2, 3)], id="at-least-one-layer-per-stage"),
    pytest.param(layered(layers=8, layer_gib=0.25, kv_per_token=2 * GiB // 1024, context=1024, interval=2),
                 [node("a", 3.5), node("b", 3.5)], {},
                 [("a", 0, 4), ("b", 4, 8)], id="kv-of-attention-layers-counted"),
]


@pytest.mark.parametrize(("requirement", "nodes", "kwargs", "expected"), PIPELINE_CASES)
def test_pipeline_placement(requirement, nodes, kwargs, expected):
    p = placement(requirement, nodes, **kwargs)
    assert stages(p) == expected
    assert p.pipelined and p.node_id == expected[-1][0]  # the last stage leads
    assert [s.rank for s in p.shards] == list(range(len(expected)))
    assert all(s.world_size == len(expected) for s in p.shards)
    free = {n.node_id: n.memory_available_bytes for n in nodes}
    for s, needed in zip(p.shards, p.stage_needed_bytes, strict=True):
        assert needed == requirement.stage_bytes(s.start_layer, s.end_layer) <= free[s.node_id]
    assert p.headroom_bytes >= 0


def test_stages_follow_the_fastest_links():
    """Four equal nodes, two of them far apart: the ring of stages avoids the slow links."""
    nodes = [node(x, 2) for x in "abcd"]
    slow = {("a", "b"): 50.0, ("c", "d"): 50.0}
    links = {(x, y): slow.get((x, y), slow.get((y, x), 1.0)) for x in "abcd" for y in "abcd" if x != y}
    p = placement(layered(layers=8, layer_gib=0.6), nodes, min_nodes=4, links=links)
    order = [s.node_id for s in p.shards]
    ring = list(zip(order, order[1:] + order[:1], strict=True))
    assert not any(pair in slow or pair[::-1] in slow for pair in ring), order


def test_a_stage_holds_only_its_layers_and_the_stage_parts():
    r = layered(layers=4, layer_gib=1, embed_gib=2, output_gib=1, mtp_gib=0.5)
    half = int(0.5 * GiB)
    assert r.stage_bytes(0, 2) == 2 * GiB + 2 * GiB + half  # layers, embedding, activations
    assert r.stage_bytes(2, 4) == 2 * GiB + 2 * GiB + GiB + half + half  # + output, MTP head, embedding
    assert r.stage_bytes(1, 3) == 2 * GiB + half  # a middle stage: layers and activations only
    assert r.stage_bytes(0, 4) == 4 * GiB + 2 * GiB + GiB + half + half


@pytest.mark.parametrize(
    ("nodes", "kwargs", "error", "message"),
    [
        pytest.param([node("a", 30)], {"min_nodes": 2}, TooFewNodesError,
                     "asked to spread over 2 nodes, but 1 node of the cluster hold its weights", id="one-node"),
        pytest.param([node("a", 30), node("b", 30, models={"x"})], {"min_nodes": 2}, TooFewNodesError,
                     "but 1 node of the cluster hold", id="only-one-holds-it"),
        pytest.param([node("a", 30), node("b", 30)], {"nodes_in_order": ["a", "zz"]}, UnknownNodeError,
                     "no node 'zz' in the cluster", id="unknown-node-in-nodes"),
        pytest.param([node("a", 30), node("b", 30, models={"x"})], {"nodes_in_order": ["a", "b"]},
                     ModelNotOnDiskError, "not on the disk of node b", id="weights-missing-on-a-stage"),
        pytest.param([node("a", 30), node("b", 0.8)], {"nodes_in_order": ["a", "b"]}, NoPlacementError,
                     "stage 1 on node b needs", id="a-named-stage-does-not-fit"),
        pytest.param([node("a", 30), node("b", 30)], {"nodes_in_order": ["a", "a"]}, InvalidPlacementRequest,
                     "nodes lists a node twice", id="duplicate-node"),
        pytest.param([node("a", 30), node("b", 30)], {"node": "a", "min_nodes": 2}, InvalidPlacementRequest,
                     "use `nodes`", id="node-and-min-nodes"),
        pytest.param([node(x, 30) for x in "abcdefghij"], {"min_nodes": 9}, TooFewNodesError,
                     "it has 8 layers", id="more-stages-than-layers"),
    ],
)
def test_pipeline_placement_errors_say_what_is_missing(nodes, kwargs, error, message):
    with pytest.raises(error) as exc:
        placement(layered(), nodes, **kwargs)
    assert message in str(exc.value)


def test_pipeline_preview_is_pure():
    nodes = [node("a", 3), node("b", 3)]
    first = placement(layered(), nodes)
    assert placement(layered(), nodes) == first
    assert nodes == [node("a", 3), node("b", 3)]


def test_a_live_stage_of_the_model_is_already_placed():
    existing = [inst("m", "b", "ready", instance_id="p1"), inst("m", "a", "loading", instance_id="p1")]
    with pytest.raises(AlreadyPlacedError):
        placement(layered(), [node("a", 3), node("b", 3)], existing)


# -- weights no node has: nodes that can download them ------------------------------------------------------


def fetcher(node_id: str, free_gib: float, room_gib: float = 100, *, holds: bool = False) -> NodeCapacity:
    """A node that can download (not offline), with ``room_gib`` of disk to download into."""
    return NodeCapacity(node_id, int(free_gib * GiB), 64 * GiB, models=frozenset({"m"} if holds else set()),
                        can_download=True, download_room_bytes=int(room_gib * GiB))


def offline(node_id: str, free_gib: float) -> NodeCapacity:
    return NodeCapacity(node_id, int(free_gib * GiB), 64 * GiB, models=frozenset(), can_download=False,
                        download_room_bytes=100 * GiB)


def downloadable(r: ModelRequirement | None = None) -> ModelRequirement:
    return dataclasses.replace(r or req(), downloadable=True)


# (nodes, kwargs, expected stages (node, start, end), whether each stage's node downloads). req() needs
# 4.5 GiB of memory and 4 GiB of disk; layered() 8 layers of 0.5 GiB (2 GiB a stage of 4 layers).
DOWNLOAD_CASES = [
    pytest.param([fetcher("a", 8), fetcher("b", 20)], {}, req(), [("b", 0, 8)], [True], id="most-free-downloads"),
    pytest.param([fetcher("a", 6, holds=True), fetcher("b", 20)], {}, req(), [("a", 0, 8)], [False],
                 id="a-holder-with-room-beats-more-memory"),
    pytest.param([fetcher("a", 3, holds=True), fetcher("c", 3, holds=True), fetcher("b", 8)], {}, layered(),
                 [("b", 0, 8)], [True], id="one-node-downloading-beats-a-pipeline-of-holders"),
    pytest.param([fetcher("a", 20, room_gib=1), fetcher("b", 8)], {}, req(), [("b", 0, 8)], [True],
                 id="skips-a-node-without-disk"),
    pytest.param([offline("a", 20), fetcher("b", 8)], {}, req(), [("b", 0, 8)], [True],
                 id="an-offline-node-downloads-nothing"),
    pytest.param([fetcher("a", 30), fetcher("b", 8)], {"node": "b"}, req(), [("b", 0, 8)], [True],
                 id="named-node-downloads"),
    pytest.param([fetcher("a", 3, holds=True), fetcher("b", 3), fetcher("c", 3)], {}, layered(),
                 [("a", 0, 4), ("b", 4, 8)], [False, True], id="pipeline-takes-holders-first"),
    pytest.param([fetcher("a", 3), fetcher("b", 3)], {}, layered(), [("a", 0, 4), ("b", 4, 8)], [True, True],
                 id="pipeline-of-downloaders"),
    pytest.param([fetcher("a", 3, room_gib=2.5), fetcher("b", 3, room_gib=2.5)], {}, layered(),
                 [("a", 0, 4), ("b", 4, 8)], [True, True], id="each-stage-needs-disk-for-its-part-only"),
    pytest.param([fetcher("a", 30, holds=True), fetcher("c", 30)], {"nodes_in_order": ["c", "a"]}, layered(),
                 [("c", 0, 4), ("a", 4, 8)], [True, False], id="named-stages-download-where-missing"),
    pytest.param([fetcher("a", 30), fetcher("b", 30, holds=True)], {"min_nodes": 2}, layered(),
                 [("a", 0, 4), ("b", 4, 8)], [True, False], id="min-nodes-with-a-downloader"),
]


@pytest.mark.parametrize(("nodes", "kwargs", "requirement", "expected", "downloads"), DOWNLOAD_CASES)
def test_placement_downloads_what_is_missing(nodes, kwargs, requirement, expected, downloads):
    p = placement(downloadable(requirement), nodes, **kwargs)
    assert stages(p) == expected
    assert list(p.stage_downloads) == downloads
    assert p.node_id == expected[-1][0]


def test_weights_that_cannot_be_downloaded_are_not_placed_on_nodes_without_them():
    with pytest.raises(ModelNotOnDiskError) as exc:  # no repo (not downloadable): as before
        placement(req(), [fetcher("a", 30)])
    assert "download it there first (`exo pull m`)" in str(exc.value)


@pytest.mark.parametrize(("kwargs", "where"), [({}, "any node of the cluster"), ({"nodes_in_order": ["a", "b"]},
                                                                               "node a, node b")])
def test_offline_nodes_say_what_to_pull(kwargs, where):
    with pytest.raises(ModelNotOnDiskError) as exc:
        placement(downloadable(layered()), [offline("a", 30), offline("b", 30)], **kwargs)
    msg = str(exc.value)
    assert msg.startswith(f"m is not on the disk of {where}, and the nodes are offline")
    assert "exo pull m" in msg and "EXO_OFFLINE" in msg


@pytest.mark.parametrize(
    ("nodes", "kwargs", "message"),
    [
        pytest.param([fetcher("a", 30, room_gib=3)], {}, "node a has 3.00 GiB of disk to download into, it "
                     "needs 4.00 GiB", id="one-node"),
        pytest.param([fetcher("a", 3, room_gib=1), fetcher("b", 3, room_gib=1)], {},
                     "it needs 2.00 GiB", id="pipeline-stages"),
        pytest.param([fetcher("a", 30), fetcher("b", 30, room_gib=1)], {"nodes_in_order": ["a", "b"]},
                     "stage 1: node b has 1.00 GiB of disk", id="named-stage"),
    ],
)
def test_no_disk_to_download_is_a_clear_error(nodes, kwargs, message):
    r = downloadable(layered() if len(nodes) > 1 else req())
    with pytest.raises(NoDiskRoomError) as exc:
        placement(r, nodes, **kwargs)
    assert message in str(exc.value) and "HF_HOME" in str(exc.value)


def test_stage_weight_bytes():
    r = layered(layers=4, layer_gib=1, embed_gib=2, output_gib=1, mtp_gib=0.5)
    assert r.stage_weight_bytes(0, 2) == 4 * GiB  # two layers and the embedding
    assert r.stage_weight_bytes(1, 3) == 2 * GiB
    assert r.stage_weight_bytes(2, 4) == int(5.5 * GiB)  # layers, embedding, output, MTP head
    assert r.stage_weight_bytes(0, 4) == r.weights_bytes


def test_a_card_with_a_repo_is_downloadable_a_bundled_one_is_not(catalog):
    assert ModelRequirement.from_card(catalog.get("qwen3.5-27b-4bit")).downloadable
    assert not ModelRequirement.from_card(catalog.get("exo-demo")).downloadable


# -- a model no node holds yet: the parts that are not layers, estimated from its card ------------------------


def test_parts_of_a_checkpoint_no_node_has_read_are_estimated_from_the_card(catalog):
    """Sizes come from safetensors headers on a node's disk; before any node has the checkpoint, the
    embedding and lm_head are vocab x hidden weights at the card's quantization and the MTP head is its
    layer(s) at the average layer size plus its 2H x H projection."""
    card = catalog.get("qwen3.5-27b-4bit")  # 4-bit: half a byte per weight + a bf16 scale and bias per 64
    assert card.vocab == 248320 and card.bytes_per_weight == 0.5 + 4 / 64
    r = ModelRequirement.from_card(card)
    table = 248320 * 5120 * 0.5625
    assert r.embed_bytes == int(table) and r.output_bytes == int(table + 2 * 5120)
    layer = (card.storage_bytes - r.embed_bytes - r.output_bytes) / 65  # 64 layers + the head's one
    assert r.mtp_bytes == pytest.approx(layer + 2 * 5120 * 5120 * 0.5625, rel=1e-6)
    # The layers share the rest: every stage's parts add up to the checkpoint.
    assert sum(r.layer_cost(i) for i in range(64)) - r.kv_bytes == pytest.approx(
        card.storage_bytes - r.embed_bytes - r.output_bytes - r.mtp_bytes, rel=1e-9)
    assert r.stage_weight_bytes(0, 32) + r.stage_weight_bytes(32, 64) - r.embed_bytes == pytest.approx(
        card.storage_bytes, rel=1e-9)
    demo = ModelRequirement.from_card(catalog.get("exo-demo"))  # its card names its own 4096-token vocabulary
    assert demo.embed_bytes == 4096 * 256 * 2
    next_card = catalog.get("qwen3-next-80b-a3b-instruct-4bit")
    assert next_card.vocab == 151936
    assert ModelRequirement.from_card(next_card).embed_bytes == int(151936 * 2048 * 0.5625)


@pytest.mark.parametrize(("quantization", "per_weight"), [
    (None, 2.0), ("bf16", 2.0), ("fp32", 4.0), ("8bit", 1.0625), ("4bit", 0.5625), ("mxfp4", 0.53125),
    ("nvfp4", 0.5625)])
def test_bytes_per_weight_of_a_quantization(catalog, quantization, per_weight):
    card = catalog.get("qwen3.5-27b-4bit").model_copy(update={"quantization": quantization})
    assert card.bytes_per_weight == per_weight


def test_an_inconsistent_card_leaves_half_its_weights_to_the_layers(catalog):
    card = catalog.get("exo-demo").model_copy(update={"vocab_size": None})  # 248320 x 256 x 2 > its weights
    r = ModelRequirement.from_card(card)
    assert r.embed_bytes + r.output_bytes + r.mtp_bytes == pytest.approx(card.storage_bytes / 2, abs=3)


def _downloader(node_id: str, free_gib: float) -> NodeCapacity:
    return NodeCapacity(node_id, int(free_gib * GiB), 64 * GiB, models=frozenset(), can_download=True,
                        download_room_bytes=100 * GiB)


# (card, nodes, expected stages) for a model no node holds: every node downloads its stage. The last stage
# carries lm_head, MTP head and the embedding, the first the embedding: with those counted, the first
# stage of two equal nodes takes more layers (0-33 | 34-63, where counting nothing split 32 | 32); of three,
# the middle one, which holds neither, takes the most.
CARD_PIPELINE_CASES = [
    pytest.param("qwen3.5-27b-4bit", [_downloader("a", 10), _downloader("b", 10)],
                 [("a", 0, 34), ("b", 34, 64)], id="27b-over-two-equal-nodes"),
    pytest.param("qwen3.5-27b-4bit", [_downloader("a", 7), _downloader("b", 7), _downloader("c", 7)],
                 [("a", 0, 22), ("b", 22, 46), ("c", 46, 64)], id="27b-over-three-nodes"),
]


@pytest.mark.parametrize(("card_id", "nodes", "expected"), CARD_PIPELINE_CASES)
def test_a_model_no_node_holds_is_split_with_its_estimated_parts(catalog, card_id, nodes, expected):
    card = catalog.get(card_id)
    p = placement(card, nodes)
    assert stages(p) == expected
    assert all(p.stage_downloads)
    r = p.requirement
    assert r.embed_bytes > 0 and r.output_bytes > 0 and r.mtp_bytes > 0
    free = {n.node_id: n.memory_available_bytes for n in nodes}
    for s, needed in zip(p.shards, p.stage_needed_bytes, strict=True):
        assert needed <= free[s.node_id]
    # The last stage holds the output, the MTP head and the embedding the head needs.
    last = p.shards[-1]
    assert p.stage_needed_bytes[-1] == r.stage_bytes(last.start_layer, last.end_layer)
    assert r.fixed_bytes(False, True) == r.activation_bytes + r.embed_bytes + r.output_bytes + r.mtp_bytes
