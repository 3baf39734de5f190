"""LIST pagination (`limit` / `continue`) as the API server does it, pure.

A list with `limit` returns at most that many items, sorted by namespace and name (etcd's key
order), with `metadata.continue` and `metadata.remainingItemCount` when more remain. Every page
of one list shows the objects as they were at the first page's resourceVersion. The token is
opaque to clients: base64 of `{"rv": <list resourceVersion>, "start": <key after the last
item>}`, like the real one; a token whose resourceVersion was compacted answers 410 Expired.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

JsonObj = dict[str, Any]


@dataclass(frozen=True)
class ContinueToken:
    revision: int
    start: str  # the sort key of the first item of the next page

    def encode(self) -> str:
        raw = json.dumps({"v": "meta.k8s.io/v1", "rv": self.revision, "start": self.start}, separators=(",", ":"))
        return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_continue(token: str) -> ContinueToken:
    """Raises ValueError for a token this server did not write."""
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        data = json.loads(raw)
        return ContinueToken(int(data["rv"]), str(data["start"]))
    except (binascii.Error, ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise ValueError(f"continue key is not valid: {token!r}") from None


def sort_key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata", {})
    return f"{meta.get('namespace') or ''}/{meta.get('name', '')}"


def parse_limit(text: str | None) -> int | None:
    """`limit`: a positive integer, or absent / 0 for everything. Raises ValueError."""
    if not text:
        return None
    limit = int(text)
    if limit < 0:
        raise ValueError(f"limit: Invalid value: {limit}: must be greater than or equal to 0")
    return limit or None


@dataclass(frozen=True)
class Page:
    items: list[JsonObj]
    next_token: str | None
    remaining: int | None


def page(items: Sequence[JsonObj], *, revision: int, limit: int | None, start: str = "") -> Page:
    """The page of `items` (sorted by `sort_key`) from `start`, at most `limit` long."""
    ordered = [item for item in items if sort_key(item) >= start]
    if limit is None or len(ordered) <= limit:
        return Page(list(ordered), None, None)
    shown, rest = list(ordered[:limit]), ordered[limit:]
    return Page(shown, ContinueToken(revision, sort_key(rest[0])).encode(), len(rest))
