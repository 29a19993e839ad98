"""ClusterModelService's on-demand placement, in process (no daemon started): the race between placement,
which says another instance of the model is live, and the lookup of that instance, which no longer finds it
(its node left or it was deleted between the two looks)."""

from __future__ import annotations

import asyncio

import pytest

from exo.cluster import placement as pl
from exo.cluster.orchestration import PLACE_ATTEMPTS, ClusterModelService
from exo.cluster.service import NodeUnavailableError
from exo.settings import load_settings


@pytest.fixture
def service(tmp_path) -> ClusterModelService:
    return ClusterModelService(load_settings(env={"EXO_HOME": str(tmp_path)}))


def _phantom(service: ClusterModelService, looks: int | None):
    """``existing()`` as placement saw it: an instance of exo-demo that the cluster view (``_find``) lacks,
    for the first ``looks`` looks (None: for good), then nothing."""
    seen = []

    def existing(excluding: frozenset[str] = frozenset()) -> list[pl.ExistingInstance]:
        seen.append(1)
        if looks is not None and len(seen) > looks:
            return []
        return [pl.ExistingInstance("vanished", "exo-demo", service.node_id, "ready")]

    service.existing = existing  # type: ignore[method-assign]
    return seen


def test_an_instance_that_stays_unfindable_is_a_503_not_an_unbound_plan(service):
    seen = _phantom(service, None)
    with pytest.raises(NodeUnavailableError, match="instance vanished .* cannot be found"):
        asyncio.run(service._place_and_wait("exo-demo", None))
    assert len(seen) == PLACE_ATTEMPTS


def test_an_instance_that_went_away_is_placed_anew(service):
    seen = _phantom(service, 1)
    # Placed anew: this node (not started) has scanned no model yet, so placement itself answers.
    with pytest.raises(pl.ModelNotOnDiskError):
        asyncio.run(service._place_and_wait("exo-demo", None))
    assert len(seen) == 2
