"""Planning one verifying reconcile at fleet scale (issue 16): the pods of a namespace of 5,000
workloads, a policy rolling out over 100 of them. Pure planning (no I/O), the pod index against
the scan it replaced, measured side by side in one run (min of `--repeat`).

A reconcile that verifies a stage reads the namespace's pods and asks, per target, for its
pods (health, then the Ready pods whose connectors it checks). Scanning every pod per target
is O(targets x pods); `core.pod_set.PodSet` finds them through a label index.

    .venv/bin/python benchmarks/planning_pods.py --workloads 5000 --targets 100
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moonlease_operator.api import read_spec  # noqa: E402
from moonlease_operator.core import rollout  # noqa: E402
from moonlease_operator.core.label_index import LabelIndex  # noqa: E402
from moonlease_operator.core.rollout import Observed, PolicyRef, plan_reconcile  # noqa: E402
from moonlease_operator.core.status import read_status  # noqa: E402
from tests.unit.test_rollout_plan import SPEC, T0, deployment, master_deployment  # noqa: E402


def pod_of(workload: dict[str, Any]) -> dict[str, Any]:
    meta = workload["metadata"]
    template = workload["spec"]["template"]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{meta['name']}-abc-0", "namespace": meta["namespace"],
                         "labels": dict(template["metadata"]["labels"]),
                         "annotations": dict(template["metadata"].get("annotations") or {})},
            "spec": template["spec"],
            "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}


def measure(workloads: int, targets: int, repeat: int) -> dict[str, Any]:
    fleet = [master_deployment()] + [
        deployment(f"vllm-{role}-{i:04d}", labels={"fleet/role": role, "fleet/group": "rollout"}, replicas=1)
        for i in range(targets) for role in (("prefill",) if i % 2 == 0 else ("decode",))]
    bulk = [deployment(f"other-{i:05d}", labels={"fleet/role": "decode", "fleet/group": f"g{i % 50:02d}"},
                       replicas=1) for i in range(workloads - targets)]
    spec = read_spec({**SPEC, "targets": [
        {"role": role, "mooncakeVersion": "0.3.14",
         "selector": {"matchLabels": {"fleet/role": role, "fleet/group": "rollout"}}}
        for role in ("prefill", "decode")]})
    everything = fleet + bulk
    for w in everything:  # settled: health then looks at the pods
        w["status"] = {"observedGeneration": 1, "replicas": 1, "updatedReplicas": 1, "readyReplicas": 1,
                       "availableReplicas": 1}
    policy = PolicyRef("fleet", "ns", 1, "2026-01-01T00:00:00Z")
    first = plan_reconcile(spec=spec, policy=policy, previous=read_status({}),
                           observed=Observed(workloads={(w["kind"], w["metadata"]["name"]): w for w in everything}),
                           now=T0)
    pods = [pod_of(w) for w in everything]
    cache_index = LabelIndex()  # what the operator's pod cache keeps
    for p in pods:
        cache_index.put(p["metadata"]["name"], p["metadata"]["labels"])
    observed = Observed(workloads={(w["kind"], w["metadata"]["name"]): w for w in everything},
                        pods=pods, pod_index=cache_index)

    def best() -> float:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            plan_reconcile(spec=spec, policy=policy, previous=first.status, observed=observed, now=T0)
            times.append(time.perf_counter() - t0)
        return min(times)

    indexed = best()
    observed = dataclasses.replace(observed, pod_index=None)
    indexed_here = best()  # no cache index: PodSet indexes the pods itself
    original = rollout._Planner._pods
    rollout._Planner._pods = lambda self: self.observed.pods  # type: ignore[method-assign,assignment,return-value]
    try:
        scanned = best()
    finally:
        rollout._Planner._pods = original  # type: ignore[method-assign]
    return {"workloads": len(everything), "pods": len(observed.pods or ()), "targets": len(fleet),
            "stage": [s.phase.value for s in first.status.stages][:1], "repeat": repeat,
            "plan_ms_pod_cache_index": round(indexed * 1000, 1),
            "plan_ms_pod_index_built_per_plan": round(indexed_here * 1000, 1),
            "plan_ms_scan_per_target": round(scanned * 1000, 1)}


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
