"""Events the planners ask the handlers to post on the policy. Pure."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EventNote:
    """An event to post on the policy."""

    type: str  # "Normal" | "Warning"
    reason: str
    message: str
