"""Whether `connector.retentionEvict` runs on a store that several engines share. Pure.

Evict makes room by removing the keys *this engine's* saves and loads touched least recently: with
several engines on one store, some of those are what other engines continue and load. It leaves
a prompt's shared prefix alone, which removed most of the loss, not all (4 prefill + 1 decode
engines at capacity 0.05: −2.1 points beside skip, −3.2 beside junctions, pin and retry;
docs/benchmarks.md, "Per-engine evict lost on a fleet"). A connector cannot see the other engines, but the operator can: it
warns (`EvictOnSharedStore` condition and a Warning event) when the policy's targets together
run more than one engine. A warning, not a refusal: a person may have reasons (a store the
other engines only read), and the setting is theirs.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from moonlease_operator.api import Condition, ConditionType, Reason
from moonlease_operator.core.conditions import set_warning_condition
from moonlease_operator.core.events import EventNote
from moonlease_operator.core.workload_args import describe_object

BENCHMARK_PAGE = "docs/benchmarks.md#choosing-a-retention-policy"


def engine_count(obj: Mapping[str, Any]) -> int:
    """The vLLM engines a Deployment or StatefulSet runs: its `spec.replicas` (the API's default 1
    when unset)."""
    replicas = (obj.get("spec") or {}).get("replicas")
    return 1 if replicas is None else max(int(replicas), 0)


def shared_store_evict_warning(evict: bool, workloads: Sequence[Mapping[str, Any]], *, listed: int) -> str | None:
    """A message naming the engines that share the store, when evict is on and there is more
    than one; None otherwise. `workloads`: every vLLM workload of the policy (both A/B arms)."""
    counts = [(describe_object(obj), engine_count(obj)) for obj in workloads]
    engines = sum(n for _, n in counts)
    if not evict or engines <= 1:
        return None
    named = ", ".join(f"{what} {n}" for what, n in counts[:listed])
    more = f" and {len(counts) - listed} more workloads" if len(counts) > listed else ""
    return (f"connector.retentionEvict is on and {engines} vLLM engines share the store ({named}{more}):"
            f" each engine removes the keys its own saves and loads touched least recently, some of which the"
            f" other engines continue and load (on a 4 prefill + 1 decode fleet it cost 1.8 points of"
            f" prompt-token hit rate beside retentionSkip, 3.3 beside junction retention, pin and retry;"
            f" {BENCHMARK_PAGE}). Turn it off, or keep it"
            f" only where one engine writes the store")


def set_shared_store_evict_condition(conditions: Sequence[Condition], warning: str | None, *,
                                     generation: int | None,
                                     now: datetime.datetime) -> tuple[list[Condition], EventNote | None]:
    """`EvictOnSharedStore`: True while evict runs beside other engines, False once it does not;
    absent for a policy that never did. A Warning event when the True message is new."""
    return set_warning_condition(conditions, type_=ConditionType.EVICT_ON_SHARED_STORE.value,
                                 reason=Reason.EVICT_ON_SHARED_STORE.value, message=warning,
                                 cleared="connector.retentionEvict is off, or one engine writes the store",
                                 generation=generation, now=now)
