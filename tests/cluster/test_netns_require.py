"""The root-only and multicast tests (network namespaces, mDNS, network-cut failover) skip with their reason
on a developer's machine and fail under CI, where a silent skip would hide them (as the dashboard's do)."""

from __future__ import annotations

import pytest

from .netns import require


def test_a_missing_capability_skips_for_a_developer_and_fails_under_ci(monkeypatch):
    reason = "network namespaces need root (ip netns add)"
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"need root \(ip netns add\)$"):
        require(reason)
    monkeypatch.setenv("CI", "1")
    with pytest.raises(pytest.fail.Exception, match="CI must run this test"):
        require(reason)
    require(None)  # the capability is there: the test runs
