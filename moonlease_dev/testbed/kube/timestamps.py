"""Timestamps as the API server writes them (RFC 3339, UTC, seconds)."""

from __future__ import annotations

import datetime


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
