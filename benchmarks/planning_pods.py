"""Planning one verifying reconcile at fleet scale: the pods of a namespace of 5,000 workloads, a
policy rolling out over 100 of them. Pure planning (no I/O), through the planner's public API
(`plan_reconcile`), min of `--repeat`.

A reconcile that verifies a stage reads the namespace's pods and asks, per target, for its pods
(health, then the Ready pods whose connectors it checks). `core.pod_set.PodSet` finds them
through a label index: the pod cache's own, or one built once per plan. The lookups themselves
are also timed through the public core functions the planner calls (`evaluate_health`,
`current_ready_pods`), given the pods as a plain list (a scan of every pod per target, what the
planner did before the index) and as a `PodSet`.

    .venv/bin/python benchmarks/planning_pods.py --workloads 5000 --targets 100
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from moonlease_dev.testbed.kube.manifests import deployment_manifest
from moonlease_operator.api import read_spec
from moonlease_operator.core.health import current_ready_pods, evaluate_health
from moonlease_operator.core.label_index import LabelIndex
from moonlease_operator.core.pod_set import PodSet
from moonlease_operator.core.rollout import Observed, PolicyRef, plan_reconcile
from moonlease_operator.core.status import read_status

NAMESPACE = "ns"
T0 = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)
VLLM = {"name": "vllm", "image": "vllm:1", "args": ["serve", "m"]}
MASTER = {"name": "master", "image": "reg/mooncake-master:v0.3.14",
          "args": ["--rpc_port=50051", "--eviction_ratio=0.05"]}


def workload(name: str, container: Mapping[str, Any], labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A settled Deployment with one replica (health then looks at its pods)."""
    obj = deployment_manifest(name, namespace=NAMESPACE, replicas=1, containers=[container], labels=labels)
    obj["metadata"]["generation"] = 1
    obj["status"] = {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1,
                     "availableReplicas": 1}
    return obj


def pod_of(obj: Mapping[str, Any]) -> dict[str, Any]:
    meta, template = obj["metadata"], obj["spec"]["template"]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{meta['name']}-abc-0", "namespace": meta["namespace"],
                         "labels": dict(template["metadata"]["labels"]),
                         "annotations": dict(template["metadata"].get("annotations") or {})},
            "spec": template["spec"],
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}


def best_of(repeat: int, run: Callable[[], object]) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return min(times)


def lookups(targets: Sequence[Mapping[str, Any]], pods: Sequence[Mapping[str, Any]] | PodSet) -> None:
    """What a verifying plan asks per target: its health, then its Ready pods."""
    for obj in targets:
        evaluate_health(obj, pods)
        current_ready_pods(obj, pods)


def measure(workloads: int, targets: int, repeat: int) -> dict[str, Any]:
    fleet = [workload("mooncake-master", MASTER)] + [
        workload(f"vllm-{role}-{i:04d}", VLLM, {"fleet/role": role, "fleet/group": "rollout"})
        for i in range(targets) for role in (("prefill",) if i % 2 == 0 else ("decode",))]
    bulk = [workload(f"other-{i:05d}", VLLM, {"fleet/role": "decode", "fleet/group": f"g{i % 50:02d}"})
            for i in range(workloads - targets)]
    spec = read_spec({
        "master": {"name": "mooncake-master", "evictionRatio": 0.1, "requireApprovalForRestart": False},
        "connector": {"leaseMode": "selective"},
        "targets": [{"role": role, "mooncakeVersion": "0.3.14",
                     "selector": {"matchLabels": {"fleet/role": role, "fleet/group": "rollout"}}}
                    for role in ("prefill", "decode")],
        "rollout": {"stageTimeoutSeconds": 60}})
    everything = fleet + bulk
    by_key = {(w["kind"], w["metadata"]["name"]): w for w in everything}
    policy = PolicyRef("fleet", NAMESPACE, 1, "2026-01-01T00:00:00Z")
    first = plan_reconcile(spec=spec, policy=policy, previous=read_status({}), observed=Observed(workloads=by_key),
                           now=T0)
    pods = [pod_of(w) for w in everything]
    cache_index = LabelIndex()  # what the operator's pod cache keeps
    for p in pods:
        cache_index.put(p["metadata"]["name"], p["metadata"]["labels"])
    observed = Observed(workloads=by_key, pods=pods, pod_index=cache_index)

    def plan(seen: Observed) -> Callable[[], object]:
        return lambda: plan_reconcile(spec=spec, policy=policy, previous=first.status, observed=seen, now=T0)

    indexed = best_of(repeat, plan(observed))
    indexed_here = best_of(repeat, plan(dataclasses.replace(observed, pod_index=None)))  # PodSet indexes them
    scanned = best_of(repeat, lambda: lookups(fleet, pods))
    looked_up = best_of(repeat, lambda: lookups(fleet, PodSet(pods, cache_index)))
    return {"workloads": len(everything), "pods": len(pods), "targets": len(fleet),
            "stage": [s.phase.value for s in first.status.stages][:1], "repeat": repeat,
            "plan_ms_pod_cache_index": round(indexed * 1000, 1),
            "plan_ms_pod_index_built_per_plan": round(indexed_here * 1000, 1),
            "lookups_ms_scan_per_target": round(scanned * 1000, 1),
            "lookups_ms_pod_set": round(looked_up * 1000, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", type=int, default=5000)
    parser.add_argument("--targets", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.workloads, args.targets, args.repeat), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
