"""The kopf entry points. Thin: read, ask the core, write the answer through the adapters.

`register(registry, context)` attaches them to a registry (the runner builds one per operator,
so two operators in one process, such as tests, share nothing):

* a daemon per policy runs `reconcile_policy` when something it depends on changes — its spec
  or annotations (approval, decision, verb; not its own status writes), a workload it covers, a
  settings ConfigMap, a pod while a stage is verified — as the operator's watch caches report it
  (`adapters.fleet_view`, `core.wakeups`); otherwise every `reconcile_interval` seconds while a
  stage is verified (connectors report over HTTP), at its next A/B measurement, and every
  `resync_interval` seconds as a safety net. A reconcile reads the caches and the policy as kopf
  delivered it: no LIST at all (issue 16);
* `release_policy` runs on deletion (kopf holds the policy with the `moonlease.io/finalizer`
  until it succeeds) and restores every workload the policy changed.

A per-policy lock (in kopf's per-object memo) keeps a reconcile and the deletion from
interleaving. State is never kept here: the policy status and the workloads' annotations hold it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import time
from collections.abc import Callable, Mapping
from typing import Any

import kopf
from prometheus_client import CollectorRegistry

from moonlease_operator.adapters.ab_metrics import build_metric_source, measure_arms
from moonlease_operator.adapters.fleet_view import FleetView
from moonlease_operator.adapters.kube import ApiError, KubeClient
from moonlease_operator.adapters.logs import about_policy
from moonlease_operator.adapters.metrics import OperatorMetrics
from moonlease_operator.adapters.settings_scrape import fetch_settings_reports
from moonlease_operator.adapters.workloads import (
    apply_changes,
    apply_status,
    object_path,
    post_event,
)
from moonlease_operator.api import (
    APPROVE_MASTER_RESTART_ANNOTATION,
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    Phase,
    PolicySpec,
    Reason,
    read_spec,
)
from moonlease_operator.core.ab_plan import seconds_until_measurement
from moonlease_operator.core.ab_samples import Snapshot
from moonlease_operator.core.changes import WorkloadChange
from moonlease_operator.core.connector_delivery import pods_to_contact
from moonlease_operator.core.pod_set import PodSet
from moonlease_operator.core.events import EventNote
from moonlease_operator.core.url_allowlist import evaluate_prometheus_url
from moonlease_operator.core.rollout import Observed, PolicyRef, plan_fetch, plan_reconcile, plan_release
from moonlease_operator.core.status import dump_status, read_status
from moonlease_operator.core.wakeups import seconds_until_next_reconcile, wakes_on_policy_change
from moonlease_operator.core.write_failures import record_write_failures
from moonlease_operator.options import OperatorOptions

Clock = Callable[[], datetime.datetime]
COMPONENT = "moonlease-operator"


def utc_now() -> datetime.datetime:
    """Seconds precision: Kubernetes timestamps have no fractions."""
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0)


class OperatorContext:
    """What the handlers of one operator share: the connection kopf logged in with, the API
    client built from it (lazily, in kopf's loop), the clock, the options and the metrics."""

    def __init__(self, *, clock: Clock = utc_now, options: OperatorOptions | None = None,
                 metrics: OperatorMetrics | None = None, namespaces: tuple[str, ...] = ()) -> None:
        self.clock = clock
        self.options = options or OperatorOptions()
        self.namespaces = namespaces  # served namespaces; empty: the whole cluster
        self.wakers: dict[tuple[str, str], asyncio.Event] = {}  # each running daemon's wake-up
        self._fleet: FleetView | None = None
        self.metrics = metrics or OperatorMetrics(CollectorRegistry())  # private unless given
        self.connection: kopf.ConnectionInfo | None = None
        self._relogin: Callable[[], kopf.ConnectionInfo | None] | None = None
        self._client: KubeClient | None = None
        self._stale: list[KubeClient] = []  # replaced clients, closed at cleanup (requests may be in flight)

    def use_connection(self, connection: kopf.ConnectionInfo | None,
                       relogin: Callable[[], kopf.ConnectionInfo | None] | None = None) -> None:
        """kopf logged in (again): later requests use these credentials."""
        self.connection, self._relogin = connection, relogin
        if self._client is not None:
            self._stale.append(self._client)
            self._client = None

    async def refresh_credentials(self) -> None:
        """After a 401: log in again (a rotated service-account token, a refreshed kubeconfig)."""
        if self._relogin is not None:
            self.use_connection(self._relogin(), self._relogin)

    def client(self) -> KubeClient:
        if self._client is None:
            if self.connection is None:
                raise kopf.TemporaryError("not logged in yet", delay=1)
            options = self.options
            self._client = KubeClient(self.connection, retries=options.api_retries, backoff=options.api_backoff,
                                      timeout=options.api_timeout,
                                      on_retry=lambda _method, status: self.metrics.observe_retry(f"status_{status}"))
        return self._client

    def fleet(self) -> FleetView:
        """The watch caches (created in kopf's loop on first use; started by their first read)."""
        if self._fleet is None:
            self._fleet = FleetView(self.client, self.namespaces, self.wake, error_delay=self.options.error_delay,
                                    on_unauthorized=self.refresh_credentials)
        return self._fleet

    def wake(self, namespace: str, name: str) -> None:
        event = self.wakers.get((namespace, name))
        if event is not None:
            event.set()

    async def close(self) -> None:
        if self._fleet is not None:
            await self._fleet.stop()
            self._fleet = None
        for client in [*self._stale, *([self._client] if self._client is not None else [])]:
            await client.close()
        self._client, self._stale = None, []


def register(registry: kopf.OperatorRegistry, context: OperatorContext) -> None:
    """Attach the MooncakeLeasePolicy handlers to `registry`."""
    resource = (GROUP, VERSION, PLURAL)

    async def drive_policy(meta: kopf.Meta, memo: kopf.Memo, stopped: kopf.DaemonStopped,
                           logger: kopf.Logger, **_: Any) -> None:
        """Reconcile now, then whenever woken (see the module docstring) or the rest is over."""
        wake = _wake(memo)
        key = (meta["namespace"], meta["name"])
        context.wakers[key] = wake
        baselines: dict[str, Snapshot] = memo.setdefault("moonlease_ab_baselines", {})
        with about_policy(*key):  # every line this daemon's task logs names the policy
            try:
                while not stopped:
                    wake.clear()
                    try:
                        async with _lock(memo):
                            delay = await reconcile_policy(context, *key, logger, baselines=baselines)
                        delay = max(0.2, delay)
                    except Exception as exc:  # an API outage must not end the daemon; try again later
                        delay = await _failed(exc, logger)
                    await _rest(wake, stopped, delay)
            finally:
                if context.wakers.get(key) is wake:
                    del context.wakers[key]

    async def _failed(exc: Exception, logger: kopf.Logger) -> float:
        """Count a failed reconcile (log in again after a 401); the seconds to wait."""
        kind = f"api_{exc.status}" if isinstance(exc, ApiError) else "other"
        if isinstance(exc, ApiError) and exc.status == 401:
            await context.refresh_credentials()
        context.metrics.observe_error(kind)
        context.metrics.observe_reconcile("error", None)
        logger.warning("Reconcile failed, retrying in %ss: %s", context.options.error_delay, exc)
        return context.options.error_delay

    async def poke_policy(memo: kopf.Memo, body: kopf.Body, type: str | None, **_: Any) -> None:
        """Keep the policy as kopf delivered it; a change that is not a status write wakes its
        daemon (and, for a creation, spec change or deletion, the other policies that cover the
        same workloads: their claims may change)."""
        fleet = context.fleet()
        raw = dict(body)
        meta = raw.get("metadata") or {}
        namespace, name = meta.get("namespace", ""), meta.get("name", "")
        old = fleet.forget_policy(namespace, name) if type == "DELETED" else fleet.remember_policy(raw)
        new = None if type == "DELETED" else raw
        if not wakes_on_policy_change(old, new):
            return
        _wake(memo).set()
        if old is None or new is None or (old.get("metadata") or {}).get("generation") != meta.get("generation"):
            for other in fleet.policies_sharing(namespace, name, old, new):
                context.wake(namespace, other)

    async def release_policy(meta: kopf.Meta, spec: kopf.Spec, memo: kopf.Memo, body: kopf.Body,
                             logger: kopf.Logger, **_: Any) -> None:
        """Restore every workload the policy changed, then let kopf remove the finalizer."""
        namespace, name = meta["namespace"], meta["name"]
        with about_policy(namespace, name):  # every line logged meanwhile names the policy
            client = context.client()
            async with _lock(memo):
                try:
                    managed = await context.fleet().managed(namespace, name, read_spec(spec))
                    policy = await client.get(object_path(KIND, namespace, name))  # approvals arrive after the delete
                    plan = plan_release(policy=_ref(policy), spec=read_spec(spec),
                                        previous=read_status(body.get("status")), managed=managed,
                                        now=context.clock())
                    if plan.status is not None:
                        await apply_status(client, namespace, name, plan.status,
                                           policy["metadata"].get("resourceVersion"))
                    for note in plan.events:
                        await post_event(client, body, note, component=COMPONENT, now=context.clock())
                    by_ref = {(o.get("kind"), o["metadata"]["name"]): o for o in managed}
                    report = await apply_changes(client, namespace, plan.changes, lambda c: by_ref.get(c.ref),
                                                 concurrency=context.options.write_concurrency)
                    for failure in report.failures:  # the others were given back; keep the finalizer for these
                        await post_event(client, body,
                                         EventNote("Warning", Reason.WRITE_REFUSED.value, failure.describe()),
                                         component=COMPONENT, now=context.clock())
                except ApiError as exc:
                    context.metrics.observe_error(f"api_{exc.status}")
                    if exc.status == 401:
                        await context.refresh_credentials()
                    raise kopf.TemporaryError(f"restoring the workloads failed: {exc}",
                                              delay=context.options.error_delay) from exc
            if report.failures:
                raise kopf.TemporaryError("giving back the workloads was refused: "
                                          + "; ".join(f.describe() for f in report.failures),
                                          delay=context.options.error_delay)
            if plan.pending_approval is not None:
                raise kopf.TemporaryError(f"restoring the master waits for approval: annotate the policy with"
                                          f" {APPROVE_MASTER_RESTART_ANNOTATION}={plan.pending_approval}",
                                          delay=context.options.reconcile_interval)
            context.metrics.forget(namespace, name)
            if plan.changes:
                logger.info("Released %d object(s) changed by the policy.", len(plan.changes))
            else:  # an earlier pass restored them (and was retried for an approval or a refusal)
                logger.info("Released: every object the policy changed has its original back.")

    async def close_client(**_: Any) -> None:
        await context.close()

    # Stopping: the loop notices within 0.2 s; a reconcile still running after 2 s is cancelled
    # (safe: every step is re-planned from the cluster on the next start).
    kopf.daemon(*resource, id="drive_policy", registry=registry, cancellation_backoff=2.0,
                cancellation_timeout=30)(drive_policy)
    kopf.on.event(*resource, id="poke_policy", registry=registry)(poke_policy)
    kopf.on.delete(*resource, id="release_policy", registry=registry)(release_policy)
    kopf.on.cleanup(id="close_client", registry=registry)(close_client)


async def reconcile_policy(context: OperatorContext, namespace: str, name: str, logger: kopf.Logger, *,
                           baselines: dict[str, Snapshot] | None = None) -> float:
    """One reconcile: read (the A/B arms' metrics too when due), plan, then status, events and
    changes — in that order. Returns the seconds to rest unless woken earlier
    (`core.wakeups.seconds_until_next_reconcile`).

    Reads the policy as kopf delivered it and everything else from the watch caches
    (`adapters.fleet_view`). `baselines`: the A/B snapshot of the last measurement per tested
    configuration (memory).
    """
    started = time.monotonic()
    client = context.client()
    fleet = context.fleet()
    policy = fleet.policy(namespace, name)
    if policy is None:  # not delivered yet (the daemon started first): read it once
        policy = await _read_policy(context, namespace, name)
    if policy is None or policy["metadata"].get("deletionTimestamp"):
        return context.options.resync_interval  # gone, or being deleted: release_policy owns it now
    previous = read_status(policy.get("status"))
    now = context.clock()
    spec = read_spec(policy.get("spec") or {})  # read once; every step below gets this result
    fetch = plan_fetch(spec, previous, now, policy=name)
    observed = await fleet.observed(namespace, fetch)
    if observed.pods is not None:  # verifying a stage: what do the connectors run?
        contact = pods_to_contact(observed.workloads.values(), PodSet(observed.pods, observed.pod_index))
        observed = dataclasses.replace(observed, settings_reports=await fetch_settings_reports(contact))
    baselines = {} if baselines is None else baselines
    kept: Snapshot | None = None
    ab_spec = spec.rollout.ab_test if isinstance(spec, PolicySpec) else None
    prometheus_url = ab_spec.prometheus.url if ab_spec is not None and ab_spec.prometheus is not None else None
    if fetch.ab_due and previous.ab_test is not None and isinstance(spec, PolicySpec) and evaluate_prometheus_url(
            prometheus_url, context.options.prometheus_url_allowlist) is None:
        tested = previous.ab_test.config_hash
        parsed = spec
        # A test without a reading yet (fresh, or retried under the same configuration) starts
        # from its own baseline, never from the previous attempt's last snapshot.
        fresh = previous.ab_test.last_measured_at is None
        reading, kept = await measure_arms(lambda: build_metric_source(parsed, namespace, observed),
                                           None if fresh else baselines.get(tested),
                                           last_measured_at=previous.ab_test.last_measured_at, now=now)
        observed = dataclasses.replace(observed, ab_reading=reading)
    plan = plan_reconcile(spec=spec, policy=_ref(policy), previous=previous, observed=observed, now=now,
                          prometheus_allowlist=context.options.prometheus_url_allowlist,
                          listed_targets=context.options.listed_targets,
                          conflicts=context.options.conflicts)
    version = policy["metadata"].get("resourceVersion")
    if dump_status(plan.status) != dump_status(previous):
        try:
            version = await apply_status(client, namespace, name, plan.status, version)
        except ApiError as exc:
            if not exc.conflict:
                raise
            # The policy changed since it was read (another replica, a spec edit, an approval):
            # this plan is stale. Nothing was announced or changed yet; read again and re-plan.
            context.metrics.observe_retry("conflict")
            logger.info("The policy changed while planning; planning again.")
            await _read_policy(context, namespace, name)
            return 0.0
        _remember_status(fleet, policy, plan.status, version)
    ab = plan.status.ab_test
    if kept is not None and ab is not None:
        baselines.clear()
        baselines[ab.config_hash] = kept
    for note in plan.events:
        await post_event(client, policy, note, component=COMPONENT, now=context.clock())
        logger.info("%s: %s", note.reason, note.message)
    report = await apply_changes(client, namespace, plan.changes, lambda c: _current(observed, c),
                                 concurrency=context.options.write_concurrency)
    fleet.record_written(report.written)
    for _ in range(report.conflicts):
        context.metrics.observe_retry("conflict")
    final = plan.status
    if report.failures:  # refused writes show at once, on the workload, in a condition and an event
        final, notes = record_write_failures(plan.status, report.failures, generation=policy["metadata"].get("generation"),
                                             now=context.clock(), all_targets=plan.all_targets,
                                             listed_targets=plan.listed_targets)
        version = await apply_status(client, namespace, name, final, version)
        _remember_status(fleet, policy, final, version)
        for note in notes:
            await post_event(client, policy, note, component=COMPONENT, now=context.clock())
            logger.warning("%s: %s", note.reason, note.message)
        context.metrics.observe_error("write_refused")
    context.metrics.observe_status(namespace, name, final)
    result = "invalid" if plan.status.phase is Phase.INVALID else "success"
    context.metrics.observe_reconcile(result, time.monotonic() - started)
    due_in = None if plan.status.paused_at is not None else (  # paused: no measurement falls due
        seconds_until_measurement(plan.status.ab_test, ab_spec, context.clock()))
    return seconds_until_next_reconcile(plan.status, ab_due_in=due_in,
                                        reconcile_interval=context.options.reconcile_interval,
                                        resync_interval=context.options.resync_interval, now=context.clock())


async def _read_policy(context: OperatorContext, namespace: str, name: str) -> dict[str, Any] | None:
    """The policy read by name (the cache had none, or a write met a newer one), kept."""
    try:
        policy = dict(await context.client().get(object_path(KIND, namespace, name)))
    except ApiError as exc:
        if exc.not_found:
            return None
        raise
    context.fleet().remember_policy(policy)
    return policy


def _remember_status(fleet: FleetView, policy: Mapping[str, Any], status: Any, version: str | None) -> None:
    """After our status write: the kept policy carries it (and its resourceVersion) before the
    watch event does, so that a reconcile woken meanwhile plans from it."""
    if version is None:
        return
    meta = {**(policy.get("metadata") or {}), "resourceVersion": version}
    fleet.remember_policy({**policy, "metadata": meta, "status": dump_status(status)})


def _ref(policy: Mapping[str, Any]) -> PolicyRef:
    meta = policy.get("metadata") or {}
    return PolicyRef(name=meta.get("name", ""), namespace=meta.get("namespace", ""),
                     generation=meta.get("generation"), created=meta.get("creationTimestamp", ""),
                     annotations=dict(meta.get("annotations") or {}))


def _current(observed: Observed, change: WorkloadChange) -> Mapping[str, Any] | None:
    if change.kind == "ConfigMap":
        return observed.config_maps.get(change.name)
    return observed.workloads.get(change.ref)


def _wake(memo: kopf.Memo) -> asyncio.Event:
    return memo.setdefault("moonlease_wake", asyncio.Event())


def _lock(memo: kopf.Memo) -> asyncio.Lock:
    return memo.setdefault("moonlease_lock", asyncio.Lock())


async def _rest(wake: asyncio.Event, stopped: kopf.DaemonStopped, seconds: float) -> None:
    """Sleep `seconds`, or less when woken or stopped (checked every 0.2 s at most)."""
    deadline = time.monotonic() + seconds
    while not stopped and not wake.is_set():
        left = deadline - time.monotonic()
        if left <= 0:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), timeout=min(left, 0.2))
