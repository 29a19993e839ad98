"""Reading model cards from disk and resolving a user's model reference to one card.

Cards come from three places, later ones overriding earlier ones by id:
1. the cards shipped with exo (top-level `model_cards/`, reachable as the package path
   `exo/assets/model_cards`, a symlink in a checkout and real files in a wheel),
2. the user's `$EXO_HOME/model_cards/`,
3. any extra directories the caller passes.
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from pydantic import ValidationError

from exo.cards.schema import CardError, ModelCard
from exo.settings import resolve_home

CARD_SUFFIX = ".toml"
USER_CARDS_DIR = "model_cards"


class UnknownModelError(LookupError):
    """No card matches a model reference; the message lists close matches."""

    def __init__(self, ref: str, suggestions: list[str]) -> None:
        self.ref = ref
        self.suggestions = suggestions
        hint = f" Did you mean: {', '.join(suggestions)}?" if suggestions else ""
        super().__init__(
            f"unknown model {ref!r}.{hint} List models with `exo models`, or add a card to "
            f"$EXO_HOME/{USER_CARDS_DIR}/<id>.toml."
        )


class AmbiguousModelError(LookupError):
    """A reference (a shared MTP source repo) matches several cards; the caller must pick one by id."""

    def __init__(self, ref: str, card_ids: list[str]) -> None:
        self.ref = ref
        self.card_ids = card_ids
        super().__init__(f"model {ref!r} matches several cards ({', '.join(card_ids)}); use one of these ids")


def package_root() -> Path:
    return Path(str(resources.files("exo")))


def bundled_cards_dir() -> Path:
    packaged = package_root() / "assets" / "model_cards"
    # A checkout made without symlink support has a text file there; use the top-level directory.
    checkout = package_root().parents[1] / "model_cards"
    return packaged if packaged.is_dir() or not checkout.is_dir() else checkout


def bundled_model_dir(name: str) -> Path:
    """Where a card's `bundled = "<name>"` model lives inside the installed package."""
    return package_root() / "assets" / "models" / name


def load_card(path: Path | str) -> ModelCard:
    """Read and validate one card file; its `id` must equal the file's stem."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise CardError(path, None, f"invalid TOML: {exc}") from None
    try:
        card = ModelCard.model_validate(data)
    except ValidationError as exc:
        raise CardError.from_validation_error(path, exc) from None
    if card.id != path.stem:
        raise CardError(
            path, "id", f"id {card.id!r} must equal the file name {path.stem!r} (rename one of them)"
        )
    return card


def load_cards_dir(directory: Path) -> list[tuple[ModelCard, Path]]:
    """Every `*.toml` card in one directory (not recursive), sorted by file name."""
    return [(load_card(p), p) for p in sorted(directory.glob("*" + CARD_SUFFIX))]


def load_catalog(extra_dirs: Iterable[Path | str] = (), home: Path | str | None = None) -> Catalog:
    """Bundled cards, then `<home>/model_cards/` (home defaults to $EXO_HOME), then `extra_dirs`."""
    user_dir = (Path(home).expanduser() if home is not None else resolve_home()) / USER_CARDS_DIR
    bundled = bundled_cards_dir()
    if not bundled.is_dir():
        raise CardError(bundled, None, "bundled model cards are missing; the exo installation is incomplete")
    dirs = [bundled, user_dir]
    for extra in extra_dirs:
        extra = Path(extra).expanduser()
        if not extra.is_dir():
            raise CardError(extra, None, "model card directory does not exist")
        dirs.append(extra)
    by_id: dict[str, tuple[ModelCard, Path]] = {}
    for directory in dirs:
        if directory.is_dir():
            for card, path in load_cards_dir(directory):
                by_id[card.id] = (card, path)
    return Catalog.from_cards(by_id.values())


@dataclass(frozen=True)
class Catalog:
    """All known cards, bundled demo models first, then by id."""

    cards: tuple[ModelCard, ...]
    paths: Mapping[str, Path]  # card id -> the file it was read from

    @classmethod
    def from_cards(cls, entries: Iterable[tuple[ModelCard, Path]]) -> Catalog:
        ordered = sorted(entries, key=lambda e: (e[0].bundled is None, e[0].id))
        ids = [c.id for c, _ in ordered]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise CardError(None, "id", f"duplicate card ids {duplicates}")
        return cls(cards=tuple(c for c, _ in ordered), paths={c.id: p for c, p in ordered})

    def __iter__(self) -> Iterator[ModelCard]:
        return iter(self.cards)

    def __len__(self) -> int:
        return len(self.cards)

    def __contains__(self, ref: object) -> bool:
        if not isinstance(ref, str):
            return False
        try:
            self.get(ref)
        except (UnknownModelError, AmbiguousModelError):
            return False
        return True

    def get(self, ref: str) -> ModelCard:
        """Resolve a card id, a weights repo, or an MTP source repo (all case-insensitive)."""
        key = ref.strip().lower()
        for field in ("id", "repo"):
            for card in self.cards:
                value = getattr(card, field)
                if value is not None and value.lower() == key:
                    return card
        # The official repo ("Qwen/Qwen3.5-27B") names the model too; several cards may share it.
        matches = [
            c
            for c in self.cards
            if c.native_mtp and c.native_mtp.source_repo and c.native_mtp.source_repo.lower() == key
        ]
        if len(matches) == 1:
            return matches[0]
        if matches:
            raise AmbiguousModelError(ref, [c.id for c in matches])
        raise UnknownModelError(ref, self.suggest(ref))

    def suggest(self, ref: str, limit: int = 5) -> list[str]:
        """Card ids close to `ref` (substring matches first, then difflib's fuzzy ones)."""
        key = ref.strip().lower()
        names: dict[str, str] = {}  # lowercased id / repo -> card id
        for card in self.cards:
            names.setdefault(card.id, card.id)
            for repo in (card.repo, card.native_mtp.source_repo if card.native_mtp else None):
                if repo:
                    names.setdefault(repo.lower(), card.id)
        found = [names[n] for n in names if key and key in n]
        found += [names[n] for n in difflib.get_close_matches(key, list(names), n=limit * 2, cutoff=0.6)]
        return list(dict.fromkeys(found))[:limit]
