"""placement(): which node runs a model, or why none can. Table-driven over hand-built rows and real cards."""

from __future__ import annotations

import re

import pytest

from exo.cards import load_catalog
from exo.cluster.placement import (
    ACTIVATION_MARGIN_BYTES,
    CONTEXT_BUDGET_TOKENS,
    AlreadyPlacedError,
    ExistingInstance,
    ModelNotOnDiskError,
    ModelRequirement,
    NodeCapacity,
    NoPlacementError,
    ShardAssignment,
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
    pytest.param([node("a", 2), node("b", 4), node("c", 1)], [], "b", 4 * GiB, id="best-of-several"),
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
    assert msg.endswith(f"{gib(r.needed_bytes - best_free)} missing")
    assert "weights 4.00 GiB" in msg and "activations 0.50 GiB" in msg


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
