"""The policy status as stored in the API: read tolerantly, dumped as a merge patch. Pure.

What the status says is decided by `core.rollout.plan_reconcile` (including the verdict on the
spec: an invalid one gets phase Invalid and one warning event per generation); this module only
converts between the model and the JSON the API server keeps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moonlease_operator.api import PolicyStatus


def read_status(raw: Mapping[str, Any] | None) -> PolicyStatus:
    """The stored status, or an empty one if it is absent or unreadable (we own it: rewrite it)."""
    try:
        return PolicyStatus.model_validate(dict(raw or {}))
    except ValueError:
        return PolicyStatus()


def dump_status(status: PolicyStatus) -> dict[str, Any]:
    """The status as the JSON to merge-patch into `.status`.

    Unset top-level fields are null, so the merge patch removes stale ones; nested unset fields
    are left out (lists are replaced whole by a merge patch anyway).
    """
    data = status.model_dump(mode="json", by_alias=True, exclude_none=True)
    for name, info in PolicyStatus.model_fields.items():
        data.setdefault(info.alias or name, None)
    return data
