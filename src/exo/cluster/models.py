"""The models whose weights are on this node's disk, as a node tells its peers (for placement).

A model is on this node when the catalog finds its files (the bundled models, complete snapshots in
the Hugging Face cache) or when ``exo serve --model DIR`` registered a directory. Scanning the disk
takes a moment, so ``available()`` keeps the last scan for ``RESCAN_S``.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from exo.cards import Catalog
from exo.engine import ResolvedModel
from exo.engine.loader import checkpoint_parts, read_config
from exo.engine.resolve import local_path, resolve_model
from exo.engine.sharding import tensor_node_counts
from exo.wire.proto_gen import node_pb2 as pb

log = logging.getLogger(__name__)

RESCAN_S = 30.0


class LocalModels:
    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self._registered: dict[str, ResolvedModel] = {}
        self._lock = threading.Lock()
        self._scan: tuple[float, list[pb.ModelAvailability]] | None = None

    def register(self, resolved: ResolvedModel) -> str:
        with self._lock:
            self._registered[resolved.model_id] = resolved
            self._scan = None
        return resolved.model_id

    def rescan(self) -> None:
        """Forget the last scan (a download just completed): the next ``available()`` reads the disk."""
        with self._lock:
            self._scan = None

    def registered(self) -> list[ResolvedModel]:
        with self._lock:
            return list(self._registered.values())

    def resolve(self, ref: str) -> ResolvedModel:
        """A model reference from the network: a registered id, a card id or repo; never a path."""
        with self._lock:
            if ref in self._registered:
                return self._registered[ref]
        resolved = resolve_model(ref, self.catalog, allow_paths=False)
        with self._lock:
            return self._registered.get(resolved.model_id, resolved)

    def available(self) -> list[pb.ModelAvailability]:
        """Every model on this disk with its size (cached; may read the disk)."""
        with self._lock:
            if self._scan is not None and time.monotonic() - self._scan[0] < RESCAN_S:
                return list(self._scan[1])
        found: dict[str, ResolvedModel] = {r.model_id: r for r in self.registered()}
        for card in self.catalog.cards:
            if card.id not in found and (path := local_path(card)) is not None:
                found[card.id] = ResolvedModel(path, card.id, card)
        out = [availability(r) for r in found.values()]
        with self._lock:
            self._scan = (time.monotonic(), out)
        return list(out)


def weights_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors") if f.is_file())


def availability(resolved: ResolvedModel) -> pb.ModelAvailability:
    """What placement needs to size a model: weights on disk, KV bytes per token, context, layers, and
    what each pipeline stage would hold (from the shards' headers)."""
    card = resolved.card
    size = weights_bytes(resolved.path)
    try:
        config = read_config(resolved.path)
    except Exception:  # noqa: BLE001 - a broken directory is still listed; loading it says what is wrong
        config = {}
    text = config.get("text_config", config)
    if card is not None:
        kv = card.kv_bytes_per_token() if card.head_dim is not None else 0
        out = pb.ModelAvailability(
            model_id=resolved.model_id,
            weights_bytes=size or card.storage_bytes,
            kv_bytes_per_token=kv,
            context_length=card.context_length,
            n_layers=card.n_layers,
            full_attention_interval=card.full_attention_interval,
        )
    else:
        layers = int(text.get("num_hidden_layers") or 0)
        interval = int(text.get("full_attention_interval") or 4)
        heads = int(text.get("num_key_value_heads") or 0)
        head_dim = int(text.get("head_dim") or 0)
        out = pb.ModelAvailability(
            model_id=resolved.model_id,
            weights_bytes=size,
            kv_bytes_per_token=2 * (layers // interval) * heads * head_dim * 2,
            context_length=int(text.get("max_position_embeddings") or 0),
            n_layers=layers,
            full_attention_interval=interval,
        )
    if size and out.n_layers:
        try:
            parts = checkpoint_parts(resolved.path, out.n_layers)
        except Exception:  # noqa: BLE001 - sizes are a refinement: placement spreads weights evenly without
            log.debug("no per-layer sizes for %s", resolved.path, exc_info=True)
        else:
            out.layer_bytes.extend(parts.layer_bytes)
            out.embed_bytes, out.output_bytes, out.mtp_bytes = parts.embed_bytes, parts.output_bytes, parts.mtp_bytes
            # A step reads the layers (an MoE's routed experts only), one embedding row, and the output.
            experts, top_k = int(text.get("num_experts") or 0), int(text.get("num_experts_per_tok") or 0)
            unread = parts.expert_bytes * (1 - min(1.0, top_k / experts)) if experts else 0.0
            tied = bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings")))  # the table is the lm_head
            out.active_bytes = int(sum(parts.layer_bytes) - unread + parts.output_bytes + (parts.embed_bytes if tied else 0))
    if config:
        out.tensor_node_counts.extend(tensor_node_counts(config))
        out.tensor_checked = True
    return out
