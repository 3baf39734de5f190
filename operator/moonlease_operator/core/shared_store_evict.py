"""Whether `connector.retentionEvict` runs on a store that several engines share. Pure.

Evict makes room by removing the keys least recently used — by *this engine's* saves and loads,
unless the engine names a fleet order service (``mooncake_fleet_order_url`` in its
`--kv-transfer-config`: one order for every engine of the store). On its own order, with several
engines on one store, some of the keys it removes are what other engines continue and load. It
leaves a prompt's shared prefix alone, which removed most of the loss, not all (4 prefill + 1
decode engines at capacity 0.05: −2.1 points beside skip, −3.2 beside junctions, pin and retry;
docs/benchmarks.md, "Per-engine evict lost on a fleet"). A connector cannot see the other
engines, but the operator can: it warns (`EvictOnSharedStore` condition and a Warning event)
when the policy's targets together run more than one engine and some of them, or all of them
but not on one service, order keys on their own. A warning, not a refusal: a person may have
reasons (a store the other engines only read), and the setting is theirs.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from moonlease_operator.api import Condition, ConditionType, Reason
from moonlease_operator.core.conditions import set_warning_condition
from moonlease_operator.core.events import EventNote
from moonlease_operator.core.workload_args import describe_object, find_container, kv_doc

#: The connector key naming the fleet order service (`moonlease_settings.config`).
FLEET_ORDER_KEY = "mooncake_fleet_order_url"

BENCHMARK_PAGE = "docs/benchmarks.md#choosing-a-retention-policy"


def engine_count(obj: Mapping[str, Any]) -> int:
    """The vLLM engines a Deployment or StatefulSet runs: its `spec.replicas` (the API's default 1
    when unset)."""
    replicas = (obj.get("spec") or {}).get("replicas")
    return 1 if replicas is None else max(int(replicas), 0)


def fleet_order_url(obj: Mapping[str, Any], container: str | None = None) -> str | None:
    """The fleet order service a workload's engines name in their `--kv-transfer-config`, if any."""
    doc = kv_doc(find_container(obj, container)) or {}
    extra = doc.get("kv_connector_extra_config")
    url = extra.get(FLEET_ORDER_KEY) if isinstance(extra, Mapping) else None
    return url if isinstance(url, str) and url else None


def shared_store_evict_warning(evict: bool, workloads: Sequence[Mapping[str, Any]], *, listed: int,
                               containers: Sequence[str | None] | None = None) -> str | None:
    """A message naming the engines that share the store, when evict is on, there is more than
    one, and they do not all order keys on one fleet order service; None otherwise.
    `workloads`: every vLLM workload of the policy (both A/B arms); `containers`: the vLLM
    container of each (None: the first)."""
    names = list(containers) if containers is not None else [None] * len(workloads)
    counts = [(describe_object(obj), engine_count(obj), fleet_order_url(obj, name))
              for obj, name in zip(workloads, names, strict=True)]
    engines = sum(n for _, n, _ in counts)
    if not evict or engines <= 1:
        return None
    services = {url for _, n, url in counts if n > 0}
    if len(services) == 1 and None not in services:
        return None  # one order for every engine: what the fleet order service is for
    named = ", ".join(f"{what} {n}" for what, n, _ in counts[:listed])
    more = f" and {len(counts) - listed} more workloads" if len(counts) > listed else ""
    if None not in services:
        return (f"connector.retentionEvict is on and {engines} vLLM engines share the store ({named}{more}),"
                f" but they name {len(services)} different fleet order services ({FLEET_ORDER_KEY}): each"
                f" removes the keys its own service saw least recently. Give every engine of the store the"
                f" same service")
    alone = [what for what, n, url in counts if n > 0 and url is None]
    return (f"connector.retentionEvict is on and {engines} vLLM engines share the store ({named}{more}):"
            f" each engine without a fleet order service ({', '.join(alone[:listed])}) removes the keys its own"
            f" saves and loads touched least recently, some of which the other engines continue and load (on a"
            f" 4 prefill + 1 decode fleet it cost 1.8 points of prompt-token hit rate beside retentionSkip, 3.3"
            f" beside junction retention, pin and retry; {BENCHMARK_PAGE}). Give every engine the fleet order"
            f" service ({FLEET_ORDER_KEY}; the chart's fleetOrder), turn evict off, or keep it only where one"
            f" engine writes the store")


def set_shared_store_evict_condition(conditions: Sequence[Condition], warning: str | None, *,
                                     generation: int | None,
                                     now: datetime.datetime) -> tuple[list[Condition], EventNote | None]:
    """`EvictOnSharedStore`: True while evict runs beside other engines, False once it does not;
    absent for a policy that never did. A Warning event when the True message is new."""
    return set_warning_condition(conditions, type_=ConditionType.EVICT_ON_SHARED_STORE.value,
                                 reason=Reason.EVICT_ON_SHARED_STORE.value, message=warning,
                                 cleared="connector.retentionEvict is off, one engine writes the store, or every"
                                         " engine orders keys on one fleet order service",
                                 generation=generation, now=now)
