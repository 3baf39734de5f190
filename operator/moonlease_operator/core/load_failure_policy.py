"""Which vLLM workloads fail a request when a store load fails. Pure.

vLLM decides what a failed KV load does (`kv_load_failure_policy` in `--kv-transfer-config`):
under `recompute` it recomputes the blocks the connector reports as not loaded; under `fail`
(vLLM's default) it ends the request with `finish_reason "error"`. A connector can only report
blocks (or requests) whose load failed, and vLLM routes both through that policy, so the
connector cannot make a failed, expired or late load recompute by itself — a master frozen
between a lookup hit and its load then fails a request the engine could have computed. The
operator does not rewrite this vLLM setting (it would restart pods for a choice that is the
workload owner's); it warns about each workload that does not set `recompute`
(`LoadFailuresFailRequests` condition and a Warning event).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from moonlease_operator.api import Condition, ConditionType, Reason
from moonlease_operator.core.conditions import set_warning_condition
from moonlease_operator.core.connector_delivery import startup_sources
from moonlease_operator.core.events import EventNote
from moonlease_operator.core.workload_args import describe_object, find_container

POLICY_KEY = "kv_load_failure_policy"
RECOMPUTE = "recompute"
#: The entry to add to the workload's `--kv-transfer-config` JSON.
LINE_TO_ADD = f'"{POLICY_KEY}": "{RECOMPUTE}"'


def load_failure_policy(obj: Mapping[str, Any], container: str | None) -> str | None:
    """The `kv_load_failure_policy` the workload's vLLM command starts with (None: its
    `--kv-transfer-config` does not set it, or there is none — vLLM then uses "fail")."""
    doc, _ = startup_sources(find_container(obj, container) or {})
    value = doc.get(POLICY_KEY)
    return None if value is None else str(value)


def load_failure_warning(obj: Mapping[str, Any], container: str | None) -> str | None:
    """A message naming the workload and the line to add, when a failed store load would fail
    its requests; None when it recomputes them."""
    policy = load_failure_policy(obj, container)
    if policy == RECOMPUTE:
        return None
    said = ("does not set kv_load_failure_policy (vLLM's default is 'fail')" if policy is None
            else f"sets kv_load_failure_policy {policy!r}")
    return (f"{describe_object(obj)} {said}: a store load that fails or is given up (a master frozen"
            f" between a lookup hit and its load) ends the request with finish_reason error instead of"
            f" being recomputed; add {LINE_TO_ADD} to its --kv-transfer-config")


def set_load_failure_condition(conditions: Sequence[Condition], warnings: Sequence[str], *, listed: int,
                               generation: int | None,
                               now: datetime.datetime) -> tuple[list[Condition], EventNote | None]:
    """`LoadFailuresFailRequests`: True while some vLLM workload fails requests on a failed
    load (the first `listed` named, then a count), False once none does; absent for a policy
    whose workloads never did. With it, a Warning event when the True message is new."""
    more = f"; and {len(warnings) - listed} more" if len(warnings) > listed else ""
    return set_warning_condition(conditions, type_=ConditionType.LOAD_FAILURES_FAIL_REQUESTS.value,
                                 reason=Reason.LOAD_FAILURE_POLICY_FAIL.value,
                                 message="; ".join(warnings[:listed]) + more if warnings else None,
                                 cleared=f"Every vLLM workload sets {LINE_TO_ADD}", generation=generation, now=now)
