"""The rollout planner: given the policy, what the cluster shows and the last status,
what to change now, what the status becomes, and which events say so. Pure.

The kopf timer (`handlers.py`) calls `plan_fetch` (what to read), then `plan_reconcile`, then
writes the status, posts the events and applies the changes — in that order, so that the status
and an event announce every change (a master restart above all) before it happens. State lives in
the policy status (stages, revision) and in the workloads' own annotations (rollback snapshots),
so a restarted operator resumes where the last one stopped, and re-planning an applied policy
yields the same status and no changes: no writes.

A rollout attempt (`status.revision`) walks `spec.rollout.stages` in order. A stage whose
workloads already hold the desired configuration is Skipped (nothing restarts: the master only
restarts when its settings change); otherwise it is patched (Progressing) and Succeeds once every
workload's controller reports the rollout complete, its pods run the new configuration hash and,
for vLLM workloads, every Ready pod's running connector reports the settings hash the policy
expects (`core.connector_delivery`: connector settings travel in a ConfigMap per workload and
apply live; only adopting a workload changes its pod template).
A stage that times out, or whose pods fail, Fails; with `onFailure: rollback` every stage the
attempt changed is then restored, last stage first, each through its workload's own rolling
update (so `maxUnavailable` holds; Dynamo #13620), and the policy is Degraded until its spec
changes. `onFailure: halt` leaves everything where it stopped.

Pure functions over frozen inputs, one concept per module: `inputs` (what is read, what is
decided), `admission` (refusals and waits), `held` (plans that change nothing), `context` (the
facts of one attempt and the progress its steps hand on), `ab_test`, `reverts` (conflicting
writers), `verification` (settings on the pods), `orphans` (what is no longer covered),
`forward`, `backward`, `report` (status and events), `reconcile` (the steps in order),
`preview` (dry run) and `release` (deletion).
"""

from moonlease_operator.core.rollout.common import MAX_LISTED
from moonlease_operator.core.rollout.inputs import (
    FetchPlan,
    Observed,
    PolicyRef,
    ReconcilePlan,
    config_maps_to_restore,
    plan_fetch,
    settings_config_maps_to_read,
)
from moonlease_operator.core.rollout.preview import PolicyPreview, WorkloadPreview, plan_preview
from moonlease_operator.core.rollout.reconcile import plan_reconcile
from moonlease_operator.core.rollout.release import ReleasePlan, plan_release

__all__ = [
    "MAX_LISTED",
    "FetchPlan",
    "Observed",
    "PolicyPreview",
    "PolicyRef",
    "ReconcilePlan",
    "ReleasePlan",
    "WorkloadPreview",
    "config_maps_to_restore",
    "plan_fetch",
    "plan_preview",
    "plan_reconcile",
    "plan_release",
    "settings_config_maps_to_read",
]
