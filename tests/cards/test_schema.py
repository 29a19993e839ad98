import tomllib
from pathlib import Path

import pytest

from exo.cards import CardError, ModelCard, load_card
from exo.cards.catalog import bundled_cards_dir

SHIPPED = sorted(bundled_cards_dir().glob("*.toml"))
FACTS_REPOS = {
    "mlx-community/Qwen3.5-2B-MLX-8bit",
    "mlx-community/Qwen3.5-9B-4bit",
    "mlx-community/Qwen3.5-27B-4bit",
    "mlx-community/Qwen3.5-35B-A3B-4bit",
    "mlx-community/Qwen3.5-122B-A10B-4bit",
    "mlx-community/Qwen3.5-397B-A17B-4bit",
    "mlx-community/Qwen3.6-27B-4bit",
    "mlx-community/Qwen3.6-35B-A3B-4bit",
    "mlx-community/Qwen3-Next-80B-A3B-Instruct-4bit",
    "mlx-community/Qwen3-Coder-Next-4bit",
}

VALID = """\
id = "toy-4bit"
name = "Toy"
arch = "qwen3_5"
repo = "someone/Toy-4bit"
n_layers = 8
hidden_size = 64
kv_heads = 2
head_dim = 16
context_length = 1024
storage_bytes = 1000
quantization = "4bit"

[native_mtp]
num_layers = 1
default_k = 1
max_k = 2
source_repo = "someone/Toy"
"""


def write_card(tmp_path: Path, text: str, stem: str = "toy-4bit") -> Path:
    path = tmp_path / f"{stem}.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_card_validates(path: Path) -> None:
    card = load_card(path)
    assert card.id == path.stem
    if card.native_mtp is not None:
        assert 0 <= card.native_mtp.default_k <= card.native_mtp.max_k


def test_shipped_cards_cover_the_facts_table_and_demo_models() -> None:
    cards = {p.stem: load_card(p) for p in SHIPPED}
    assert {c.repo for c in cards.values() if c.repo} == FACTS_REPOS
    demo, demo_moe = cards["exo-demo"], cards["exo-demo-moe"]
    assert (demo.arch, demo.bundled, demo.native_mtp.default_k, demo.native_mtp.max_k) == (
        "qwen3_5",
        "exo-demo",
        2,
        3,
    )
    assert (demo_moe.arch, demo_moe.bundled) == ("qwen3_5_moe", "exo-demo-moe")
    assert (demo_moe.native_mtp.default_k, demo_moe.native_mtp.max_k) == (1, 2)
    assert demo.native_mtp.source_repo is None and demo_moe.native_mtp.source_repo is None
    # Coder-Next never shipped a head: no [native_mtp] table.
    assert cards["qwen3-coder-next-4bit"].native_mtp is None


def test_depth_policy_per_model_kind() -> None:
    for path in SHIPPED:
        card = load_card(path)
        if card.native_mtp is None or card.bundled:
            continue
        mtp = card.native_mtp
        if card.is_moe:
            assert (mtp.default_k, mtp.max_k) == (1, 2), card.id
        elif card.hidden_size >= 5120:
            assert (mtp.default_k, mtp.max_k) == (2, 3), card.id
        else:
            assert (mtp.default_k, mtp.max_k) == (1, 3), card.id


def test_valid_card_round_trip(tmp_path: Path) -> None:
    card = load_card(write_card(tmp_path, VALID))
    assert card == ModelCard.model_validate(tomllib.loads(VALID))
    assert card.full_attention_interval == 4 and card.tags == ()
    assert hash(card)  # frozen and hashable


@pytest.mark.parametrize(
    ("edit", "field", "words"),
    [
        (lambda t: t + "\n", None, None),  # control: unchanged text loads
        (
            lambda t: t.replace('name = "Toy"', 'name = "Toy"\ncolour = "red"'),
            "colour",
            "unknown key 'colour'",
        ),
        (lambda t: t.replace("max_k = 2", "max_k = 2\nspeed = 3"), "native_mtp.speed", "unknown key 'speed'"),
        (
            lambda t: t.replace("default_k = 1", "default_k = 3"),
            "native_mtp.default_k",
            "default_k (3) must be <= max_k (2)",
        ),
        (lambda t: t.replace("max_k = 2", "max_k = 9"), "native_mtp.max_k", "less than or equal to 8"),
        (
            lambda t: t.replace('repo = "someone/Toy-4bit"', 'repo = "someone/Toy-4bit"\nbundled = "toy"'),
            "bundled",
            "exactly one of `repo`",
        ),
        (lambda t: t.replace('repo = "someone/Toy-4bit"\n', ""), "bundled", "exactly one of `repo`"),
        (lambda t: t.replace('arch = "qwen3_5"', 'arch = "llama"'), "arch", "'qwen3_5'"),
        (lambda t: t.replace("n_layers = 8", 'n_layers = "8"'), "n_layers", "valid integer"),
        (lambda t: t.replace("n_layers = 8\n", ""), "n_layers", "required key is missing"),
        (lambda t: t.replace('quantization = "4bit"', 'quantization = "int4"'), "quantization", "pattern"),
        (lambda t: t.replace('id = "toy-4bit"', 'id = "Toy-4bit"'), "id", "pattern"),
    ],
)
def test_invalid_cards_name_the_problem(tmp_path: Path, edit, field: str | None, words: str | None) -> None:
    path = write_card(tmp_path, edit(VALID))
    if field is None:
        assert load_card(path).id == "toy-4bit"
        return
    with pytest.raises(CardError) as info:
        load_card(path)
    assert info.value.path == path and info.value.field == field
    assert str(path) in str(info.value) and words in str(info.value)


def test_id_must_equal_file_stem(tmp_path: Path) -> None:
    path = write_card(tmp_path, VALID, stem="other-name")
    with pytest.raises(CardError, match="must equal the file name 'other-name'") as info:
        load_card(path)
    assert info.value.field == "id"


def test_broken_toml_is_a_card_error(tmp_path: Path) -> None:
    with pytest.raises(CardError, match="invalid TOML"):
        load_card(write_card(tmp_path, VALID.replace('name = "Toy"', "name = ")))


def test_card_error_is_a_value_error() -> None:
    assert issubclass(CardError, ValueError)


def test_kv_bytes_per_token(tmp_path: Path) -> None:
    card = load_card(write_card(tmp_path, VALID))
    # 8 layers, one in four is full attention -> 2 layers; K and V, 2 kv heads of 16, 2 bytes.
    assert card.full_attention_layers == 2
    assert card.kv_bytes_per_token() == 2 * 2 * 2 * 16 * 2
    assert card.kv_bytes_per_token(dtype_bytes=1) == 2 * 2 * 2 * 16
    no_head_dim = card.model_copy(update={"head_dim": None})
    with pytest.raises(CardError, match="head_dim"):
        no_head_dim.kv_bytes_per_token()


def test_kv_bytes_for_a_real_card() -> None:
    card = load_card(bundled_cards_dir() / "qwen3.5-27b-4bit.toml")
    # 64 layers / 4 = 16 attention layers, 4 kv heads of 256, bf16: 64 KiB per token.
    assert card.kv_bytes_per_token() == 65536
