"""From what a user types (a card id, a repo id, a directory, or nothing) to a checkpoint on disk."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from exo.cards import Catalog, ModelCard, UnknownModelError, bundled_model_dir, load_catalog
from exo.cards.schema import REPO_PATTERN

from .hf_cache import cached_snapshot

DEFAULT_MODEL = "exo-demo"
# Defaults for a checkpoint without a card (docs/architecture.md, "Adaptive depth").
UNCARDED_DEFAULT_K = 1
UNCARDED_MAX_K = 3


class ModelNotAvailableError(LookupError):
    """The model is known but its weights are not on this machine."""


@dataclass(frozen=True)
class ResolvedModel:
    path: Path
    model_id: str
    card: ModelCard | None

    @property
    def default_k(self) -> int:
        card_mtp = self.card.native_mtp if self.card else None
        return card_mtp.default_k if card_mtp else UNCARDED_DEFAULT_K

    @property
    def max_k(self) -> int:
        card_mtp = self.card.native_mtp if self.card else None
        return card_mtp.max_k if card_mtp else UNCARDED_MAX_K

    @property
    def head_source_repo(self) -> str | None:
        card_mtp = self.card.native_mtp if self.card else None
        return card_mtp.source_repo if card_mtp else None


def local_path(card: ModelCard) -> Path | None:
    """Where a card's weights are on this machine, if they are."""
    if card.bundled:
        path = bundled_model_dir(card.bundled)
        return path if (path / "config.json").is_file() else None
    assert card.repo is not None
    return hf_cache_path(card.repo)


def hf_cache_path(repo: str) -> Path | None:
    """A complete snapshot of ``repo`` in the Hugging Face cache, without touching the network
    (``hf_cache.cached_snapshot``: a half-downloaded snapshot is not one)."""
    return cached_snapshot(repo)


def resolve_model(ref: str | None, catalog: Catalog | None = None, *, allow_paths: bool = True) -> ResolvedModel:
    """Resolve ``ref``: None -> the bundled default model; a directory -> itself (``allow_paths``, for
    local users; never for network clients); else a card id or repo, or a repo in the HF cache."""
    catalog = catalog if catalog is not None else load_catalog()
    if ref is None:
        ref = DEFAULT_MODEL
    if allow_paths:
        try:
            candidate = Path(ref).expanduser()
        except RuntimeError:  # "~user" for a user this machine does not have: not a directory
            candidate = Path(ref)
        if candidate.is_dir():
            return ResolvedModel(candidate.resolve(), candidate.resolve().name, None)
    try:
        card = catalog.get(ref)
    except UnknownModelError:
        if re.fullmatch(REPO_PATTERN, ref) and (path := hf_cache_path(ref)) is not None:
            return ResolvedModel(path, ref, None)
        raise UnknownModelError(ref, catalog.suggest(ref)) from None
    path = local_path(card)
    if path is None:
        if card.bundled:
            raise ModelNotAvailableError(
                f"{card.id} is bundled with exo but its files are missing from this installation "
                f"(expected in {bundled_model_dir(card.bundled)}); reinstall exo"
            )
        raise ModelNotAvailableError(
            f"{card.id} ({card.repo}) is not downloaded on this machine. Download it with "
            f"`exo pull {card.id}` (or `huggingface-cli download {card.repo}`: it lands in the Hugging Face "
            "cache, where exo looks) or pass the path of a local checkout"
        )
    return ResolvedModel(path, card.id, card)
