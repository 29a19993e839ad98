"""Model cards: one declarative TOML file per model (`model_cards/`), validated and looked up here."""

from exo.cards.catalog import (
    AmbiguousModelError,
    Catalog,
    UnknownModelError,
    bundled_cards_dir,
    bundled_model_dir,
    load_card,
    load_catalog,
)
from exo.cards.schema import CardError, ModelCard, NativeMTPCard

__all__ = [
    "AmbiguousModelError",
    "CardError",
    "Catalog",
    "ModelCard",
    "NativeMTPCard",
    "UnknownModelError",
    "bundled_cards_dir",
    "bundled_model_dir",
    "load_card",
    "load_catalog",
]
