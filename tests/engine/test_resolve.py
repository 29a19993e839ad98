"""Model references: what a local user may type (paths too) and what a network client may name."""

from __future__ import annotations

import pytest

from exo.cards import UnknownModelError, load_catalog
from exo.engine import resolve_model


@pytest.mark.parametrize("allow_paths", [True, False])
def test_a_home_of_an_unknown_user_is_an_unknown_model(allow_paths, tmp_path):
    catalog = load_catalog(home=tmp_path)
    with pytest.raises(UnknownModelError):
        resolve_model("~no-such-user-exo/model", catalog, allow_paths=allow_paths)


def test_directories_only_for_local_users(checkpoint, tmp_path):
    model = checkpoint("qwen3_5")
    catalog = load_catalog(home=tmp_path)
    assert resolve_model(str(model), catalog).path == model.resolve()
    with pytest.raises(UnknownModelError):
        resolve_model(str(model), catalog, allow_paths=False)
