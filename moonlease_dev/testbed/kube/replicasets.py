"""The ReplicaSets the Deployment controller keeps for each Deployment, as `kubectl rollout
history` and `kubectl rollout undo` read them. Pure: objects in, objects or decisions out.

One ReplicaSet per pod template a Deployment has run, named `<deployment>-<pod-template-hash>`,
controlled by the Deployment (ownerReference `controller: true`), its selector and template
labelled with `pod-template-hash`. The revision annotation (`deployment.kubernetes.io/revision`)
numbers the templates in the order they became current: a new template gets the highest
revision plus one; a template that comes back (a rollback) takes a new number too, and its old
number moves to `deployment.kubernetes.io/revision-history` — so `rollout history` never lists
one template twice, as with a real controller. Old ReplicaSets scaled to zero beyond
`spec.revisionHistoryLimit` are deleted, oldest revision first.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

JsonObj = dict[str, Any]

HASH_LABEL = "pod-template-hash"
REVISION = "deployment.kubernetes.io/revision"
REVISION_HISTORY = "deployment.kubernetes.io/revision-history"
DESIRED_REPLICAS = "deployment.kubernetes.io/desired-replicas"
MAX_REPLICAS = "deployment.kubernetes.io/max-replicas"
#: Deployment annotations the controller does not copy to its ReplicaSets (kubectl's
#: `rollout undo` skips the same ones when it copies a ReplicaSet's annotations back).
NOT_COPIED = frozenset({"kubectl.kubernetes.io/last-applied-configuration", REVISION, REVISION_HISTORY,
                        DESIRED_REPLICAS, MAX_REPLICAS, "deprecated.deployment.rollback.to"})


def revision_of(obj: Mapping[str, Any]) -> int:
    """The revision annotation as a number (0 when missing or unreadable)."""
    try:
        return int(((obj.get("metadata") or {}).get("annotations") or {}).get(REVISION, 0))
    except (TypeError, ValueError):
        return 0


def _max_surge(deployment: Mapping[str, Any], replicas: int) -> int:
    surge = (((deployment.get("spec") or {}).get("strategy") or {}).get("rollingUpdate") or {}).get("maxSurge", "25%")
    if isinstance(surge, str) and surge.endswith("%"):
        return -(-replicas * int(surge[:-1]) // 100)  # rounded up, as the controller rounds surge
    return int(surge)


def copied_annotations(deployment: Mapping[str, Any]) -> dict[str, str]:
    """The Deployment's annotations a ReplicaSet carries (e.g. `kubernetes.io/change-cause`)."""
    return {k: v for k, v in ((deployment.get("metadata") or {}).get("annotations") or {}).items()
            if k not in NOT_COPIED}


def replicaset_for(deployment: Mapping[str, Any], template: Mapping[str, Any], template_hash: str,
                   revision: int) -> JsonObj:
    """A new ReplicaSet of `deployment` for one pod template (replicas 0: `replica_counts` sets them)."""
    meta = deployment["metadata"]
    replicas = int((deployment.get("spec") or {}).get("replicas", 1))
    labeled = copy.deepcopy(dict(template))
    labeled.setdefault("metadata", {})
    labeled["metadata"] = {**labeled["metadata"],
                           "labels": {**(labeled["metadata"].get("labels") or {}), HASH_LABEL: template_hash}}
    selector = copy.deepcopy((deployment.get("spec") or {}).get("selector") or {})
    selector["matchLabels"] = {**(selector.get("matchLabels") or {}), HASH_LABEL: template_hash}
    return {
        "apiVersion": "apps/v1", "kind": "ReplicaSet",
        "metadata": {
            "name": f"{meta['name']}-{template_hash}", "namespace": meta["namespace"],
            "labels": dict(labeled["metadata"]["labels"]),
            "annotations": {**copied_annotations(deployment), REVISION: str(revision),
                            DESIRED_REPLICAS: str(replicas), MAX_REPLICAS: str(replicas + _max_surge(deployment, replicas))},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": meta["name"],
                                 "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}],
        },
        "spec": {"replicas": 0, "selector": selector, "template": labeled},
    }


def promoted_annotations(replicaset: Mapping[str, Any], deployment: Mapping[str, Any], revision: int) -> dict[str, str]:
    """The annotations of an old ReplicaSet whose template is current again: the next revision,
    its former revisions in the history annotation, the Deployment's copied annotations."""
    current = dict((replicaset.get("metadata") or {}).get("annotations") or {})
    former = [r for r in current.get(REVISION_HISTORY, "").split(",") if r]
    if current.get(REVISION) and current[REVISION] != str(revision):
        former.append(current[REVISION])
    result = {**{k: v for k, v in current.items() if k in NOT_COPIED}, **copied_annotations(deployment),
              REVISION: str(revision)}
    if former:
        result[REVISION_HISTORY] = ",".join(former)
    return result


def next_revision(replicasets: Iterable[Mapping[str, Any]]) -> int:
    return max((revision_of(rs) for rs in replicasets), default=0) + 1


def to_prune(replicasets: Iterable[Mapping[str, Any]], current_hash: str, limit: int) -> list[str]:
    """Names of the old ReplicaSets past `revisionHistoryLimit`: scaled to zero, not the current
    one, oldest revisions first."""
    old = sorted((rs for rs in replicasets
                  if (rs["metadata"].get("labels") or {}).get(HASH_LABEL) != current_hash
                  and int((rs.get("spec") or {}).get("replicas", 0)) == 0
                  and not int((rs.get("status") or {}).get("replicas", 0))),
                 key=revision_of)
    return [rs["metadata"]["name"] for rs in old[:max(0, len(old) - limit)]]


def replicaset_status(replicas: int, ready: int, generation: int) -> JsonObj:
    return {"replicas": replicas, "fullyLabeledReplicas": replicas, "readyReplicas": ready,
            "availableReplicas": ready, "observedGeneration": generation}
