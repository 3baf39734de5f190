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

    Unset fields are null at every level of nested objects, so the merge patch removes stale
    ones: a fresh A/B test (a retry, a new configuration) must not inherit the previous test's
    samples, analysis or last reading (issue 26: it did, being decided after one interval and
    skipping its warm-up). Inside lists nothing is nulled: a merge patch replaces a list whole,
    and would store the nulls.
    """
    full = status.model_dump(mode="json", by_alias=True)
    data = status.model_dump(mode="json", by_alias=True, exclude_none=True)
    _null_unset(full, data)
    return data


def _null_unset(full: dict[str, Any], data: dict[str, Any]) -> None:
    """Set every key of `full` (a dump with the unset fields) that `data` lacks to None,
    recursing into objects (not lists)."""
    for key, value in full.items():
        if key not in data:
            data[key] = None
        elif isinstance(value, dict) and isinstance(data[key], dict):
            _null_unset(value, data[key])
