"""Connector telemetry through vLLM's own KV-connector stats path.

I/O adapter. Workers record into a stats object that vLLM carries to the front end, where the
Prometheus side below turns it into metrics on `vllm serve`'s /metrics, next to upstream's
`vllm:mooncake_store_operation_*` families (our store calls — `lookup_probe`, `lookup_lease` —
appear there under their operation label). Our own families:

- `vllm:moonlease_lookups_total{result, reason}`: lookups by outcome, misses by reason (the
  scheduler side records the `store_timeout` misses its lookup client answers by itself)
- `vllm:moonlease_lookup_rounds`: probe/lease rounds a lookup needed (selective lease retries)
- `vllm:moonlease_lookup_keys_total{kind="probed"|"leased"}`: keys a lookup probed and leased
- `vllm:moonlease_lookup_junctions_total`: shared-prefix junctions lookups returned (seed 004)
- `vllm:moonlease_junction_tail_keys_saved_total`: store keys saves wrote only because of a
  junction (tails the store already held, or whose block was freed, are not counted)
- `vllm:moonlease_retention_keys_total{decision="pinned"|"skipped"|"retried"|"removed"}`:
  Moonlease retention (issue 21): keys saves put soft-pinned, keys the save plan kept out of
  the store, keys stored by putting them again after the store refused them for lack of space,
  and keys retention `evict` removed (least recently used) to make room below the watermark
- `vllm:moonlease_fleet_order_errors_total{kind="failed_request"|"dropped_report"|"unanswered_take"|"invalid_operation"}`:
  retention evict on the fleet order service (`mooncake_fleet_order_url`) that could not reach
  it — requests that failed, reports dropped while it did not answer, takes that got no answer
  in time (evict then removed nothing and the master evicted instead), operations over the
  wire's limits (left out)
- `vllm:moonlease_handoff_waits_total{outcome="complete"|"timed_out"}` and
  `vllm:moonlease_handoff_wait_seconds`: decode requests whose prefill engine promised a save
  (`core.handoff`; scheduler side), by how the wait for it ended, and how long it took
- `vllm:moonlease_store_capability_info{mooncake_version, batch_probe_key, last_hit_only, lease_mode}`
- with a settings file: `vllm:moonlease_settings_info{lease_mode, junction_retention,
  settings_hash, source}` (what runs, value 1; the previous label set is removed on a switch)
  and `vllm:moonlease_settings_refusals_total{reason}`. These change with the next engine step;
  the connector's own settings endpoint (`adapters.settings_watcher`) shows them at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from prometheus_client import Counter, Gauge, Histogram

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats, PromMetric, PromMetricT
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.metrics import (
    MooncakeStoreConnectorStats,
    MooncakeStorePromMetrics,
)

from moonlease_connector.core.capabilities import StoreCapabilities
from moonlease_connector.core.handoff import HandoffOutcome
from moonlease_connector.core.live_settings import ActiveSettings, SwitchDecision
from moonlease_connector.core.lookup import LookupOutcome

#: Reserved keys in the stats' `data` dict; upstream's keys are store operation names.
LOOKUPS_KEY = "__moonlease_lookups__"
CAPABILITY_KEY = "__moonlease_capability__"
JUNCTION_TAILS_KEY = "__moonlease_junction_tails__"
RETENTION_KEY = "__moonlease_retention__"
SETTINGS_KEY = "__moonlease_settings__"
SETTINGS_REFUSALS_KEY = "__moonlease_settings_refusals__"
HANDOFF_KEY = "__moonlease_handoff__"
FLEET_ORDER_KEY = "__moonlease_fleet_order__"
_OURS = (LOOKUPS_KEY, CAPABILITY_KEY, JUNCTION_TAILS_KEY, RETENTION_KEY, SETTINGS_KEY, SETTINGS_REFUSALS_KEY,
         HANDOFF_KEY, FLEET_ORDER_KEY)
#: Records where only the latest counts (replaced, not appended, when stats aggregate).
_LATEST = (CAPABILITY_KEY, SETTINGS_KEY)


@dataclass
class MoonleaseConnectorStats(MooncakeStoreConnectorStats):
    """Upstream's per-operation records plus one record per lookup and the start-up capability."""

    def record_lookup(self, outcome: LookupOutcome) -> None:
        self.data.setdefault(LOOKUPS_KEY, []).append({
            "result": "hit" if outcome.miss_reason is None else "miss",
            "reason": "" if outcome.miss_reason is None else outcome.miss_reason.value,
            "rounds": outcome.rounds,
            "keys_probed": outcome.keys_probed,
            "keys_leased": outcome.keys_leased,
            "junctions": outcome.junctions,
        })

    def record_junction_tails(self, keys_written: int) -> None:
        self.data.setdefault(JUNCTION_TAILS_KEY, []).append({"keys": keys_written})

    def record_retention(self, decision: str, keys: int) -> None:
        self.data.setdefault(RETENTION_KEY, []).append({"decision": decision, "keys": keys})

    def record_fleet_order_trouble(self, kind: str, count: int) -> None:
        self.data.setdefault(FLEET_ORDER_KEY, []).append({"kind": kind, "count": count})

    def record_handoff(self, outcome: HandoffOutcome, waited_s: float) -> None:
        self.data.setdefault(HANDOFF_KEY, []).append({"outcome": outcome.value, "waited_s": waited_s})

    def record_capability(self, capability: StoreCapabilities, lease_mode: str) -> None:
        self.data[CAPABILITY_KEY] = [{
            "mooncake_version": capability.mooncake_version,
            "batch_probe_key": str(capability.batch_probe_key).lower(),
            "last_hit_only": str(capability.supports("LastHitOnly")).lower(),
            "lease_mode": lease_mode,
        }]

    def record_settings(self, active: ActiveSettings, decision: SwitchDecision | None) -> None:
        self.data[SETTINGS_KEY] = [{
            "lease_mode": active.config.lease_mode.value,
            "junction_retention": str(active.config.mooncake_junction_retention).lower(),
            "settings_hash": active.hash,
            "source": active.source.value,
        }]
        if decision is not None and decision.refusal is not None:
            self.data.setdefault(SETTINGS_REFUSALS_KEY, []).append({"reason": decision.refusal.value})

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty() and any(key in other.data for key in _LATEST):
            for key in _LATEST:
                if key in other.data:
                    self.data[key] = list(other.data[key])
            other = MoonleaseConnectorStats(
                data={k: v for k, v in other.data.items() if k not in _LATEST})
        return super().aggregate(other)

    def reduce(self) -> dict[str, int | float]:
        upstream = MooncakeStoreConnectorStats(
            data={k: v for k, v in self.data.items() if k not in _OURS})
        reduced = upstream.reduce() if not upstream.is_empty() else {}
        lookups = self.data.get(LOOKUPS_KEY, [])
        if lookups:
            reduced["lookups"] = len(lookups)
            reduced["lookup_misses"] = sum(1 for r in lookups if r["result"] == "miss")
            reduced["lookup_keys_leased"] = sum(int(r["keys_leased"]) for r in lookups)
            reduced["lookup_junctions"] = sum(int(r.get("junctions", 0)) for r in lookups)
        tails = self.data.get(JUNCTION_TAILS_KEY, [])
        if tails:
            reduced["junction_tail_keys_saved"] = sum(int(r["keys"]) for r in tails)
        handoffs = self.data.get(HANDOFF_KEY, [])
        if handoffs:
            reduced["handoff_waits"] = len(handoffs)
            reduced["handoff_timeouts"] = sum(1 for r in handoffs if r["outcome"] == "timed_out")
        troubles = self.data.get(FLEET_ORDER_KEY, [])
        if troubles:
            reduced["fleet_order_errors"] = sum(int(r["count"]) for r in troubles)
        for decision in ("pinned", "skipped", "retried"):
            keys = sum(int(r["keys"]) for r in self.data.get(RETENTION_KEY, []) if r["decision"] == decision)
            if keys:
                reduced[f"retention_keys_{decision}"] = keys
        return reduced


class MoonleasePromMetrics(MooncakeStorePromMetrics):
    """Upstream's Mooncake store metrics plus Moonlease's lookup and capability families."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # Upstream types the three as one union; each is the class its name says (or a subclass).
        counter = cast("type[Counter]", self._counter_cls)
        gauge = cast("type[Gauge]", self._gauge_cls)
        histogram = cast("type[Histogram]", self._histogram_cls)
        self._lookups = counter(
            name="vllm:moonlease_lookups_total",
            documentation="Store prefix lookups by result; misses carry their reason.",
            labelnames=labelnames + ["result", "reason"])
        self._rounds = histogram(
            name="vllm:moonlease_lookup_rounds",
            documentation="Probe/lease rounds one store lookup needed.",
            buckets=[1, 2, 3, 4, 6, 8, 16], labelnames=labelnames)
        self._keys = counter(
            name="vllm:moonlease_lookup_keys_total",
            documentation="Store keys lookups probed (no lease) and leased.",
            labelnames=labelnames + ["kind"])
        self._junctions = counter(
            name="vllm:moonlease_lookup_junctions_total",
            documentation="Shared-prefix junctions store lookups returned (junction retention).",
            labelnames=labelnames)
        self._junction_tails = counter(
            name="vllm:moonlease_junction_tail_keys_saved_total",
            documentation="Store keys saves wrote only because of a shared-prefix junction.",
            labelnames=labelnames)
        self._retention = counter(
            name="vllm:moonlease_retention_keys_total",
            documentation="Moonlease retention: keys saves put soft-pinned (pinned), keys the "
                          "save plan kept out of the store (skipped), keys stored by a retried "
                          "put after the store refused them for lack of space (retried), and "
                          "least recently used keys removed to make room below the eviction "
                          "watermark (removed).",
            labelnames=labelnames + ["decision"])
        self._fleet_order_errors = counter(
            name="vllm:moonlease_fleet_order_errors_total",
            documentation="Retention evict on the fleet order service, by what went wrong: "
                          "requests that failed (failed_request), reports dropped while it did "
                          "not answer (dropped_report), takes without an answer in time "
                          "(unanswered_take: evict removed nothing, the master evicted), "
                          "operations over the wire's limits, left out (invalid_operation).",
            labelnames=labelnames + ["kind"])
        self._handoff_waits = counter(
            name="vllm:moonlease_handoff_waits_total",
            documentation="Decode requests whose prefill engine promised a save, by how the "
                          "wait for it ended (complete: the store held it, at once or after "
                          "waiting; timed_out: mooncake_handoff_timeout_ms passed first).",
            labelnames=labelnames + ["outcome"])
        self._handoff_wait_seconds = histogram(
            name="vllm:moonlease_handoff_wait_seconds",
            documentation="How long decode lookups waited for a prefill engine's save.",
            buckets=[0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0],
            labelnames=labelnames)
        self._capability = gauge(
            name="vllm:moonlease_store_capability_info",
            documentation="Mooncake client capabilities detected at start-up (value 1).",
            labelnames=labelnames + ["mooncake_version", "batch_probe_key", "last_hit_only",
                                     "lease_mode"],
            multiprocess_mode="mostrecent")
        self._settings = gauge(
            name="vllm:moonlease_settings_info",
            documentation="Connector settings in use (value 1), with their hash and source.",
            labelnames=labelnames + ["lease_mode", "junction_retention", "settings_hash", "source"],
            multiprocess_mode="mostrecent")
        self._settings_refusals = counter(
            name="vllm:moonlease_settings_refusals_total",
            documentation="Settings files the connector refused, by reason.",
            labelnames=labelnames + ["reason"])
        #: engine -> the settings label values shown, removed when the settings change.
        self._settings_shown: dict[int, tuple[str, ...]] = {}
        self._capability_shown: dict[int, tuple[str, ...]] = {}

    def observe(self, transfer_stats_data: dict[str, Any] | None, engine_idx: int = 0) -> None:
        if not transfer_stats_data:
            return
        data = dict(transfer_stats_data)
        lookups = data.pop(LOOKUPS_KEY, [])
        capability = data.pop(CAPABILITY_KEY, [])
        junction_tails = data.pop(JUNCTION_TAILS_KEY, [])
        retention = data.pop(RETENTION_KEY, [])
        settings = data.pop(SETTINGS_KEY, [])
        refusals = data.pop(SETTINGS_REFUSALS_KEY, [])
        handoffs = data.pop(HANDOFF_KEY, [])
        troubles = data.pop(FLEET_ORDER_KEY, [])
        super().observe(data, engine_idx)
        engine_labels = self.per_engine_labelvalues[engine_idx]
        for record in lookups:
            self._lookups.labels(*engine_labels, record["result"], record["reason"]).inc()
            self._rounds.labels(*engine_labels).observe(int(record["rounds"]))
            self._keys.labels(*engine_labels, "probed").inc(int(record["keys_probed"]))
            self._keys.labels(*engine_labels, "leased").inc(int(record["keys_leased"]))
            if int(record.get("junctions", 0)):
                self._junctions.labels(*engine_labels).inc(int(record["junctions"]))
        for record in junction_tails:
            self._junction_tails.labels(*engine_labels).inc(int(record["keys"]))
        for record in retention:
            self._retention.labels(*engine_labels, record["decision"]).inc(int(record["keys"]))
        for record in capability:
            self._show(self._capability, self._capability_shown, engine_idx, engine_labels,
                       (record["mooncake_version"], record["batch_probe_key"],
                        record["last_hit_only"], record["lease_mode"]))
        for record in settings:
            self._show(self._settings, self._settings_shown, engine_idx, engine_labels,
                       (record["lease_mode"], record["junction_retention"],
                        record["settings_hash"], record["source"]))
        for record in refusals:
            self._settings_refusals.labels(*engine_labels, record["reason"]).inc()
        for record in troubles:
            self._fleet_order_errors.labels(*engine_labels, record["kind"]).inc(int(record["count"]))
        for record in handoffs:
            self._handoff_waits.labels(*engine_labels, record["outcome"]).inc()
            self._handoff_wait_seconds.labels(*engine_labels).observe(float(record["waited_s"]))

    @staticmethod
    def _show(gauge: Any, shown: dict[int, tuple[str, ...]], engine_idx: int,
              engine_labels: list[object], values: tuple[str, ...]) -> None:
        """Set an info gauge to `values`, removing the label set it showed before."""
        previous = shown.get(engine_idx)
        if previous is not None and previous != values:
            gauge.remove(*engine_labels, *previous)
        gauge.labels(*engine_labels, *values).set(1)
        shown[engine_idx] = values


def record_lookup_outcome(worker: Any, outcome: LookupOutcome) -> None:
    """Record one lookup on a worker's stats, whatever stats type the worker holds now.

    Upstream code (and upstream's own tests) may leave a plain `MooncakeStoreConnectorStats`
    on the worker; it is upgraded in place to ours over the same `data`, so nothing it already
    recorded is lost and the lookup record is not dropped.
    """
    with worker._kv_connector_stats_lock:
        stats = worker.kv_connector_stats
        if not isinstance(stats, MoonleaseConnectorStats):
            stats = MoonleaseConnectorStats(data=stats.data)
            worker.kv_connector_stats = stats
        stats.record_lookup(outcome)
