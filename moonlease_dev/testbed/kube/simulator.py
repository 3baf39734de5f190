"""The Deployment / StatefulSet controllers, simulated on the emulator one tick at a time.

Not pure: it writes workload status and pods through the emulator's write path.

Event-driven, as the real controllers are: a tick steps only the workloads that were written
(their object, or one of their pods) since the last tick, those whose rollout is still moving,
and those whose test behaviour changed — not every workload of the store. A settled workload
costs nothing per tick (at 5,000 Deployments, rescanning them all cost the test bed about 16 s
of CPU a tick: `benchmarks/results/testbed_cost.md`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import enum
import hashlib
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from moonlease_dev.testbed.kube.emulator import ApiServerEmulator
from moonlease_dev.testbed.kube.replicasets import (
    HASH_LABEL,
    REVISION,
    next_revision,
    promoted_annotations,
    replicaset_for,
    replicaset_status,
    revision_of,
    to_prune,
)
from moonlease_dev.testbed.kube.resources import DEPLOYMENTS, PODS, REPLICASETS, STATEFULSETS, ResourceType
from moonlease_dev.testbed.kube.timestamps import now_rfc3339

#: Who the writes are recorded as (`managedFields`), as on a real cluster: the Deployment,
#: ReplicaSet and StatefulSet controllers run in kube-controller-manager; pods' status is the
#: kubelet's.
CONTROLLER_MANAGER = "kube-controller-manager"
KUBELET = "kubelet"

log = logging.getLogger(__name__)

JsonObj = dict[str, Any]

#: Set in the simulator's own steps: its writes describe what it just decided, so they do not
#: make a workload dirty again. A context variable, not a flag: a write another task makes
#: while a step waits for the emulator's lock still counts.
_STEPPING: contextvars.ContextVar[bool] = contextvars.ContextVar("moonlease_simulator_stepping", default=False)


class RolloutBehaviour(str, enum.Enum):
    """How the simulated controller treats a workload's rollouts."""

    COMPLETE = "complete"  # one more replica updated and ready per tick, until all are
    STALL = "stall"  # observed, but not one replica moves: the rollout never finishes
    FAIL = "fail"  # the first new replica never gets ready; Deployments report the deadline


@dataclass
class _Rule:
    behaviour: RolloutBehaviour
    when: Callable[[Mapping[str, Any]], bool] | None


@dataclass
class WorkloadRollout:
    """What the simulator knows about one workload (read it in tests; it writes the status)."""

    kind: str
    namespace: str
    name: str
    stable_revision: str | None = None  # the revision every replica ran last time it settled
    stable_template: JsonObj | None = None
    update_revision: str | None = None
    update_template: JsonObj | None = None
    updated: int = 0  # replicas on update_revision
    ticks_in_rollout: int = 0
    failed: bool = False
    completed_rollouts: list[str] = field(default_factory=list)

    @property
    def progressing(self) -> bool:
        return self.update_revision is not None and self.update_revision != self.stable_revision


def template_revision(template: Mapping[str, Any]) -> str:
    """A short stable hash of a pod template (like pod-template-hash / controller-revision-hash).
    Null and empty fields do not count: a template that comes back through a Go client (as
    `kubectl rollout undo` sends it: `creationTimestamp: null`, `resources: {}`) is the same
    template, as the controller's semantic comparison finds it."""
    return hashlib.sha256(json.dumps(_without_empty(template), sort_keys=True).encode()).hexdigest()[:10]


def _without_empty(value: Any) -> Any:
    if isinstance(value, Mapping):
        kept = {k: _without_empty(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v is not None and v != {} and v != []}
    if isinstance(value, list):
        return [_without_empty(v) for v in value]
    return value


class RolloutSimulator:
    """Plays the Deployment and StatefulSet controllers on the emulator, one tick at a time.

    Per tick and workload: a new generation is observed (status.observedGeneration); a changed
    pod template starts a rollout that, under `COMPLETE`, moves one replica per tick to the new
    revision until all are updated, ready and available (then Progressing=True
    NewReplicaSetAvailable). Pods are kept in step (owned by the workload, labelled with
    pod-template-hash or controller-revision-hash, Ready or CrashLoopBackOff). `stall()` and
    `fail()` change that for a named workload, optionally only for templates matching `when`
    (e.g. "the one with the new flag"), so a rollback to an older template can still succeed.

    Drive it with `await tick()` for determinism, or `start()` a background task.
    """

    def __init__(self, emulator: ApiServerEmulator, *, fail_after_ticks: int = 2,
                 pod_ip: str = "127.0.0.1") -> None:
        self.emulator = emulator
        self.fail_after_ticks = fail_after_ticks
        #: status.podIP of every pod: where the pods' servers (e.g. `ConnectorPods`) listen.
        self.pod_ip = pod_ip
        self._rules: dict[tuple[str, str, str], _Rule] = {}
        self._state: dict[tuple[str, str, str], WorkloadRollout] = {}
        self._task: asyncio.Task[None] | None = None
        self.ticks = 0
        self._dirty: set[tuple[str, str, str]] = set()  # written since the last tick
        self._moving: set[tuple[str, str, str]] = set()  # rollouts that advance by themselves
        self._scan_all = True  # the first tick looks at every workload already stored
        self._unfinished = 0  # steps of the running tick still to take (it yields to requests)
        emulator.add_write_listener(self._on_write)

    # ---- test controls ------------------------------------------------------------------------

    def set_behaviour(self, kind: str, namespace: str, name: str, behaviour: RolloutBehaviour, *,
                      when: Callable[[Mapping[str, Any]], bool] | None = None) -> None:
        """Rollouts of this workload (to templates matching `when`, if given) behave so."""
        self._rules[(kind, namespace, name)] = _Rule(RolloutBehaviour(behaviour), when)
        self._dirty.add((kind, namespace, name))

    def stall(self, kind: str, namespace: str, name: str, *,
              when: Callable[[Mapping[str, Any]], bool] | None = None) -> None:
        self.set_behaviour(kind, namespace, name, RolloutBehaviour.STALL, when=when)

    def fail(self, kind: str, namespace: str, name: str, *,
             when: Callable[[Mapping[str, Any]], bool] | None = None) -> None:
        self.set_behaviour(kind, namespace, name, RolloutBehaviour.FAIL, when=when)

    def heal(self, kind: str, namespace: str, name: str) -> None:
        """Back to COMPLETE; a failed or stalled rollout resumes on the next tick."""
        self._rules.pop((kind, namespace, name), None)
        self._dirty.add((kind, namespace, name))

    def state(self, kind: str, namespace: str, name: str) -> WorkloadRollout | None:
        return self._state.get((kind, namespace, name))

    @property
    def idle(self) -> bool:
        """Nothing for the next tick to do: no workload written since the last tick, no rollout
        still advancing (stalled and failed ones wait for a change, so they count as idle)."""
        return not (self._scan_all or self._dirty or self._moving or self._unfinished)

    def _on_write(self, rtype: ResourceType, event_type: str, obj: JsonObj) -> None:
        """Every write of the emulator: a workload, or a pod of one, needs a look next tick."""
        if _STEPPING.get():
            return
        meta = obj.get("metadata") or {}
        if rtype in (DEPLOYMENTS, STATEFULSETS):
            self._dirty.add((rtype.kind, meta.get("namespace", ""), meta.get("name", "")))
        elif rtype in (PODS, REPLICASETS):
            for owner in meta.get("ownerReferences") or []:
                if owner.get("kind") in (DEPLOYMENTS.kind, STATEFULSETS.kind):
                    self._dirty.add((owner["kind"], meta.get("namespace", ""), owner.get("name", "")))
                elif owner.get("kind") == REPLICASETS.kind and rtype == PODS:
                    # A Deployment's pod, through its ReplicaSet `<deployment>-<pod-template-hash>`
                    # (named so by the controller: no read on the write path).
                    suffix = "-" + (meta.get("labels") or {}).get(HASH_LABEL, "")
                    if suffix != "-" and owner.get("name", "").endswith(suffix):
                        self._dirty.add((DEPLOYMENTS.kind, meta.get("namespace", ""),
                                         owner["name"].removesuffix(suffix)))

    # ---- running --------------------------------------------------------------------------------

    def start(self, interval: float = 0.05) -> None:
        """Tick in the background every `interval` seconds (in the running loop)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(interval), name="rollout simulator")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    @property
    def running(self) -> bool:
        return self._task is not None

    async def _run(self, interval: float) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # a bad object must not stop the controller, as in a real cluster
                log.exception("rollout simulator tick failed")
            await asyncio.sleep(interval)

    async def tick(self) -> None:
        """Advance by one step every Deployment and StatefulSet that a step would change (see
        the module docstring); a settled, unwritten workload is not looked at."""
        self.ticks += 1
        if self._scan_all:
            self._scan_all = False
            for rtype in (DEPLOYMENTS, STATEFULSETS):
                self._dirty.update((rtype.kind, ns or "", name) for ns, name in self.emulator.live_names(rtype))
        kinds = {DEPLOYMENTS.kind: DEPLOYMENTS, STATEFULSETS.kind: STATEFULSETS}
        work = sorted(self._dirty | self._moving, key=lambda key: (key[0] != DEPLOYMENTS.kind, key[1], key[2]))
        self._dirty, self._moving = set(), set()
        stepping = _STEPPING.set(True)
        try:
            for index, key in enumerate(work):
                self._unfinished = len(work) - index
                rtype = kinds[key[0]]
                obj = self.emulator.stored_object(rtype, key[1], key[2])  # read-only
                if obj is None:
                    self._state.pop(key, None)
                    continue
                if obj["metadata"].get("deletionTimestamp"):
                    continue
                try:
                    if await self._step(rtype, obj):
                        self._moving.add(key)
                    if index % 50 == 49:
                        await asyncio.sleep(0)  # a tick of thousands of steps: let requests in
                except BaseException:
                    self._dirty.update(work[index:])  # not done: the next tick tries again
                    raise
        finally:
            self._unfinished = 0
            _STEPPING.reset(stepping)

    async def _step(self, rtype: ResourceType, obj: Mapping[str, Any]) -> bool:
        """One controller step of one workload; True while its rollout advances by itself
        (the next tick must step it even if nothing is written meanwhile)."""
        meta, spec = obj["metadata"], obj.get("spec", {})
        key = (rtype.kind, meta["namespace"], meta["name"])
        st = self._state.setdefault(key, WorkloadRollout(*key))
        template = spec.get("template", {})
        revision = template_revision(template)
        replicas = int(spec.get("replicas", 1))
        behaviour = self._behaviour(key, template)

        if revision != st.update_revision:  # a new rollout (the first one, or back to the stable one)
            st.update_revision, st.update_template = revision, copy.deepcopy(template)
            st.updated = replicas if revision == st.stable_revision else 0
            st.ticks_in_rollout, st.failed = 0, False
        elif spec.get("paused"):
            pass
        elif revision != st.stable_revision:
            st.ticks_in_rollout += 1
            if behaviour is RolloutBehaviour.COMPLETE:
                st.updated, st.failed = st.updated + 1, False
            elif behaviour is RolloutBehaviour.FAIL:
                st.updated = max(st.updated, 1)
                st.failed = st.failed or st.ticks_in_rollout >= self.fail_after_ticks
        else:
            st.updated = replicas  # a scale change of a settled workload
        st.updated = min(st.updated, replicas)
        if revision != st.stable_revision and behaviour is RolloutBehaviour.COMPLETE and st.updated >= replicas:
            st.stable_revision, st.stable_template = revision, copy.deepcopy(template)
            st.completed_rollouts.append(revision)

        in_rollout = revision != st.stable_revision
        broken = in_rollout and behaviour is RolloutBehaviour.FAIL and st.updated > 0
        old = replicas - st.updated if in_rollout and st.stable_revision is not None else 0
        ready = st.updated - (1 if broken else 0) + old
        if rtype == DEPLOYMENTS:  # first: a Deployment's pods belong to its ReplicaSets
            await self._sync_replicasets(obj, st, revision, old, broken)
        await self._sync_pods(rtype, obj, st, revision, old, broken)
        build = self._deployment_status if rtype == DEPLOYMENTS else self._statefulset_status
        status = build(obj, st, replicas=replicas, ready=ready, old=old, revision=revision)
        if status != obj.get("status"):
            # A merge patch of /status, not a PUT: a client may have written the object meanwhile.
            await self.emulator.patch_object(rtype, meta["namespace"], meta["name"], {"status": status},
                                             subresource="status", field_manager=CONTROLLER_MANAGER)
        if not in_rollout or spec.get("paused"):
            return False
        return behaviour is RolloutBehaviour.COMPLETE or (behaviour is RolloutBehaviour.FAIL and not st.failed)

    def _behaviour(self, key: tuple[str, str, str], template: Mapping[str, Any]) -> RolloutBehaviour:
        rule = self._rules.get(key)
        if rule is None or (rule.when is not None and not rule.when(template)):
            return RolloutBehaviour.COMPLETE
        return rule.behaviour

    def _deployment_status(self, obj: Mapping[str, Any], st: WorkloadRollout, *, replicas: int, ready: int,
                           old: int, revision: str) -> JsonObj:
        done = st.stable_revision == revision and ready == replicas
        previous = {c["type"]: c for c in obj.get("status", {}).get("conditions", [])}
        if st.failed:
            progressing = ("False", "ProgressDeadlineExceeded",
                           f'ReplicaSet "{obj["metadata"]["name"]}-{revision}" has timed out progressing.')
        elif done:
            progressing = ("True", "NewReplicaSetAvailable",
                           f'ReplicaSet "{obj["metadata"]["name"]}-{revision}" has successfully progressed.')
        else:
            progressing = ("True", "ReplicaSetUpdated",
                           f'ReplicaSet "{obj["metadata"]["name"]}-{revision}" is progressing.')
        # maxUnavailable 25% (rounded down), the Deployment default.
        available = ("True", "MinimumReplicasAvailable", "Deployment has minimum availability.") \
            if ready >= replicas - replicas // 4 else \
            ("False", "MinimumReplicasUnavailable", "Deployment does not have minimum availability.")
        return {
            "observedGeneration": obj["metadata"]["generation"],
            "replicas": replicas,
            "updatedReplicas": st.updated,
            "readyReplicas": ready,
            "availableReplicas": ready,
            "unavailableReplicas": max(0, replicas - ready),
            "conditions": [
                _condition(previous, "Available", *available),
                _condition(previous, "Progressing", *progressing),
            ],
        }

    def _statefulset_status(self, obj: Mapping[str, Any], st: WorkloadRollout, *, replicas: int, ready: int,
                            old: int, revision: str) -> JsonObj:
        name = obj["metadata"]["name"]
        current = st.stable_revision or revision
        return {
            "observedGeneration": obj["metadata"]["generation"],
            "replicas": replicas,
            "readyReplicas": ready,
            "availableReplicas": ready,
            "currentReplicas": replicas - st.updated if current != revision else replicas,
            "updatedReplicas": st.updated,
            "currentRevision": f"{name}-{current}",
            "updateRevision": f"{name}-{revision}",
            "collisionCount": 0,
        }

    async def _sync_replicasets(self, obj: Mapping[str, Any], st: WorkloadRollout, revision: str, old: int,
                                broken: bool) -> None:
        """Keep the Deployment's ReplicaSets as its controller does (see `replicasets`): one per
        template, the current one holding the highest revision (which the Deployment's revision
        annotation repeats), replicas as the rollout has them, old ones pruned past the limit."""
        meta, spec = obj["metadata"], obj.get("spec", {})
        namespace = meta["namespace"]
        owned = {(rs["metadata"].get("labels") or {}).get(HASH_LABEL): rs
                 for rs in self.emulator.owned_objects(REPLICASETS, meta["uid"])
                 if rs["metadata"].get("namespace") == namespace}
        current = owned.get(revision)
        others = [rs for h, rs in owned.items() if h != revision]
        if current is None:
            created = replicaset_for(obj, spec.get("template", {}), revision, next_revision(others))
            current = await self.emulator.create_object(REPLICASETS, created, namespace=namespace,
                                                        field_manager=CONTROLLER_MANAGER)
            owned[revision] = current
        elif others and revision_of(current) < max(revision_of(rs) for rs in others):
            annotations = promoted_annotations(current, obj, next_revision(others))
            current = await self.emulator.patch_object(REPLICASETS, namespace, current["metadata"]["name"],
                                                       {"metadata": {"annotations": annotations}},
                                                       field_manager=CONTROLLER_MANAGER)
            owned[revision] = current
        for template_hash, rs in owned.items():
            if template_hash == revision:
                replicas, ready = st.updated, st.updated - (1 if broken else 0)
            elif template_hash == st.stable_revision:
                replicas = ready = old
            else:
                replicas = ready = 0
            name = rs["metadata"]["name"]
            if (rs.get("spec") or {}).get("replicas") != replicas:
                rs = await self.emulator.patch_object(REPLICASETS, namespace, name, {"spec": {"replicas": replicas}},
                                                      field_manager=CONTROLLER_MANAGER)
            status = replicaset_status(replicas, ready, rs["metadata"].get("generation", 1))
            if rs.get("status") != status:
                rs = await self.emulator.patch_object(REPLICASETS, namespace, name, {"status": status},
                                                      subresource="status", field_manager=CONTROLLER_MANAGER)
            owned[template_hash] = rs
        limit = int(spec.get("revisionHistoryLimit", 10))
        for name in to_prune(owned.values(), revision, limit):
            await self.emulator.delete_object(REPLICASETS, namespace, name)
        wanted = str(revision_of(current))
        if (meta.get("annotations") or {}).get(REVISION) != wanted:
            await self.emulator.patch_object(DEPLOYMENTS, namespace, meta["name"],
                                             {"metadata": {"annotations": {REVISION: wanted}}},
                                             field_manager=CONTROLLER_MANAGER)

    async def _sync_pods(self, rtype: ResourceType, obj: Mapping[str, Any], st: WorkloadRollout, revision: str,
                         old: int, broken: bool) -> None:
        """Make the workload's pods match the rollout: `old` on the stable template, the rest new."""
        meta = obj["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        hash_label = "pod-template-hash" if rtype == DEPLOYMENTS else "controller-revision-hash"
        wanted: dict[str, tuple[JsonObj, str, bool]] = {}
        # Old pods first: a StatefulSet updates from the highest ordinal down.
        plans: list[tuple[JsonObj, str, int, bool]] = []
        if old and st.stable_template is not None and st.stable_revision is not None:
            plans.append((st.stable_template, st.stable_revision, old, False))
        plans.append((st.update_template or {}, revision, st.updated, broken))
        ordinal = 0
        for template, rev, count, with_broken in plans:
            for i in range(count):
                pod_name = f"{name}-{rev}-{i}" if rtype == DEPLOYMENTS else f"{name}-{ordinal}"
                ordinal += 1
                unready = with_broken and i == count - 1
                wanted[pod_name] = (template, rev, unready)
        # A Deployment's pods are its ReplicaSets' (one per template, named by its hash), as the
        # ReplicaSet controller creates them; a StatefulSet's are its own.
        owners: dict[str, JsonObj] = {}
        if rtype == DEPLOYMENTS:
            for rs in self.emulator.owned_objects(REPLICASETS, meta["uid"]):
                if rs["metadata"].get("namespace") == namespace:
                    owners[(rs["metadata"].get("labels") or {}).get(HASH_LABEL, "")] = {
                        "apiVersion": REPLICASETS.api_version, "kind": REPLICASETS.kind,
                        "name": rs["metadata"]["name"], "uid": rs["metadata"]["uid"],
                        "controller": True, "blockOwnerDeletion": True}
        workload_owner = {"apiVersion": rtype.api_version, "kind": rtype.kind, "name": name,
                          "uid": meta["uid"], "controller": True}
        existing = {p["metadata"]["name"]: p
                    for uid in [meta["uid"], *(o["uid"] for o in owners.values())]
                    for p in self.emulator.owned_objects(PODS, uid)
                    if p["metadata"].get("namespace") == namespace}
        for pod_name, pod in existing.items():
            rev = (pod["metadata"].get("labels") or {}).get(hash_label, "")
            if pod_name not in wanted or (rtype == STATEFULSETS and rev != wanted[pod_name][1]):
                await self.emulator.delete_object(PODS, namespace, pod_name)
                existing[pod_name] = {}
        for pod_name, (template, rev, unready) in wanted.items():
            if existing.get(pod_name):
                pod = existing[pod_name]
                status = _pod_status(template, ready=not unready, pod_ip=self.pod_ip)
                if pod.get("status", {}).get("phase") != status["phase"] or \
                        _pod_ready(pod) != (not unready):
                    await self.emulator.patch_object(PODS, namespace, pod_name, {"status": status},
                                                     subresource="status", field_manager=KUBELET)
                continue
            labels = {**(template.get("metadata", {}).get("labels") or {}), hash_label: rev}
            pod = {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {
                    "name": pod_name, "namespace": namespace, "labels": labels,
                    "annotations": dict(template.get("metadata", {}).get("annotations") or {}),
                    "ownerReferences": [owners.get(rev, workload_owner)],
                },
                "spec": copy.deepcopy(template.get("spec", {})),
            }
            await self.emulator.create_object(PODS, pod, namespace=namespace, field_manager=CONTROLLER_MANAGER)
            await self.emulator.patch_object(PODS, namespace, pod_name,
                                             {"status": _pod_status(template, ready=not unready, pod_ip=self.pod_ip)},
                                             subresource="status", field_manager=KUBELET)


def workload_of(emulator: ApiServerEmulator, pod: Mapping[str, Any]) -> str:
    """The name of the workload that runs a pod: its controller, or, for a Deployment's pod,
    its ReplicaSet's controller (as `kubectl describe pod` follows "Controlled By"); "" for none."""
    meta = pod.get("metadata") or {}
    owner = next((o for o in meta.get("ownerReferences") or [] if o.get("controller")), None)
    if owner is None:
        return ""
    if owner.get("kind") != REPLICASETS.kind:
        return str(owner.get("name", ""))
    replicaset = emulator.stored_object(REPLICASETS, meta.get("namespace"), owner.get("name", ""))
    rs_owner = next((o for o in ((replicaset or {}).get("metadata") or {}).get("ownerReferences") or []
                     if o.get("controller")), None)
    return str((rs_owner or owner).get("name", ""))


def _condition(previous: Mapping[str, JsonObj], type_: str, status: str, reason: str, message: str) -> JsonObj:
    old = previous.get(type_)
    now = now_rfc3339()
    changed = old is None or old.get("status") != status
    return {
        "type": type_, "status": status, "reason": reason, "message": message,
        "lastUpdateTime": now if old is None or old.get("reason") != reason else old.get("lastUpdateTime", now),
        "lastTransitionTime": now if changed or old is None else old.get("lastTransitionTime", now),
    }


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in pod.get("status", {}).get("conditions", []))


def _pod_status(template: Mapping[str, Any], *, ready: bool, pod_ip: str) -> JsonObj:
    containers = template.get("spec", {}).get("containers", [])
    flag = "True" if ready else "False"
    now = now_rfc3339()
    return {
        "phase": "Running",
        "podIP": pod_ip,  # every pod's servers run on this machine, on this one address
        "conditions": [{"type": "Ready", "status": flag, "lastTransitionTime": now},
                       {"type": "ContainersReady", "status": flag, "lastTransitionTime": now}],
        "containerStatuses": [
            {"name": c.get("name", ""), "image": c.get("image", ""), "ready": ready,
             "restartCount": 0 if ready else 3,
             "state": {"running": {"startedAt": now}} if ready else
             {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off restarting failed container"}}}
            for c in containers
        ],
    }


def is_rollout_complete(obj: Mapping[str, Any]) -> bool:
    """`kubectl rollout status` for a Deployment or StatefulSet, from the object alone."""
    meta, spec, status = obj.get("metadata", {}), obj.get("spec", {}), obj.get("status", {}) or {}
    replicas = int(spec.get("replicas", 1))
    if status.get("observedGeneration", 0) < meta.get("generation", 1):
        return False
    if obj.get("kind") == "StatefulSet":
        return (status.get("updatedReplicas", 0) == replicas and status.get("readyReplicas", 0) == replicas
                and status.get("currentRevision") == status.get("updateRevision"))
    conditions = {c["type"]: c for c in status.get("conditions", [])}
    if conditions.get("Progressing", {}).get("reason") == "ProgressDeadlineExceeded":
        return False
    return (status.get("updatedReplicas", 0) == replicas and status.get("replicas", 0) == replicas
            and status.get("availableReplicas", 0) == replicas)


