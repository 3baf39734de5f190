"""What the watch caches keep of a workload (issue 16), and why a write planned from that trimmed
copy is still exact: the strategic merge patch built from it, applied to the full object on the
server (the local API server's strategic merge patch), gives what planning from the full object
gives — adoption, rollback, release, master flags — and never touches what the cache dropped."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moonlease_dev.testbed.kube import strategic_merge_patch
from moonlease_operator.api import MasterSpec
from moonlease_operator.core.changes import ChangeAction, WorkloadChange
from moonlease_operator.core.connector_delivery import SETTINGS_VOLUME, adoption_hash
from moonlease_operator.core.kept_fields import LAST_APPLIED, trim_object, trim_pod
from moonlease_operator.core.settings import build_master_desired, build_master_settings, build_target_desired
from moonlease_operator.core.merge_patches import build_strategic_merge_patch
from moonlease_operator.core.slots import build_update

pytestmark = pytest.mark.unit

FOREIGN_ENV = [{"name": f"APP_SETTING_{i}", "value": "x" * 20} for i in range(30)]
OUR_ENV = [{"name": "MOONLEASE_SETTINGS_METRICS_PORT", "value": "9411"},
           {"name": "VLLM_MOONCAKE_STORE_SELECTIVE_LEASE", "value": "0"}]


def full_workload(env: list[dict[str, Any]] | None, *, mounts: bool = True, kind: str = "Deployment") -> dict[str, Any]:
    vllm: dict[str, Any] = {
        "name": "vllm", "image": "vllm:0.9.1", "args": ["serve", "/models/llama", "--port=8000"],
        "resources": {"limits": {"cpu": "8", "memory": "64Gi"}}, "ports": [{"name": "http", "containerPort": 8000}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": 8000}}}
    if env is not None:
        vllm["env"] = copy.deepcopy(env)
    if mounts:
        vllm["volumeMounts"] = [{"name": "models", "mountPath": "/models"}]
    sidecar = {"name": "proxy", "image": "envoy:1", "args": ["--port=9000"], "env": [{"name": "LOG", "value": "info"}]}
    return {
        "apiVersion": "apps/v1", "kind": kind,
        "metadata": {"name": "w", "namespace": "ns", "resourceVersion": "7", "generation": 3, "labels": {"app": "w"},
                     "annotations": {LAST_APPLIED: "{...}", "team": "a"},
                     "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}]},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "w"}},
                 "template": {"metadata": {"labels": {"app": "w"}},
                              "spec": {"containers": [vllm, sidecar], "nodeSelector": {"gpu": "h100"},
                                       "volumes": [{"name": "models", "emptyDir": {}}]}}},
        "status": {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2, "observedGeneration": 3},
    }


def master_workload() -> dict[str, Any]:
    obj = full_workload(FOREIGN_ENV)
    obj["spec"]["template"]["spec"]["containers"][0]["args"] = ["--rpc_port=50051", "--eviction_ratio=0.05"]
    return obj


def adopt(config_map: str = "w-moonlease", revision: int = 1, applied: int | None = None) -> Any:
    def change(obj: dict[str, Any]) -> WorkloadChange:
        return WorkloadChange(kind=obj["kind"], name="w", action=ChangeAction.APPLY, policy="fleet", place="vllm",
                              desired=build_target_desired(obj, "vllm", config_map),
                              config_hash=adoption_hash(config_map), revision=revision, applied_revision=applied)
    return change


def server_side(full: dict[str, Any], change_of: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(what the server holds after our patch planned from the trimmed copy, what planning
    from the full object would have written)."""
    trimmed = trim_object(full, full["kind"])
    new_trimmed = build_update(trimmed, change_of(trimmed))
    expected = build_update(full, change_of(full))
    assert (new_trimmed is None) == (expected is None)
    if new_trimmed is None:
        return full, full
    patched = strategic_merge_patch(full, build_strategic_merge_patch(trimmed, new_trimmed))
    return patched, expected  # type: ignore[return-value]


def test_the_cache_keeps_what_the_planner_reads_and_drops_the_rest() -> None:
    full = full_workload([*FOREIGN_ENV, *OUR_ENV])
    kept = trim_object(full, "Deployment")
    meta, vllm = kept["metadata"], kept["spec"]["template"]["spec"]["containers"][0]
    # Of managedFields only who wrote which part (a conflicting writer is named from it)
    assert meta["managedFields"] == [{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}]
    assert meta["annotations"] == {"team": "a"} and meta["resourceVersion"] == "7"
    assert vllm == {"name": "vllm", "image": "vllm:0.9.1", "args": full["spec"]["template"]["spec"]["containers"][0]["args"],
                    "env": OUR_ENV, "volumeMounts": [{"name": "models", "mountPath": "/models"}]}
    assert kept["spec"]["template"]["spec"]["containers"][1]["env"] == []  # had env: still has (the undo's shape)
    assert kept["status"] == full["status"] and kept["spec"]["replicas"] == 2
    assert len(json.dumps(kept)) < len(json.dumps(full)) / 2
    assert full["metadata"]["managedFields"]  # the input is not changed


@pytest.mark.parametrize("env", [None, [], FOREIGN_ENV, [*FOREIGN_ENV, *OUR_ENV]])
@pytest.mark.parametrize("kind", ["Deployment", "StatefulSet"])
def test_adoption_rollback_and_release_from_the_trimmed_copy_are_exact_on_the_server(
        env: list[dict[str, Any]] | None, kind: str) -> None:
    full = full_workload(env, kind=kind)
    adopted, expected = server_side(full, adopt())
    assert adopted == expected and adopted != full
    # The next attempt moves it to another settings ConfigMap, then rolls back to the first.
    moved, expected = server_side(adopted, adopt("other-moonlease", revision=2, applied=1))
    assert moved == expected
    back, expected = server_side(moved, lambda o: WorkloadChange(kind=kind, name="w", action=ChangeAction.ROLLBACK,
                                                                 policy="fleet", place="vllm", revision=2))
    assert back == expected
    released, expected = server_side(back, lambda o: WorkloadChange(kind=kind, name="w", action=ChangeAction.RELEASE,
                                                                    policy="fleet", place="vllm"))
    assert released == expected
    # What the cache never held came through untouched, and the release gave back the original.
    containers = released["spec"]["template"]["spec"]["containers"]
    assert containers[0].get("env") == full["spec"]["template"]["spec"]["containers"][0].get("env")
    assert containers[0]["resources"] and containers[1]["env"] == [{"name": "LOG", "value": "info"}]
    assert released["spec"]["template"] == full["spec"]["template"]
    assert not any(v["name"] == SETTINGS_VOLUME for v in released["spec"]["template"]["spec"]["volumes"])


def test_master_flags_from_the_trimmed_copy_are_exact_on_the_server() -> None:
    settings_ = build_master_settings(MasterSpec(name="m", eviction_ratio=0.1, eviction_high_watermark_ratio=0.8))

    def change(obj: dict[str, Any]) -> WorkloadChange:
        return WorkloadChange(kind="Deployment", name="w", action=ChangeAction.APPLY, policy="fleet", place="vllm",
                              desired=build_master_desired(settings_), config_hash=settings_.config_hash, revision=1)

    patched, expected = server_side(master_workload(), change)
    assert patched == expected and "--eviction_ratio=0.1" in patched["spec"]["template"]["spec"]["containers"][0]["args"]
    assert patched["spec"]["template"]["spec"]["containers"][0]["env"] == FOREIGN_ENV


def test_a_pod_keeps_what_health_and_the_settings_scrape_read() -> None:
    pod = {"metadata": {"name": "p", "labels": {"app": "w"}, "annotations": {"moonlease.io/config-hash": "h"},
                        "managedFields": [{}]},
           "spec": {"containers": [{"name": "vllm", "args": ["serve"], "env": FOREIGN_ENV, "resources": {}}],
                    "volumes": [{"name": SETTINGS_VOLUME, "configMap": {"name": "w-moonlease"}}], "nodeName": "n1"},
           "status": {"phase": "Running", "podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}],
                      "containerStatuses": [{"name": "vllm", "ready": True}], "hostIP": "10.1.1.1", "qosClass": "x"}}
    kept = trim_pod(pod)
    assert kept["metadata"]["annotations"] == pod["metadata"]["annotations"] and "managedFields" not in kept["metadata"]
    assert kept["spec"] == {"containers": [{"name": "vllm", "args": ["serve"], "env": []}],
                            "volumes": [{"name": SETTINGS_VOLUME}]}
    assert kept["status"] == {k: pod["status"][k] for k in ("phase", "podIP", "conditions", "containerStatuses")}


_name = st.sampled_from(["a", "b", "c", "d"])
_entry = st.fixed_dictionaries({"name": _name}, optional={"value": st.text("xy", max_size=2),
                                                          "mountPath": st.sampled_from(["/p", "/q"])})
_env = st.lists(_entry, max_size=4, unique_by=lambda e: e["name"])
_container = st.fixed_dictionaries({"name": _name}, optional={"env": _env, "args": st.lists(st.text("ab", max_size=2),
                                                                                           max_size=3)})
_spec = st.fixed_dictionaries({}, optional={"containers": st.lists(_container, max_size=3, unique_by=lambda c: c["name"]),
                                           "volumes": _env, "replicas": st.integers(0, 3)})


@settings(max_examples=300, deadline=None)
@given(old=_spec, new=_spec)
def test_strategic_merge_patch_turns_old_into_new(old: dict[str, Any], new: dict[str, Any]) -> None:
    patched = strategic_merge_patch(old, build_strategic_merge_patch(old, new))
    # Element order within a merged list is the server's business; the elements are ours.
    def canonical(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {k: canonical(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return sorted((canonical(v) for v in obj), key=lambda v: json.dumps(v, sort_keys=True))
        return obj
    assert canonical(patched) == canonical(new)
