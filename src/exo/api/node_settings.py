"""The settings a client may read and change through ``GET``/``PUT /v1/settings``.

A change applies from the next request on and is written to the node's settings file
(``exo.settings.persist_settings``). At start-up the usual precedence decides (defaults < file <
``EXO_*`` environment < CLI); an environment variable that won says so in ``env_overrides``, since it
wins again at the next start whatever PUT wrote. One that the app starting exo set from its own saved
choice (``EXO_<FIELD>_FROM_APP=1``, source "app") is no override: the app passes PUT's value next time.
"""

from __future__ import annotations

from typing import Any

from exo.cluster.service import ModelService
from exo.settings import Settings, env_var, persist_settings

WRITABLE_SETTINGS = ("native_mtp_enabled",)
_SOURCE_WORDS = {
    "default": "the default",
    "file": "the node's settings file",
    "env": "EXO_NATIVE_MTP_ENABLED=0",
    "app": "the exo app's saved choice",
    "cli": "the command line",
    "api": "PUT /v1/settings",
}


class NodeSettings:
    """The settings a client may change (``native_mtp_enabled``): value, where it came from, persistence."""

    def __init__(self, settings: Settings, service: ModelService) -> None:
        self.settings = settings
        self.service = service
        self.values = {name: getattr(settings, name) for name in WRITABLE_SETTINGS}
        self.sources = {name: settings.source(name) for name in WRITABLE_SETTINGS}
        # An EXO_* variable that won at start-up wins again at the next start, whatever PUT writes.
        self.env_overrides = {n: env_var(n) for n in WRITABLE_SETTINGS if self.sources[n] == "env"}
        self._apply()

    def _apply(self) -> None:
        source = _SOURCE_WORDS.get(self.sources["native_mtp_enabled"], "settings")
        self.service.set_native_mtp(self.values["native_mtp_enabled"], f"native MTP is disabled ({source})")

    def view(self) -> dict[str, Any]:
        return {
            "object": "settings",
            **self.values,
            "sources": dict(self.sources),
            "env_overrides": dict(self.env_overrides),
            "settings_file": str(self.settings.settings_file),
        }

    def update(self, changes: dict[str, Any]) -> None:
        """Blocking (writes the settings file); the change applies from the next request on."""
        persist_settings(self.settings.home, changes)
        self.values.update(changes)
        self.sources.update({name: "api" for name in changes})
        self._apply()
