"""What the operator knows of the cluster, kept by watches (issue 16). Not pure.

- The policies: as kopf delivers them (its watch of MooncakeLeasePolicies; `remember_policy`
  on every event, and the answer of each status write).
- Deployments and StatefulSets of the served namespaces: every one (a policy may select any
  workload by label or name, and a selector changes with the spec, so no server-side selector
  can cover them), kept trimmed to what the planner reads (`core.kept_fields`).
- ConfigMaps: only labelled ones — the settings files (`moonlease.io/connector-settings`) and
  those a policy changed (`moonlease.io/policy`, e.g. the master's file). A master's file the
  policy has not changed yet is read by name while reconciling.
- Pods: watched from the first reconcile that verifies a stage on (most fleets at rest never
  start it).

Each change after the first listing wakes the policies it concerns (`core.wakeups`): the caller
gives `wake(namespace, name)`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from moonlease_operator.adapters.kube import ApiError, KubeClient
from moonlease_operator.adapters.watch_cache import ObjectCache, is_older
from moonlease_operator.adapters.workloads import object_path
from moonlease_operator.api import PolicySpec, PolicySpecError, parse_spec
from moonlease_operator.core.connector_delivery import SETTINGS_CONFIG_MAP_LABEL
from moonlease_operator.core.fleet import WORKLOAD_KINDS, WorkloadIndex, WorkloadKey
from moonlease_operator.core.rollout import FetchPlan, Observed, config_maps_to_restore, settings_config_maps_to_read
from moonlease_operator.core.slots import POLICY_LABEL, managed_by, policy_label_value
from moonlease_operator.core.wakeups import (
    is_verifying,
    policies_concerned,
    policies_sharing_workloads,
    settings_owner,
)

JsonObj = dict[str, Any]
Wake = Callable[[str, str], None]


def _parse(raw: Mapping[str, Any]) -> PolicySpec | None:
    try:
        return parse_spec(raw.get("spec") or {})
    except PolicySpecError:
        return None


class FleetView:
    """The caches one operator reconciles from; create and start it inside kopf's loop."""

    def __init__(self, client: Callable[[], KubeClient], namespaces: Sequence[str], wake: Wake, *,
                 watch_timeout: float = 300.0, error_delay: float = 1.0,
                 on_unauthorized: Callable[[], Awaitable[None]] | None = None) -> None:
        self._client, self._namespaces, self._wake = client, tuple(namespaces), wake
        options: dict[str, Any] = {"on_change": self._changed, "watch_timeout": watch_timeout,
                                   "error_delay": error_delay, "on_unauthorized": on_unauthorized}
        self.workload_caches = {kind: ObjectCache(client, kind, namespaces, indexed=True, **options)
                                for kind in WORKLOAD_KINDS}
        self.config_map_caches = (
            ObjectCache(client, "ConfigMap", namespaces, label_selector=f"{SETTINGS_CONFIG_MAP_LABEL}=true", **options),
            ObjectCache(client, "ConfigMap", namespaces, label_selector=POLICY_LABEL, **options),
        )
        self.pod_cache = ObjectCache(client, "Pod", namespaces, indexed=True, **options)
        self._policies: dict[str, dict[str, JsonObj]] = {}
        self._specs: dict[tuple[str, str], tuple[Any, PolicySpec | None]] = {}
        self._started: asyncio.Future[list[None]] | None = None
        self._pods_started: asyncio.Task[None] | None = None

    # ---- lifecycle ----------------------------------------------------------------------------

    async def ensure_started(self) -> None:
        """Start the workload and ConfigMap watches (once) and wait for their first listing."""
        if self._started is None:
            caches = (*self.workload_caches.values(), *self.config_map_caches)
            for cache in caches:
                cache.start()
            self._started = asyncio.ensure_future(asyncio.gather(*(c.wait_synced() for c in caches)))
        await asyncio.shield(self._started)

    async def ensure_pods(self) -> None:
        if self._pods_started is None:
            self.pod_cache.start()
            self._pods_started = asyncio.ensure_future(self.pod_cache.wait_synced())
        await asyncio.shield(self._pods_started)

    async def stop(self) -> None:
        for cache in (*self.workload_caches.values(), *self.config_map_caches, self.pod_cache):
            await cache.stop()

    # ---- policies -----------------------------------------------------------------------------

    def remember_policy(self, raw: Mapping[str, Any]) -> JsonObj | None:
        """Keep the policy as last seen, unless what is kept is newer (a read after a conflict,
        or our status write's answer, can be ahead of kopf's watch event under load); returns
        what was kept before."""
        meta = raw.get("metadata") or {}
        store = self._policies.setdefault(meta.get("namespace", ""), {})
        old = store.get(meta.get("name", ""))
        if not is_older(raw, old):
            store[meta.get("name", "")] = dict(raw)
        return old

    def forget_policy(self, namespace: str, name: str) -> JsonObj | None:
        self._specs.pop((namespace, name), None)
        return self._policies.get(namespace, {}).pop(name, None)

    def policy(self, namespace: str, name: str) -> JsonObj | None:
        return self._policies.get(namespace, {}).get(name)

    def policies_in(self, namespace: str) -> list[JsonObj]:
        return list(self._policies.get(namespace, {}).values())

    def _spec(self, raw: Mapping[str, Any]) -> PolicySpec | None:
        """The parsed spec, parsed once per generation (watch events arrive by the thousand)."""
        meta = raw.get("metadata") or {}
        key, stamp = (meta.get("namespace", ""), meta.get("name", "")), meta.get("generation")
        cached = self._specs.get(key)
        if cached is None or cached[0] != stamp:
            try:
                spec: PolicySpec | None = parse_spec(raw.get("spec") or {})
            except PolicySpecError:
                spec = None
            cached = self._specs[key] = (stamp, spec)
        return cached[1]

    # ---- what a reconcile reads ---------------------------------------------------------------

    def workloads(self, namespace: str) -> dict[WorkloadKey, JsonObj]:
        return {(kind, name): obj for kind, cache in self.workload_caches.items()
                for name, obj in cache.in_namespace(namespace).items()}

    def index(self, namespace: str) -> WorkloadIndex:
        """kind -> the label index of the namespace's workloads (live: it may be ahead of a
        `workloads` snapshot taken earlier, which `core.fleet.select` allows for)."""
        return {kind: index for kind, cache in self.workload_caches.items()
                if (index := cache.index(namespace)) is not None}

    def _cached_config_map(self, namespace: str, name: str) -> JsonObj | None:
        for cache in self.config_map_caches:
            if (obj := cache.get(namespace, name)) is not None:
                return obj
        return None

    async def observed(self, namespace: str, plan: FetchPlan) -> Observed:
        """`Observed` for `plan_reconcile`, from the caches: workloads, policies, the settings
        ConfigMaps (labelled: a missing one does not exist, or is not ours yet — creating it
        then meets a 409 and reads it), the master's file (by name when the policy has not
        labelled it yet) and, when asked, the pods."""
        await self.ensure_started()
        workloads = self.workloads(namespace)
        index = self.index(namespace)
        config_maps: dict[str, JsonObj] = {}
        for name in (settings_config_maps_to_read(plan.spec, workloads, index) if plan.spec else ()):
            if (obj := self._cached_config_map(namespace, name)) is not None:
                config_maps[name] = obj
        for name in plan.config_maps:
            obj = self._cached_config_map(namespace, name) or await self._read_config_map(namespace, name)
            if obj is not None:
                config_maps[name] = obj
        if plan.policy_label is not None:  # what the policy labelled, used or not (a renamed master file)
            for name, obj in self.config_map_caches[1].in_namespace(namespace).items():
                if managed_by(obj) == plan.policy_label:
                    config_maps.setdefault(name, obj)
        pods = pod_index = None
        if plan.pods:
            await self.ensure_pods()
            pods = list(self.pod_cache.in_namespace(namespace).values())
            pod_index = self.pod_cache.index(namespace)
        return Observed(workloads=workloads, config_maps=config_maps, policies=self.policies_in(namespace), pods=pods,
                        index=index, pod_index=pod_index)

    async def managed(self, namespace: str, policy: str, spec: PolicySpec | PolicySpecError) -> list[JsonObj]:
        """Every workload and ConfigMap of the namespace that carries this policy's label (what
        a deleted policy gives back), from the caches; the master's file by name if not cached."""
        await self.ensure_started()
        label = policy_label_value(policy)
        workloads = [obj for obj in self.workloads(namespace).values() if managed_by(obj) == label]
        config_maps: dict[str, JsonObj] = {}
        for name in config_maps_to_restore(spec, list(self.workloads(namespace).values())):
            obj = self._cached_config_map(namespace, name)
            if obj is None and isinstance(spec, PolicySpec) and spec.master.config_map is not None \
                    and spec.master.config_map.name == name:
                obj = await self._read_config_map(namespace, name)
            if obj is not None and managed_by(obj) == label:
                config_maps[name] = obj
        return [*workloads, *config_maps.values()]

    def record_written(self, objects: Sequence[Mapping[str, Any]]) -> None:
        """Our own writes' answers, into the caches they belong to (see `ObjectCache.record_written`)."""
        for obj in objects:
            kind = obj.get("kind")
            caches = (self.config_map_caches if kind == "ConfigMap" else
                      (self.workload_caches[kind],) if kind in self.workload_caches else ())
            for cache in caches:
                cache.record_written(dict(obj))

    async def _read_config_map(self, namespace: str, name: str) -> JsonObj | None:
        try:
            obj = await self._client().get(object_path("ConfigMap", namespace, name))
        except ApiError as exc:
            if exc.not_found:
                return None
            raise
        obj.setdefault("kind", "ConfigMap")
        return dict(obj)

    # ---- waking -------------------------------------------------------------------------------

    def policies_sharing(self, namespace: str, name: str, old: Mapping[str, Any] | None,
                         new: Mapping[str, Any] | None) -> set[str]:
        """The other policies a creation, spec edit or deletion of policy `name` concerns
        (`core.wakeups.policies_sharing_workloads`); before the first listing, all of them."""
        others = {n: raw for n, raw in self._policies.get(namespace, {}).items() if n != name}
        if not all(cache.synced for cache in self.workload_caches.values()):
            return set(others)  # nothing to compare with yet: their first reconcile is still to come
        versions = [_parse(raw) for raw in (old, new) if raw is not None]
        specs = {n: self._spec(raw) for n, raw in others.items()}
        return policies_sharing_workloads(name, versions, specs, self.workloads(namespace), self.index(namespace))

    def _changed(self, kind: str, old: JsonObj | None, new: JsonObj | None) -> None:
        obj = new or old or {}
        namespace = (obj.get("metadata") or {}).get("namespace", "")
        policies = self._policies.get(namespace, {})
        if not policies:
            return
        if kind == "Pod":  # pods matter to the policies verifying a stage
            for name, raw in policies.items():
                if is_verifying(raw.get("status") or {}):
                    self._wake(namespace, name)
            return
        subjects: list[Mapping[str, Any] | None] = [old, new]
        if kind == "ConfigMap":  # a settings file concerns its workload's policies too
            owner = settings_owner((obj.get("metadata") or {}).get("name", ""))
            if owner is not None:
                subjects += [cache.get(namespace, owner) for cache in self.workload_caches.values()]
        specs = {name: self._spec(raw) for name, raw in policies.items()}
        for name in policies_concerned(kind, subjects, specs):
            self._wake(namespace, name)

