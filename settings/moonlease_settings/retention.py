"""The retention settings a connector runs: which of the save-side retention pieces are on.

Pure (the standard library only). The connector's config (`moonlease_settings.config`) builds
them from its `mooncake_retention_*` keys and the operator from a policy's connector spec; what
each piece does to a save is decided in the connector (`moonlease_connector.core.retention`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RetentionSettings:
    """The retention pieces a connector runs (all off: upstream's saves)."""

    pin: bool = False
    skip: bool = False
    retry: bool = False
    evict: bool = False
    #: With ``evict``: the share of the store's capacity saves keep it under — the master's
    #: ``eviction_high_watermark_ratio`` (Mooncake's default 0.9).
    evict_watermark: float = 0.9

    def __post_init__(self) -> None:
        if not 0 < self.evict_watermark <= 1:
            raise ValueError("evict_watermark must be in (0, 1]")

    @property
    def active(self) -> bool:
        """Any piece on (the connector then runs its retention send thread)."""
        return self.pin or self.skip or self.retry or self.evict

    @property
    def plans_saves(self) -> bool:
        """A piece that decides chunk by chunk (`moonlease_connector.core.retention.plan_save_retention`) is on."""
        return self.pin or self.skip
