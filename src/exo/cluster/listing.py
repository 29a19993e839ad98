"""``GET /v1/models`` rows: loaded models first, then local ones (bundled first), then the catalog's rest.

Shared by the single-machine service and the cluster's: they differ only in what "loaded" and "local"
mean (this process, or anywhere in the cluster).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exo.cards import Catalog, ModelCard
from exo.cluster.service import ModelInfo, ModelStatus, NativeMTPInfo
from exo.engine import ResolvedModel
from exo.engine.loader import inspect_head, missing_head_reason, read_config
from exo.engine.resolve import local_path


@dataclass(frozen=True)
class LoadedFacts:
    """What a loaded model knows about itself: its context length and why it has no head (None: it has)."""

    context_length: int | None
    mtp_reason: str | None


def model_rows(
    catalog: Catalog,
    loaded: Iterable[ModelInfo],
    registered: Iterable[ResolvedModel],
    switch: tuple[bool, str],
    *,
    elsewhere: dict[str, ModelCard | None] | None = None,
) -> list[ModelInfo]:
    """``loaded``: rows already built, most recent first. ``registered``: directories served by id.
    ``elsewhere``: models on another node's disk (card, or None for a directory registered there)."""
    out = list(loaded)
    seen = {info.id for info in out}
    elsewhere = elsewhere or {}
    local: list[ModelInfo] = []
    remote: list[ModelInfo] = []
    cards = list(catalog.cards)

    def card_row(card: ModelCard) -> None:
        if card.id in seen:
            return
        seen.add(card.id)
        path = local_path(card)
        if path is not None:
            local.append(model_info(ResolvedModel(path, card.id, card), "local", switch))
        elif card.id in elsewhere:
            local.append(card_info(card, catalog, "local", None))
        else:
            reason = f"not on this machine: download {card.repo}" if card.repo else "not on this machine"
            remote.append(card_info(card, catalog, "remote", reason))

    for card in cards:
        if card.bundled:
            card_row(card)
    for resolved in registered:
        if resolved.model_id not in seen:
            seen.add(resolved.model_id)
            local.append(model_info(resolved, "local", switch))
    for model_id, card in elsewhere.items():
        if card is None and model_id not in seen:
            seen.add(model_id)
            local.append(
                ModelInfo(model_id, "local", "local", 0, NativeMTPInfo(None, None, False, "not loaded yet"), name=model_id)
            )
    for card in cards:
        if not card.bundled:
            card_row(card)
    return out + local + remote


def card_info(card: ModelCard, catalog: Catalog, status: ModelStatus, reason: str | None) -> ModelInfo:
    mtp = card.native_mtp
    return ModelInfo(
        id=card.id,
        status=status,
        owned_by=owner(card),
        created=mtime(catalog.paths.get(card.id)),
        native_mtp=NativeMTPInfo(
            default_k=mtp.default_k if mtp else None,
            max_k=mtp.max_k if mtp else None,
            available=reason is None and mtp is not None,
            reason=reason if reason is not None or mtp is not None else f"{card.id} has no MTP head",
        ),
        name=card.name,
        arch=card.arch,
        context_length=card.context_length,
    )


def model_info(
    resolved: ResolvedModel, status: ModelStatus, switch: tuple[bool, str], loaded: LoadedFacts | None = None
) -> ModelInfo:
    card = resolved.card
    config: dict[str, Any] = {}
    if card is None:
        try:
            config = read_config(resolved.path)
        except Exception:  # a broken directory still gets listed; loading it says what is wrong
            config = {}
    text_config = config.get("text_config", config)
    context = loaded.context_length if loaded is not None else (
        card.context_length if card else text_config.get("max_position_embeddings")
    )
    return ModelInfo(
        id=resolved.model_id,
        status=status,
        owned_by=owner(card) if card else "local",
        created=mtime(resolved.path / "config.json"),
        native_mtp=mtp_info(resolved, switch, loaded),
        name=card.name if card else resolved.model_id,
        arch=card.arch if card else config.get("model_type"),
        context_length=int(context) if isinstance(context, int) else None,
    )


def mtp_info(resolved: ResolvedModel, switch: tuple[bool, str], loaded: LoadedFacts | None) -> NativeMTPInfo:
    reason: str | None
    enabled, disabled_reason = switch
    if not enabled:
        reason = disabled_reason
    elif loaded is not None:
        reason = loaded.mtp_reason
    else:
        try:
            head = inspect_head(resolved.path)
        except Exception as e:  # headers only; a malformed head is reported, not fatal
            reason = f"the MTP head cannot be read: {e}"
        else:
            if head.present:
                reason = None
            elif head.declared_layers:
                reason = missing_head_reason(resolved.path, head.declared_layers, resolved.head_source_repo)
            else:
                reason = f"{resolved.model_id} has no MTP head"
    return NativeMTPInfo(resolved.default_k, resolved.max_k, reason is None, reason)


def owner(card: ModelCard) -> str:
    if card.bundled:
        return "exo"
    return card.repo.split("/", 1)[0] if card.repo else "exo"


def mtime(path: Path | None) -> int:
    try:
        return int(path.stat().st_mtime) if path is not None else 0
    except OSError:
        return 0
