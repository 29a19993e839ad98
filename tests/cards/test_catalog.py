from pathlib import Path

import pytest

from exo.cards import AmbiguousModelError, CardError, UnknownModelError, bundled_cards_dir, load_catalog

USER_CARD = """\
id = "qwen3.5-9b-4bit"
name = "My 9B"
arch = "qwen3_5"
repo = "me/My-Qwen3.5-9B-4bit"
n_layers = 32
hidden_size = 4096
kv_heads = 4
head_dim = 256
context_length = 32768
storage_bytes = 5950062560
"""


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "exo-home"


def test_bundled_catalog_order_and_contents(home: Path) -> None:
    catalog = load_catalog(home=home)
    ids = [c.id for c in catalog.cards]
    assert ids[:2] == ["exo-demo", "exo-demo-moe"]  # bundled demo models first
    assert ids[2:] == sorted(ids[2:])
    assert len(catalog) == len(list(bundled_cards_dir().glob("*.toml"))) == 12


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        ("qwen3.5-27b-4bit", "qwen3.5-27b-4bit"),
        ("QWEN3.5-27B-4BIT", "qwen3.5-27b-4bit"),
        ("mlx-community/Qwen3.5-27B-4bit", "qwen3.5-27b-4bit"),
        ("MLX-COMMUNITY/qwen3.5-27b-4bit", "qwen3.5-27b-4bit"),
        ("Qwen/Qwen3.6-35B-A3B", "qwen3.6-35b-a3b-4bit"),  # the MTP source repo names the model too
        ("qwen/qwen3-next-80b-a3b-instruct", "qwen3-next-80b-a3b-instruct-4bit"),
        ("  exo-demo ", "exo-demo"),
    ],
)
def test_get_by_id_repo_and_case(home: Path, ref: str, expected: str) -> None:
    catalog = load_catalog(home=home)
    assert catalog.get(ref).id == expected
    assert ref in catalog


def test_every_reference_resolves_to_its_own_card(home: Path) -> None:
    catalog = load_catalog(home=home)
    for card in catalog:
        refs = [card.id, card.repo, card.native_mtp.source_repo if card.native_mtp else None]
        for ref in filter(None, refs):
            assert catalog.get(ref) is card


def test_unknown_model_lists_close_matches(home: Path) -> None:
    catalog = load_catalog(home=home)
    with pytest.raises(UnknownModelError) as info:
        catalog.get("qwen3.5-27b")
    assert info.value.suggestions[0] == "qwen3.5-27b-4bit"
    assert "qwen3.5-27b-4bit" in str(info.value) and "Did you mean" in str(info.value)
    with pytest.raises(UnknownModelError) as info:
        catalog.get("mlx-community/Qwen3.6-27B-8bit")  # typo-level distance from a real repo
    assert "qwen3.6-27b-4bit" in info.value.suggestions
    with pytest.raises(UnknownModelError) as info:
        catalog.get("llama-3-70b")
    assert "Did you mean" not in str(info.value)
    assert "llama-3-70b" not in catalog


def test_user_card_overrides_bundled_one(home: Path) -> None:
    (home / "model_cards").mkdir(parents=True)
    (home / "model_cards" / "qwen3.5-9b-4bit.toml").write_text(USER_CARD)
    catalog = load_catalog(home=home)
    card = catalog.get("qwen3.5-9b-4bit")
    assert card.name == "My 9B" and card.native_mtp is None
    assert catalog.paths[card.id] == home / "model_cards" / "qwen3.5-9b-4bit.toml"
    assert catalog.get("me/my-qwen3.5-9b-4bit") is card
    # The overridden card's repo no longer resolves; its official repo no longer does either.
    with pytest.raises(UnknownModelError):
        catalog.get("mlx-community/Qwen3.5-9B-4bit")
    assert len(catalog) == 12


def test_exo_home_from_environment(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (home / "model_cards").mkdir(parents=True)
    (home / "model_cards" / "mine.toml").write_text(
        USER_CARD.replace('id = "qwen3.5-9b-4bit"', 'id = "mine"')
    )
    monkeypatch.setenv("EXO_HOME", str(home))
    assert load_catalog().get("mine").name == "My 9B"


def test_extra_dirs_override_user_cards(home: Path, tmp_path: Path) -> None:
    (home / "model_cards").mkdir(parents=True)
    (home / "model_cards" / "mine.toml").write_text(
        USER_CARD.replace('id = "qwen3.5-9b-4bit"', 'id = "mine"')
    )
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "mine.toml").write_text(
        USER_CARD.replace('id = "qwen3.5-9b-4bit"', 'id = "mine"').replace("My 9B", "Extra 9B")
    )
    (extra / "notes.txt").write_text("not a card")
    catalog = load_catalog(extra_dirs=[extra], home=home)
    assert catalog.get("mine").name == "Extra 9B"
    assert len(catalog) == 13
    with pytest.raises(CardError, match="does not exist"):
        load_catalog(extra_dirs=[tmp_path / "missing"], home=home)


def test_invalid_user_card_fails_loudly(home: Path) -> None:
    (home / "model_cards").mkdir(parents=True)
    bad = home / "model_cards" / "bad.toml"
    bad.write_text(USER_CARD.replace('id = "qwen3.5-9b-4bit"', 'id = "bad"') + "extra_key = 1\n")
    with pytest.raises(CardError) as info:
        load_catalog(home=home)
    assert info.value.path == bad and info.value.field == "extra_key"


def test_shared_source_repo_is_ambiguous(home: Path) -> None:
    (home / "model_cards").mkdir(parents=True)
    eight_bit = (
        (bundled_cards_dir() / "qwen3.5-27b-4bit.toml")
        .read_text()
        .replace('id = "qwen3.5-27b-4bit"', 'id = "qwen3.5-27b-8bit"')
        .replace("Qwen3.5-27B-4bit", "Qwen3.5-27B-8bit")
        .replace('quantization = "4bit"', 'quantization = "8bit"')
    )
    (home / "model_cards" / "qwen3.5-27b-8bit.toml").write_text(eight_bit)
    catalog = load_catalog(home=home)
    assert catalog.get("mlx-community/Qwen3.5-27B-8bit").id == "qwen3.5-27b-8bit"
    with pytest.raises(AmbiguousModelError) as info:
        catalog.get("Qwen/Qwen3.5-27B")
    assert info.value.card_ids == ["qwen3.5-27b-4bit", "qwen3.5-27b-8bit"]
