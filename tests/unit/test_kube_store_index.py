"""The test bed's store index (issue 16): what a LIST, a cascade and the simulated controllers
look up instead of scanning every stored object. Pure, plain dicts."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moonlease_dev.testbed.kube.selectors import match_label_selector, parse_label_selector
from moonlease_dev.testbed.kube.store_index import StoreIndex

pytestmark = pytest.mark.unit

PODS, DEPLOYS = "v1/pods", "apps/v1/deployments"


def obj(name: str, labels: dict[str, str] | None = None, owners: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels or {},
                         "ownerReferences": [{"uid": uid, "kind": "Deployment", "name": "x"} for uid in owners]}}


def test_selector_terms_narrow_the_candidates_and_the_rest_is_left_to_the_caller() -> None:
    index = StoreIndex()
    index.record((PODS, "a", "p1"), obj("p1", {"app": "web", "tier": "front"}))
    index.record((PODS, "a", "p2"), obj("p2", {"app": "db"}))
    index.record((PODS, "b", "p3"), obj("p3", {"app": "web"}))
    index.record((DEPLOYS, "a", "p1"), obj("p1", {"app": "web"}))  # same name, other type

    assert index.live_keys(PODS, "a", parse_label_selector("app=web")) == [(PODS, "a", "p1")]
    assert index.live_keys(PODS, None, parse_label_selector("app in (web,db)")) == [
        (PODS, "a", "p1"), (PODS, "a", "p2"), (PODS, "b", "p3")]
    # Terms without an index (!=, exists) keep every candidate: the caller matches them.
    assert index.live_keys(PODS, "a", parse_label_selector("app!=web")) == [(PODS, "a", "p1"), (PODS, "a", "p2")]
    assert index.live_keys(PODS, "a", parse_label_selector("app=web,tier=back")) == []
    assert index.live_keys("v1/configmaps") == []


def test_a_relabelled_or_deleted_object_leaves_the_live_indexes_but_not_the_history() -> None:
    index = StoreIndex()
    key = (PODS, "a", "p1")
    index.record(key, obj("p1", {"app": "web"}, owners=("u1",)))
    index.record((PODS, "a", "p2"), obj("p2", {"app": "web"}, owners=("u1",)))
    index.record(key, obj("p1", {"app": "db"}))  # relabelled, owner reference dropped
    assert index.live_keys(PODS, "a", parse_label_selector("app=web")) == [(PODS, "a", "p2")]
    assert index.owned_by("u1") == [(PODS, "a", "p2")]

    index.record(key, None)  # deleted
    assert index.live_keys(PODS, "a") == [(PODS, "a", "p2")]
    assert index.labels(key) is None
    assert list(index.keys(PODS, "a")) == [key, (PODS, "a", "p2")]  # a continue page still walks it

    index.record(key, obj("p1", {"app": "web"}))  # re-created: keeps its first place
    assert index.live_keys(PODS, "a", parse_label_selector("app=web")) == [key, (PODS, "a", "p2")]


LABELS = st.dictionaries(st.sampled_from(["app", "tier", "role"]), st.sampled_from(["x", "y", "z"]), max_size=3)
SELECTORS = st.sampled_from(["", "app=x", "app in (x,y)", "app=x,tier=y", "role!=z", "tier", "!tier",
                             "app in (y),role in (x,z)", "app notin (x)"])


@given(writes=st.lists(st.tuples(st.integers(0, 7), st.one_of(st.none(), LABELS)), max_size=40), selector=SELECTORS)
def test_indexed_candidates_then_matching_equals_a_full_scan(writes: list[tuple[int, dict[str, str] | None]],
                                                             selector: str) -> None:
    """Whatever the writes, candidates from the index, matched term by term, are exactly the
    live objects a full scan would select, in creation order."""
    index, live, order = StoreIndex(), {}, []
    for number, labels in writes:
        key = (PODS, "ns", f"p{number}")
        if key not in order:
            order.append(key)
        index.record(key, None if labels is None else obj(key[2], labels))
        if labels is None:
            live.pop(key, None)
        else:
            live[key] = labels
    terms = parse_label_selector(selector)
    scanned = [key for key in order if key in live and match_label_selector(terms, live[key])]
    found = [key for key in index.live_keys(PODS, "ns", terms) if match_label_selector(terms, index.labels(key) or {})]
    assert found == scanned
