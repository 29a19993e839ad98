"""How the generation loop runs the backbone: here (``LocalForward``) or through a pipeline of stages on
other processes and machines (``exo.engine.pipeline.PipelineForward``). The loop in ``generate.py`` is the
same for both: it asks for the post-norm hiddens of some rows, and after a verify call says how many
rows to keep. Everything speculative (drafting, acceptance, the head's cache) stays in the loop, on the
process that holds the last stage.
"""

from __future__ import annotations

from typing import Any, Protocol

import mlx.core as mx

from .models.backbone import SpeculativeBackbone
from .models.layers import MoEVerifyMode, RollbackArraysCache

# The MoE verify mode on the wire of a pipeline (a header field): 0 is "not a verify call".
MOE_MODES: tuple[MoEVerifyMode, ...] = ("route_locked", "batched", "safe")


class Forward(Protocol):
    """The backbone as the generation loop sees it."""

    stages: int  # 1 on a single node

    def new_cache(self) -> list[Any]:
        """Fresh caches for a request (this process's layers)."""
        ...

    def hidden(self, tokens: mx.array, cache: list[Any], *, verify: bool = False) -> mx.array:
        """Post-final-norm hiddens [1, T, H] of ``tokens`` [1, T]. ``verify``: GatedDeltaNet layers record
        their state after every row and MoE routing is locked to decode's, so ``rollback`` can keep any
        prefix of the rows."""
        ...

    def rollback(self, cache: list[Any], rows: int, kept: int) -> None:
        """After a verify call of ``rows`` rows, keep the first ``kept`` (attention KV trimmed, GatedDeltaNet
        state committed), everywhere the backbone's layers are."""
        ...

    def end(self, cache: list[Any]) -> None:
        """The request is over (finished, cancelled or failed): nothing of it may survive anywhere."""
        ...


def verify_call(model: SpeculativeBackbone, cache: list[Any], moe_verify: MoEVerifyMode | None):
    """Context for one verify call on a model's (stage's) layers: recording on, MoE routing locked."""
    return _VerifyCall(model, cache, moe_verify)


class _VerifyCall:
    def __init__(self, model: SpeculativeBackbone, cache: list[Any], moe_verify: MoEVerifyMode | None) -> None:
        self.model, self.cache, self.moe_verify = model, cache, moe_verify

    def __enter__(self) -> None:
        for c in self.cache:
            if isinstance(c, RollbackArraysCache):
                c.recording = True
        self.model.set_moe_verify_mode(self.moe_verify)

    def __exit__(self, *exc: object) -> None:
        self.model.set_moe_verify_mode(None)
        for c in self.cache:
            if isinstance(c, RollbackArraysCache):
                c.recording = False


def keep_rows(cache: list[Any], rows: int, kept: int) -> None:
    """Roll a stage's caches back to the first ``kept`` rows of their last verify call of ``rows`` rows."""
    for c in cache:
        if isinstance(c, RollbackArraysCache):
            c.commit(kept)
        else:
            c.trim(rows - kept)


class LocalForward:
    """The whole backbone in this process."""

    stages = 1

    def __init__(self, model: SpeculativeBackbone, moe_verify: MoEVerifyMode = "route_locked") -> None:
        self.model = model
        self.moe_verify = moe_verify

    def new_cache(self) -> list[Any]:
        return self.model.make_cache()

    def hidden(self, tokens: mx.array, cache: list[Any], *, verify: bool = False) -> mx.array:
        if not verify:
            return self.model.stage_hidden(tokens, cache)
        with verify_call(self.model, cache, self.moe_verify):
            return self.model.stage_hidden(tokens, cache)

    def rollback(self, cache: list[Any], rows: int, kept: int) -> None:
        keep_rows(cache, rows, kept)

    def end(self, cache: list[Any]) -> None:
        """Nothing to do: the caches die with the request."""
