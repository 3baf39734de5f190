"""Another writer reverting the operator's changes (`core.conflicts`): counting reverts in a row,
backing off (doubling, capped), writing once more after the backoff, forgetting a conflict that
is over, naming the field and the field manager."""

from __future__ import annotations

import datetime

import pytest
from moonlease_operator.api import Phase
from moonlease_operator.core.conflicts import (
    FIELD_MANAGER,
    MAX_RECORDS,
    ConflictSettings,
    Revert,
    field_path,
    last_writer,
    prune_managed_fields,
    track_reverts,
)

from tests.unit.test_rollout_plan import SPEC, fleet

pytestmark = pytest.mark.unit

T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
SETTINGS = ConflictSettings(reverts=3, backoff_seconds=60)
FIELD = "spec.template.spec.volumes[name=moonlease-connector-settings]"


def revert(name: str = "prefill", field: str = FIELD, manager: str | None = "argocd-controller") -> Revert:
    return Revert("Deployment", name, field, manager)


def at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


def test_three_reverts_in_a_row_back_off_then_one_write_then_twice_as_long() -> None:
    records: tuple = ()
    for second in (0, 10, 20):
        decision = track_reverts(records, [revert()], now=at(second), settings=SETTINGS)
        records = decision.records
    assert decision.held.keys() == {("Deployment", "prefill")} and len(decision.started) == 1
    assert "reverted 3 times in a row by field manager 'argocd-controller'" in decision.held[("Deployment", "prefill")]
    assert records[0].backoff_until == at(80)
    # Held while backing off, looked at or not
    assert track_reverts(records, [], now=at(79), settings=SETTINGS).held
    # The backoff is over: written once more (not held), one revert short of the next backoff
    decision = track_reverts(records, [revert()], now=at(81), settings=SETTINGS)
    assert not decision.held and len(decision.retried) == 1 and decision.records[0].reverts == 2
    decision = track_reverts(decision.records, [revert()], now=at(90), settings=SETTINGS)
    assert decision.held and decision.records[0].backoff_until == at(90 + 120)  # doubled


def test_the_backoff_doubles_up_to_eight_times() -> None:
    assert [SETTINGS.backoff(n).total_seconds() for n in range(6)] == [60, 120, 240, 480, 480, 480]


def test_reverts_far_apart_or_of_another_field_do_not_add_up() -> None:
    first = track_reverts((), [revert()], now=at(0), settings=SETTINGS).records
    late = track_reverts(first, [revert()], now=at(61), settings=SETTINGS)  # more than a backoff later
    assert late.records[0].reverts == 1
    other = track_reverts(late.records, [revert(field="spec.template.spec.containers[name=vllm].args")],
                          now=at(62), settings=SETTINGS)
    assert other.records[0].reverts == 1 and not other.held


def test_a_conflict_that_is_over_is_forgotten_and_zero_never_backs_off() -> None:
    records = track_reverts((), [revert()], now=at(0), settings=SETTINGS).records
    assert track_reverts(records, [], now=at(30), settings=SETTINGS).records
    assert track_reverts(records, [], now=at(61), settings=SETTINGS).records == ()
    never = ConflictSettings(reverts=0)
    assert track_reverts((), [revert()] * 5, now=at(0), settings=never).records == ()


def test_the_status_keeps_a_bounded_number_of_records_backing_off_first() -> None:
    records = track_reverts((), [revert()], now=at(0), settings=SETTINGS).records
    records = track_reverts(records, [revert()], now=at(1), settings=SETTINGS).records
    many = [revert(name=f"w{i}") for i in range(MAX_RECORDS + 5)]
    decision = track_reverts(records, [revert(), *many], now=at(2), settings=SETTINGS)
    assert len(decision.records) == MAX_RECORDS and decision.records[0].name == "prefill"
    assert decision.records[0].backoff_until is not None


@pytest.mark.parametrize("reverts,backoff", [(1, 60), (-1, 60), (3, 0)])
def test_settings_that_cannot_work_are_refused_naming_the_flag(reverts: int, backoff: float) -> None:
    with pytest.raises(ValueError, match="--conflict-(reverts|backoff)"):
        ConflictSettings(reverts=reverts, backoff_seconds=backoff)


def test_field_paths_name_what_a_person_finds_in_the_object() -> None:
    assert field_path("Deployment", "vllm", "volume:moonlease-connector-settings") == FIELD
    assert field_path("Deployment", "vllm", "mount:x") == "spec.template.spec.containers[name=vllm].volumeMounts[name=x]"
    assert field_path("Deployment", "master", "flag:eviction_ratio") == \
        "spec.template.spec.containers[name=master].args (--eviction_ratio)"
    assert field_path("Deployment", "vllm", "kv:kv_connector_extra_config.mooncake_settings_file").endswith(
        ".args (--kv-transfer-config kv_connector_extra_config.mooncake_settings_file)")
    assert field_path("Deployment", "vllm", "annotation") == \
        "spec.template.metadata.annotations[moonlease.io/config-hash]"
    assert field_path("ConfigMap", "connector-settings.json", "doc:mooncake_selective_lease") == \
        "data[connector-settings.json] (mooncake_selective_lease)"


def entry(manager: str, time: str, fields: dict) -> dict:
    return {"manager": manager, "operation": "Update", "time": time, "fieldsType": "FieldsV1", "fieldsV1": fields}


def test_the_writer_is_the_latest_other_manager_of_the_part_the_operator_writes() -> None:
    template = {"f:spec": {"f:template": {"f:spec": {"f:containers": {}}}}}
    deployment = {"kind": "Deployment", "metadata": {"managedFields": [
        entry("helm", "2026-01-01T00:00:00Z", template),
        entry("argocd-controller", "2026-01-01T00:05:00Z", template),
        entry(FIELD_MANAGER, "2026-01-01T00:06:00Z", template),  # ours: never the conflicting writer
        entry("kube-controller-manager", "2026-01-01T00:07:00Z", {"f:status": {}}),  # not the template
    ]}}
    assert last_writer(deployment) == "argocd-controller"
    # As the watch cache keeps it (pruned): the same answer
    pruned = {"kind": "Deployment", "metadata": {"managedFields": prune_managed_fields(
        deployment["metadata"]["managedFields"])}}
    assert last_writer(pruned) == "argocd-controller"
    assert all(set(e["fieldsV1"]) <= {"f:spec", "f:data"} for e in pruned["metadata"]["managedFields"])
    config_map = {"kind": "ConfigMap", "metadata": {"managedFields": [entry("flux", "2026-01-01T00:00:00Z",
                                                                            {"f:data": {"f:x": {}}})]}}
    assert last_writer(config_map) == "flux"
    assert last_writer({"kind": "Deployment", "metadata": {}}) is None  # no managedFields recorded


def test_a_master_reverted_again_and_again_is_left_alone_without_a_new_attempt_each_time() -> None:
    """requireApprovalForRestart off (each repair would restart the master, emptying the store):
    after three reverts in a row the master's writes wait out the backoff; the policy says
    ConflictingWriter and starts no attempt per reconcile."""
    cluster = fleet()
    assert cluster.run(SPEC).phase is Phase.READY
    managed = [{"manager": "argocd-controller", "operation": "Update", "time": "2026-01-01T00:00:00Z",
                "fieldsV1": {"f:spec": {"f:template": {}}}}]
    restarts = 0
    for _ in range(5):
        master = cluster.obj("mooncake-master")  # each write stores a new object
        args = master["spec"]["template"]["spec"]["containers"][0]["args"]
        args[:] = [a for a in args if not a.startswith("--eviction_ratio")] + ["--eviction_ratio=0.05"]
        master["metadata"]["generation"] += 1
        master["metadata"]["managedFields"] = managed
        cluster.settle("mooncake-master")
        cluster.writes.clear()
        cluster.now += datetime.timedelta(seconds=5)
        cluster.reconcile(SPEC)
        restarts += ("Deployment", "mooncake-master") in cluster.writes
    assert restarts == 2  # the first two reverts were put back; then the backoff
    status = cluster.status
    assert status.phase is Phase.DEGRADED and status.condition("Degraded").reason == "ConflictingWriter"
    conflict = status.condition("ConflictingWriter")
    assert conflict is not None and conflict.status.value == "True"
    assert "Deployment/mooncake-master: spec.template.spec.containers[name=master].args (--eviction_ratio)" \
        in conflict.message and "'argocd-controller'" in conflict.message
    revision = status.revision
    for _ in range(3):
        cluster.reconcile(SPEC)
    assert cluster.status.revision == revision and ("Deployment", "mooncake-master") not in cluster.writes
    # The backoff is over and the writer has stopped: written once more, and Ready again
    cluster.now += datetime.timedelta(seconds=SETTINGS.backoff_seconds * 400)
    assert cluster.run(SPEC).phase is Phase.READY
    assert cluster.status.condition("ConflictingWriter").status.value == "False"
