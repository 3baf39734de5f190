"""The label index the watch caches keep (issue 16): selecting through it gives exactly what a
scan of every workload gives, however the labels changed; and a policy edit wakes only the
policies that share a workload with it."""

from __future__ import annotations

import random

import pytest

from moonlease_operator.api import LabelSelector, parse_spec
from moonlease_operator.core.fleet import managed_keys, resolve_fleet, select
from moonlease_operator.core.label_index import LabelIndex
from moonlease_operator.core.slots import POLICY_LABEL, policy_label_value
from moonlease_operator.core.wakeups import policies_sharing_workloads

pytestmark = pytest.mark.unit

KEYS, VALUES = ("app", "tier", "zone"), ("a", "b", "c")
SELECTORS = [
    LabelSelector(match_labels={"app": "a"}),
    LabelSelector(match_labels={"app": "a", "tier": "b"}),
    LabelSelector(match_expressions=[{"key": "zone", "operator": "In", "values": ["a", "c"]}]),
    LabelSelector(match_expressions=[{"key": "tier", "operator": "Exists"}]),
    LabelSelector(match_expressions=[{"key": "tier", "operator": "NotIn", "values": ["a"]}]),  # no positive term
    LabelSelector(match_expressions=[{"key": "zone", "operator": "DoesNotExist"}]),
    LabelSelector(match_labels={"app": "b"}, match_expressions=[{"key": "zone", "operator": "NotIn", "values": ["c"]}]),
    LabelSelector(match_labels={"app": "nobody"}),
]


def workload(kind: str, name: str, labels: dict[str, str]) -> dict:
    return {"kind": kind, "metadata": {"name": name, "labels": labels}}


def random_labels(rng: random.Random) -> dict[str, str]:
    return {k: rng.choice(VALUES) for k in KEYS if rng.random() < 0.7}


def test_selecting_through_the_index_equals_scanning_after_random_changes() -> None:
    rng = random.Random(16)
    workloads: dict[tuple[str, str], dict] = {}
    index = {"Deployment": LabelIndex(), "StatefulSet": LabelIndex()}
    for step in range(600):  # add, relabel, delete; check every selector now and then
        kind, name = rng.choice(("Deployment", "StatefulSet")), f"w{rng.randrange(60)}"
        if rng.random() < 0.2:
            workloads.pop((kind, name), None)
            index[kind].remove(name)
        else:
            labels = random_labels(rng)
            workloads[(kind, name)] = workload(kind, name, labels)
            index[kind].put(name, labels)
        if step % 50 == 0:
            for selector in SELECTORS:
                for k in ("Deployment", "StatefulSet"):
                    assert select(k, selector, workloads, index) == select(k, selector, workloads)
    assert sum(len(i) for i in index.values()) == len(workloads)


def test_candidates_come_from_the_narrowest_positive_term() -> None:
    index = LabelIndex()
    for i in range(10):
        index.put(f"w{i}", {"app": "a", **({"tier": "b"} if i < 2 else {})})
    assert index.candidates(SELECTORS[1]) == {"w0", "w1"}  # tier=b (2) rather than app=a (10)
    assert index.candidates(SELECTORS[4]) is None  # NotIn alone: everything is a candidate
    assert index.candidates(SELECTORS[7]) == frozenset()
    index.put("w0", {"app": "a"})  # relabelled: leaves tier=b
    index.remove("w1")
    assert index.candidates(SELECTORS[1]) == frozenset() and index.with_label("app", "a") == {f"w{i}" for i in range(2, 10)} | {"w0"}


def test_an_index_ahead_of_the_snapshot_adds_nothing_the_snapshot_lacks() -> None:
    snapshot = {("Deployment", "old"): workload("Deployment", "old", {"app": "a"})}
    index = {"Deployment": LabelIndex()}
    index["Deployment"].put("old", {"app": "a"})
    index["Deployment"].put("new", {"app": "a"})  # created after the snapshot was taken
    assert select("Deployment", SELECTORS[0], snapshot, index) == [("Deployment", "old")]


def test_managed_keys_through_the_index() -> None:
    label = policy_label_value("p")
    workloads = {("Deployment", "x"): workload("Deployment", "x", {POLICY_LABEL: label}),
                 ("StatefulSet", "y"): workload("StatefulSet", "y", {POLICY_LABEL: label}),
                 ("Deployment", "z"): workload("Deployment", "z", {POLICY_LABEL: "other"})}
    index = {"Deployment": LabelIndex(), "StatefulSet": LabelIndex()}
    for (kind, name), obj in workloads.items():
        index[kind].put(name, obj["metadata"]["labels"])
    expected = [("Deployment", "x"), ("StatefulSet", "y")]
    assert managed_keys(label, workloads) == expected == managed_keys(label, workloads, index)


def spec(group: str, master: str = "master") -> object:
    return parse_spec({"master": {"name": master},
                       "targets": [{"role": "decode", "selector": {"matchLabels": {"group": group}}}]})


def test_a_policy_edit_wakes_only_the_policies_sharing_a_workload() -> None:
    workloads = {("Deployment", f"m-{g}"): workload("Deployment", f"m-{g}", {}) for g in "abc"}
    for g in "abc":
        for i in range(3):
            workloads[("Deployment", f"{g}{i}")] = workload("Deployment", f"{g}{i}", {"group": g})
    workloads[("Deployment", "c0")]["metadata"]["labels"][POLICY_LABEL] = policy_label_value("new")
    index = {"Deployment": LabelIndex()}
    for (_, name), obj in workloads.items():
        index["Deployment"].put(name, obj["metadata"]["labels"])
    others = {"pa": spec("a", "m-a"), "pb": spec("b", "m-b"), "pc": spec("c", "m-c"), "broken": None}
    for idx in (None, index):
        # Created over group b with its own master: only pb shares workloads; pc covers c0,
        # which carries the new policy's label.
        assert policies_sharing_workloads("new", [spec("b", "m-new")], others, workloads, idx) == {"pb", "pc"}
        # Moved from group b to group a (an edit): both before and after count.
        assert policies_sharing_workloads("pb", [spec("b", "m-b"), spec("a", "m-b")], others, workloads, idx) == {"pa"}
        # A shared master is a shared workload.
        assert policies_sharing_workloads("x", [spec("none", "m-a")], others, workloads, idx) == {"pa"}
        assert policies_sharing_workloads("x", [None], others, workloads, idx) == set()
    assert resolve_fleet(spec("a", "m-a"), workloads, index).keys == resolve_fleet(spec("a", "m-a"), workloads).keys
