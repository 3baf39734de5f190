"""The desired state of targets and master, and the exact undo of every change. Pure: plain dicts."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from moonlease_dev.testbed.kube import merge_patch
from moonlease_settings.config import SELECTIVE_LEASE_ENV, MoonleaseConnectorConfig
from moonlease_settings.settings_file import SETTINGS_FILE_NAME, SETTINGS_FILE_PATH, parse_settings_file
from moonlease_operator.api import ConnectorSpec, LeaseMode, MasterConfigMapSpec, MasterSpec
from moonlease_operator.api import Reason
from moonlease_operator.core.changes import ChangeAction, WorkloadChange
from moonlease_operator.core.connector_delivery import (
    SETTINGS_VOLUME,
    adoption_hash,
    build_settings_file_desired,
    settings_config_map_stub,
)
from moonlease_operator.core.manageability import evaluate_config_map, evaluate_master, evaluate_target
from moonlease_operator.core.settings import (
    build_config_map_desired,
    build_connector_settings,
    build_master_desired,
    build_master_settings,
    build_target_desired,
)
from moonlease_operator.core.merge_patches import build_merge_patch
from moonlease_operator.core.slots import (
    CONFIG_HASH_ANNOTATION,
    ORIGINAL_ANNOTATION,
    POLICY_LABEL,
    ROLLBACK_ANNOTATION,
    build_update,
    describe_update,
)

pytestmark = pytest.mark.unit

SELECTIVE = build_connector_settings(ConnectorSpec(lease_mode=LeaseMode.SELECTIVE))
LEASE_ALL = build_connector_settings(ConnectorSpec())
#: Settings ConfigMaps a workload can be adopted onto (different names: different adoptions).
CM, OTHER_CM, THIRD_CM = "w-moonlease", "other-moonlease", "third-moonlease"


def workload(*containers: dict[str, Any], kind: str = "Deployment", annotations: dict[str, str] | None = None) -> dict[str, Any]:
    template: dict[str, Any] = {"metadata": {"labels": {"app": "x"}}, "spec": {"containers": list(containers)}}
    if annotations is not None:
        template["metadata"]["annotations"] = annotations
    return {"apiVersion": "apps/v1", "kind": kind, "metadata": {"name": "w", "namespace": "ns", "labels": {"app": "x"}},
            "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "x"}}, "template": template}}


def vllm(*args: str, env: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "vllm", "image": "vllm/vllm-openai:v0.9.1", "args": list(args)}
    if env is not None:
        container["env"] = env
    return container


SIDECAR = {"name": "proxy", "image": "envoy:1", "args": ["--kv-transfer-config", "{}"]}


def apply(obj: dict[str, Any], config_map: str = CM, *, revision: int = 1, applied: int | None = None,
          container: str | None = "vllm") -> dict[str, Any] | None:
    """Adopt the workload onto `config_map` (the pod-template side of the delivery)."""
    change = WorkloadChange(kind=obj["kind"], name="w", action=ChangeAction.APPLY, policy="fleet", place=container,
                            desired=build_target_desired(obj, container, config_map),
                            config_hash=adoption_hash(config_map), revision=revision, applied_revision=applied)
    return build_update(obj, change)


def apply_file(obj: dict[str, Any] | None, settings: Any, *, revision: int = 1,
               applied: int | None = None) -> dict[str, Any] | None:
    """Write the policy's keys into a settings ConfigMap (created from the stub when absent)."""
    current = obj if obj is not None else settings_config_map_stub(CM, "ns")
    return build_update(current, WorkloadChange(
        kind="ConfigMap", name=CM, action=ChangeAction.APPLY, policy="fleet", place=SETTINGS_FILE_NAME,
        desired=build_settings_file_desired(settings.file), revision=revision, applied_revision=applied))


def rollback(obj: dict[str, Any], revision: int) -> dict[str, Any] | None:
    return build_update(obj, WorkloadChange(kind=obj["kind"], name="w", action=ChangeAction.ROLLBACK, policy="fleet",
                                            revision=revision))


def release(obj: dict[str, Any]) -> dict[str, Any] | None:
    return build_update(obj, WorkloadChange(kind=obj["kind"], name="w", action=ChangeAction.RELEASE, policy="fleet"))


def container_of(obj: dict[str, Any], name: str = "vllm") -> dict[str, Any]:
    return next(c for c in obj["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def kv_config(obj: dict[str, Any]) -> dict[str, Any]:
    args = container_of(obj)["args"]
    for i, token in enumerate(args):
        if token in ("--kv-transfer-config", "--kv_transfer_config"):
            return json.loads(args[i + 1])
        if token.startswith(("--kv-transfer-config=", "--kv_transfer_config=")):
            return json.loads(token.split("=", 1)[1])
    raise AssertionError("no --kv-transfer-config")


# ---- rendering ------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", list(LeaseMode))
def test_connector_settings_come_from_the_connector_config(mode: LeaseMode) -> None:
    settings = build_connector_settings(ConnectorSpec(lease_mode=mode, junction_retention=True))
    user = MoonleaseConnectorConfig(mooncake_max_lease_rounds=5)
    config = parse_settings_file(json.dumps(settings.file), user)  # what the connector reads
    assert config.lease_mode.value == mode.value and config.mooncake_junction_retention is True
    # Only the switches the policy decides (every one, off included); mooncake_max_lease_rounds
    # stays the user's.
    assert set(settings.file) == {"mooncake_lease_mode", "mooncake_junction_retention", "mooncake_retention_pin",
                                  "mooncake_retention_skip", "mooncake_retention_retry", "mooncake_retention_evict"}
    assert config.mooncake_max_lease_rounds == 5


def test_a_switch_the_policy_leaves_off_overrides_start_up_settings_that_turn_it_on() -> None:
    """A chart's start-up config pins; the policy says retentionPin: false: the file says so,
    and the connector runs without pinning (a missing key would keep the start-up `true`)."""
    startup = MoonleaseConnectorConfig(mooncake_retention_pin=True, mooncake_retention_skip=True)
    off = build_connector_settings(ConnectorSpec(lease_mode=LeaseMode.SELECTIVE))
    assert off.file["mooncake_retention_pin"] is False and off.file["mooncake_retention_skip"] is False
    config = parse_settings_file(json.dumps(off.file), startup)
    assert config.mooncake_retention_pin is False and config.mooncake_retention_skip is False
    on = build_connector_settings(ConnectorSpec(lease_mode=LeaseMode.SELECTIVE, retention_pin=True))
    assert on.config_hash != off.config_hash


def test_each_connector_setting_has_its_own_hash() -> None:
    hashes = {build_connector_settings(ConnectorSpec(lease_mode=m, junction_retention=j)).config_hash
              for m in LeaseMode for j in (False, True)}
    assert len(hashes) == 6


def test_master_settings_render_typed_values_and_flags() -> None:
    settings = build_master_settings(MasterSpec(name="m", eviction_ratio=0.1, default_kv_lease_ttl_ms=5000,
                                                allow_evict_soft_pinned_objects=False))
    assert settings.values == {"eviction_ratio": 0.1, "default_kv_lease_ttl": 5000,
                               "allow_evict_soft_pinned_objects": False}
    assert build_master_desired(settings) == {
        "flag:eviction_ratio": {"v": ["--eviction_ratio=0.1"]},
        "flag:default_kv_lease_ttl": {"v": ["--default_kv_lease_ttl=5000"]},
        "flag:allow_evict_soft_pinned_objects": {"v": ["--allow_evict_soft_pinned_objects=false"]},
    }
    assert build_master_settings(MasterSpec(name="m")).config_hash != settings.config_hash


# ---- targets --------------------------------------------------------------------------------------

@pytest.mark.parametrize("form", ["two tokens", "equals", "underscore"])
def test_our_keys_merge_into_the_users_kv_transfer_config(form: str) -> None:
    user = {"kv_connector_extra_config": {"lookup_rpc_port": 5557, "mooncake_max_lease_rounds": 5},
            "kv_buffer_size": 1e9}
    text = json.dumps(user)
    args = {"two tokens": ["--kv-transfer-config", text], "equals": [f"--kv-transfer-config={text}"],
            "underscore": ["--kv_transfer_config", text]}[form]
    obj = workload(vllm("serve", "m", *args, "--port=8000"), copy.deepcopy(SIDECAR))
    new = apply(obj)
    assert new is not None
    config = kv_config(new)
    assert config["kv_connector"] == "MooncakeStoreConnector"
    assert config["kv_connector_module_path"] == "moonlease_connector" and config["kv_role"] == "kv_both"
    assert config["kv_buffer_size"] == 1e9
    # The settings themselves live in the ConfigMap: only the file's path is added.
    assert config["kv_connector_extra_config"] == {"lookup_rpc_port": 5557, "mooncake_max_lease_rounds": 5,
                                                   "mooncake_settings_file": SETTINGS_FILE_PATH}
    vllm_args = container_of(new)["args"]
    assert vllm_args[:2] == ["serve", "m"] and vllm_args[-1] == "--port=8000"
    assert len(vllm_args) == len(obj["spec"]["template"]["spec"]["containers"][0]["args"])  # same form, same place
    assert container_of(new, "proxy") == SIDECAR  # another container, even with the same flag, untouched
    assert "env" not in container_of(new)
    assert container_of(new)["volumeMounts"] == [{"name": SETTINGS_VOLUME, "mountPath": "/etc/moonlease/connector",
                                                  "readOnly": True}]
    assert new["spec"]["template"]["spec"]["volumes"] == [{"name": SETTINGS_VOLUME, "configMap": {"name": CM}}]
    assert new["spec"]["template"]["metadata"]["annotations"] == {CONFIG_HASH_ANNOTATION: adoption_hash(CM)}
    assert new["metadata"]["labels"][POLICY_LABEL] == "fleet"
    assert apply(new) is None  # in sync: nothing more to do


def test_users_connector_choices_are_kept() -> None:
    text = json.dumps({"kv_connector": "MooncakeStoreConnector", "kv_connector_module_path": "moonlease_connector.x",
                       "kv_role": "kv_consumer"})
    new = apply(workload(vllm("--kv-transfer-config", text)))
    assert new is not None
    config = kv_config(new)
    assert (config["kv_connector_module_path"], config["kv_role"]) == ("moonlease_connector.x", "kv_consumer")


def test_a_workload_managed_the_old_way_gets_its_own_arguments_back_on_adoption() -> None:
    """Migration: an earlier operator wrote the lease mode into argv and env; adopting the
    workload restores what the user had there (one rolling restart) and adds the file."""
    original_env = [{"name": "A", "value": "1"}]
    obj = workload(vllm("serve", "--kv-transfer-config", json.dumps({"kv_role": "kv_both"}),
                        env=copy.deepcopy(original_env)))
    old_way = build_update(obj, WorkloadChange(
        kind="Deployment", name="w", action=ChangeAction.APPLY, policy="fleet", place="vllm", config_hash="old",
        desired={"kv:kv_connector_extra_config.mooncake_selective_lease": {"v": True},
                 f"env:{SELECTIVE_LEASE_ENV}": {"v": {"name": SELECTIVE_LEASE_ENV, "value": "1"}}}, revision=1))
    assert old_way is not None and container_of(old_way)["env"][-1]["name"] == SELECTIVE_LEASE_ENV
    adopted = apply(old_way, revision=2, applied=1)
    assert adopted is not None
    assert container_of(adopted)["env"] == original_env
    assert kv_config(adopted)["kv_connector_extra_config"] == {"mooncake_settings_file": SETTINGS_FILE_PATH}
    assert release(adopted) == obj


@pytest.mark.parametrize("obj", [
    workload(vllm("serve", "m")),
    workload({"name": "vllm", "image": "x"}),  # no args, no env
    workload(vllm("serve", "--kv-transfer-config", '{ "kv_role" : "kv_both" }'), annotations={"a": "b"}),
    workload(vllm("--kv_transfer_config={\"kv_connector_extra_config\": {}}", env=[])),
    workload(vllm("serve"), kind="StatefulSet"),
], ids=["args", "bare", "spaced-json", "empty-extra", "statefulset"])
def test_release_restores_the_original_exactly(obj: dict[str, Any]) -> None:
    first = apply(obj)
    assert first is not None
    later = apply(first, OTHER_CM, revision=2, applied=1)
    assert later is not None and later != first
    assert release(later) == obj
    assert release(obj) is None  # nothing of ours: nothing to do


def test_release_keeps_what_the_user_changed_meanwhile() -> None:
    obj = workload(vllm("serve", "--kv-transfer-config", json.dumps({"kv_buffer_size": 1})))
    new = apply(obj)
    assert new is not None
    edited = copy.deepcopy(new)
    config = kv_config(edited)
    config["kv_buffer_size"] = 2
    container_of(edited)["args"][2] = json.dumps(config)
    container_of(edited)["args"].append("--max-model-len=4096")
    restored = release(edited)
    assert restored is not None
    assert kv_config(restored) == {"kv_buffer_size": 2}
    assert container_of(restored)["args"][-1] == "--max-model-len=4096"
    assert "volumeMounts" not in container_of(restored) and POLICY_LABEL not in restored["metadata"]["labels"]
    assert "volumes" not in restored["spec"]["template"]["spec"]


@pytest.mark.parametrize(("args", "kind", "needle"), [
    (["--kv-transfer-config", json.dumps({"kv_connector": "LMCacheConnectorV1"})], Reason.FOREIGN_CONNECTOR,
     "LMCacheConnectorV1"),
    (["--kv-transfer-config", json.dumps({"kv_connector": "MooncakeStoreConnector"})], Reason.FOREIGN_CONNECTOR,
     "vLLM itself"),
    (["--kv-transfer-config", "{not json"], Reason.UNMANAGEABLE_WORKLOAD, "not valid JSON"),
    (["--kv-transfer-config", '{"kv_connector_extra_config": 3}'], Reason.UNMANAGEABLE_WORKLOAD, "JSON object"),
    (["--kv-transfer-config"], Reason.UNMANAGEABLE_WORKLOAD, "no value"),
])
def test_targets_the_policy_must_not_touch(args: list[str], kind: Reason, needle: str) -> None:
    problem = evaluate_target(workload(vllm(*args)), "vllm")
    assert problem is not None and problem.reason is kind and needle in problem.message


def test_a_missing_container_is_a_problem() -> None:
    problem = evaluate_target(workload(vllm("serve")), "engine")
    assert problem is not None and "container engine not found" in problem.message
    assert evaluate_target(workload(vllm("serve")), None) is None  # the first container


# ---- rollback snapshots ---------------------------------------------------------------------------

def test_rollback_returns_to_the_last_completed_attempt() -> None:
    base = workload(vllm("serve"))
    first = apply(base, CM, revision=1)  # attempt 1 completes
    assert first is not None
    second = apply(first, OTHER_CM, revision=2, applied=1)  # attempt 2 changes it ...
    assert second is not None
    third = apply(second, THIRD_CM, revision=3, applied=1)  # ... and is superseded by attempt 3
    assert third is not None
    back = rollback(third, 3)
    assert back is not None
    assert back["spec"] == first["spec"]  # attempt 1's configuration, not attempt 2's
    assert rollback(back, 3) is None and rollback(third, 2) is None  # idempotent; other attempts untouched
    assert release(back) == base


def test_an_attempt_after_a_completed_one_snapshots_afresh() -> None:
    first = apply(workload(vllm("serve")), CM, revision=1)
    assert first is not None
    second = apply(first, OTHER_CM, revision=4, applied=3)  # attempts 2 and 3 completed without touching it
    assert second is not None
    back = rollback(second, 4)
    assert back is not None and back["spec"] == first["spec"]


def test_rollback_and_original_annotations_live_in_the_workload_metadata() -> None:
    new = apply(workload(vllm("serve")), revision=7)
    assert new is not None
    annotations = new["metadata"]["annotations"]
    assert json.loads(annotations[ROLLBACK_ANNOTATION])["revision"] == 7
    assert json.loads(annotations[ORIGINAL_ANNOTATION])["slots"]["volume:" + SETTINGS_VOLUME] is None


# ---- master --------------------------------------------------------------------------------------

def master(*args: str) -> dict[str, Any]:
    return workload({"name": "master", "image": "mooncake/mooncake-master:v0.3.14", "args": list(args)})


def apply_master(obj: dict[str, Any], spec: MasterSpec, revision: int = 1) -> dict[str, Any] | None:
    settings = build_master_settings(spec)
    return build_update(obj, WorkloadChange(kind="Deployment", name="w", action=ChangeAction.APPLY, policy="fleet",
                                            desired=build_master_desired(settings), config_hash=settings.config_hash,
                                            revision=revision))


@pytest.mark.parametrize("args", [
    ["--eviction_ratio=0.10", "--allow_evict_soft_pinned_objects=false"],
    ["--eviction_ratio", "0.1", "--noallow_evict_soft_pinned_objects"],
    ["-eviction_ratio=.1", "-allow_evict_soft_pinned_objects=0"],
])
def test_master_already_running_the_settings_is_not_restarted(args: list[str]) -> None:
    spec = MasterSpec(name="m", eviction_ratio=0.1, allow_evict_soft_pinned_objects=False)
    assert apply_master(master("--rpc_port=50051", *args), spec) is None


def test_master_flags_change_in_place_and_restore_verbatim() -> None:
    obj = master("--rpc_port=50051", "--eviction_ratio", "0.05", "--allow_evict_soft_pinned_objects")
    spec = MasterSpec(name="m", eviction_ratio=0.1, default_kv_lease_ttl_ms=5000, allow_evict_soft_pinned_objects=False)
    settings = build_master_settings(spec)
    change = WorkloadChange(kind="Deployment", name="w", action=ChangeAction.APPLY, policy="fleet",
                            desired=build_master_desired(settings), config_hash=settings.config_hash, revision=1)
    assert describe_update(obj, change) == [
        "--allow_evict_soft_pinned_objects: true -> false", "--default_kv_lease_ttl: (unset) -> 5000",
        "--eviction_ratio: 0.05 -> 0.1"]
    new = build_update(obj, change)
    assert new is not None
    assert container_of(new, "master")["args"] == ["--rpc_port=50051", "--eviction_ratio=0.1",
                                                   "--allow_evict_soft_pinned_objects=false",
                                                   "--default_kv_lease_ttl=5000"]
    assert release(new) == obj


def test_a_setting_the_policy_stops_declaring_goes_back() -> None:
    obj = master("--eviction_ratio=0.05")
    new = apply_master(obj, MasterSpec(name="m", eviction_ratio=0.1, default_kv_lease_ttl_ms=5000))
    assert new is not None
    fewer = apply_master(new, MasterSpec(name="m", default_kv_lease_ttl_ms=5000), revision=2)
    assert fewer is not None
    assert container_of(fewer, "master")["args"] == ["--eviction_ratio=0.05", "--default_kv_lease_ttl=5000"]


def test_master_problems() -> None:
    with_map = build_master_settings(MasterSpec(name="m", eviction_ratio=0.1,
                                                config_map=MasterConfigMapSpec(name="cfg", key="master.json")))
    problem = evaluate_master(master("--eviction_ratio=0.2"), None, with_map)
    assert problem is not None and "--eviction_ratio" in problem.message and "ConfigMap cfg" in problem.message
    assert evaluate_master(master("--rpc_port=1"), None, with_map) is None
    assert evaluate_master(master(), "nope", with_map) is not None


@pytest.mark.parametrize(("key", "text"), [
    ("master.json", '{"rpc_port": 50051, "eviction_ratio": 0.05}'),
    ("master.yaml", "# mooncake master\nrpc_port: 50051\neviction_ratio: 0.05\n"),
    ("master.json", None),
])
def test_config_map_settings_and_exact_restore(key: str, text: str | None) -> None:
    config_map: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"}}
    if text is not None:
        config_map["data"] = {key: text, "other": "kept"}
    settings = build_master_settings(MasterSpec(name="m", eviction_ratio=0.1, allow_evict_soft_pinned_objects=True,
                                                config_map=MasterConfigMapSpec(name="cfg", key=key)))
    change = WorkloadChange(kind="ConfigMap", name="cfg", action=ChangeAction.APPLY, policy="fleet", place=key,
                            desired=build_config_map_desired(settings), revision=1)
    new = build_update(config_map, change)
    assert new is not None
    loader = yaml.safe_load if key.endswith(".yaml") else json.loads
    doc = loader(new["data"][key])
    assert doc["eviction_ratio"] == 0.1 and doc["allow_evict_soft_pinned_objects"] is True
    assert text is None or doc["rpc_port"] == 50051
    assert build_update(new, change) is None
    assert release(new) == config_map
    assert evaluate_config_map(new, key) is None
    assert evaluate_config_map({"kind": "ConfigMap", "data": {key: "[1, 2]"}}, key) is not None


# ---- patches -------------------------------------------------------------------------------------

_json = st.recursive(st.one_of(st.integers(), st.text(max_size=3), st.booleans()),
                     lambda inner: st.one_of(st.lists(inner, max_size=3),
                                             st.dictionaries(st.text("abc", max_size=2), inner, max_size=3)),
                     max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(old=st.dictionaries(st.text("abcd", max_size=2), _json, max_size=4),
       new=st.dictionaries(st.text("abcd", max_size=2), _json, max_size=4))
def test_merge_patch_turns_old_into_new(old: dict[str, Any], new: dict[str, Any]) -> None:
    assert merge_patch(old, build_merge_patch(old, new)) == new


def test_merge_patch_of_a_target_change_is_small() -> None:
    obj = workload(vllm("serve"), copy.deepcopy(SIDECAR))
    new = apply(obj)
    assert new is not None
    patch = build_merge_patch(obj, new)
    assert set(patch) == {"metadata", "spec"} and set(patch["spec"]) == {"template"}
    assert merge_patch(obj, patch) == new


def test_needs_update_agrees_with_build_update() -> None:
    from moonlease_operator.core.slots import needs_update

    base = workload(vllm("serve", "--kv-transfer-config", json.dumps({"kv_role": "kv_producer"})))
    states = [base]
    for config_map, revision in ((CM, 1), (OTHER_CM, 2), (CM, 3)):
        new = apply(states[-1], config_map, revision=revision, applied=1)
        assert new is not None
        states.append(new)
    states.append(rollback(states[-1], 3) or states[-1])
    changes = [WorkloadChange(kind="Deployment", name="w", action=action, policy="fleet", place="vllm",
                              desired=build_target_desired(base, "vllm", config_map),
                              config_hash=adoption_hash(config_map), revision=revision, applied_revision=1)
               for action in ChangeAction for config_map in (CM, OTHER_CM) for revision in (1, 2, 3)]
    verdicts = [(needs_update(obj, change), build_update(obj, change) is not None)
                for obj in states for change in changes]
    assert all(a == b for a, b in verdicts)
    assert {a for a, _ in verdicts} == {True, False}


# ---- the settings file (live connector settings) ---------------------------------------------------

def test_settings_file_is_created_switched_rolled_back_and_released_exactly() -> None:
    created = apply_file(None, SELECTIVE)
    assert created is not None
    assert created["metadata"]["labels"] == {"moonlease.io/connector-settings": "true", POLICY_LABEL: "fleet"}
    text = created["data"][SETTINGS_FILE_NAME]
    assert parse_settings_file(text, MoonleaseConnectorConfig()).lease_mode.value == "selective"
    assert apply_file(created, SELECTIVE) is None  # in sync
    switched = apply_file(created, LEASE_ALL, revision=2, applied=1)
    assert switched is not None
    assert parse_settings_file(switched["data"][SETTINGS_FILE_NAME], MoonleaseConnectorConfig()).lease_mode.value \
        == "leaseAll"
    back = build_update(switched, WorkloadChange(kind="ConfigMap", name=CM, action=ChangeAction.ROLLBACK,
                                                 policy="fleet", revision=2))
    assert back is not None and back["data"] == created["data"]
    released = build_update(back, WorkloadChange(kind="ConfigMap", name=CM, action=ChangeAction.RELEASE, policy="fleet"))
    assert released is not None and "data" not in released  # no file: the connector's start-up settings


def test_the_policy_label_value_is_always_a_valid_label_value() -> None:
    import re

    from moonlease_operator.core.slots import managed_by, policy_label_value

    assert policy_label_value("fleet") == "fleet"
    long = "a-very-long-policy-name-for-the-llama-fleet-in-the-inference-namespace.example.org"
    value = policy_label_value(long)
    assert len(long) > 63 and len(value) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9_.]*[a-z0-9])?", value)
    assert value != policy_label_value(long + "x")  # distinct names stay distinct
    change = WorkloadChange(kind="Deployment", name="w", action=ChangeAction.APPLY, policy=long,
                            place="vllm", desired=build_target_desired(workload(vllm("serve")), "vllm", CM),
                            config_hash=adoption_hash(CM))
    new = build_update(workload(vllm("serve")), change)
    assert new is not None and managed_by(new) == value
