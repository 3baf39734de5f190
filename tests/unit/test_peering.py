"""The kopf peering resources the chart installs for the operator's replicas. Pure."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from moonlease_operator.peering import build_peering_crds, build_peering_object
from moonlease_operator.runner import choose_priority

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_the_charts_peering_crds_are_the_generated_ones() -> None:
    committed = list(yaml.safe_load_all((ROOT / "charts/moonlease/crds/kopf-peerings.yaml").read_text()))
    assert committed == build_peering_crds(), "regenerate charts/moonlease/crds/kopf-peerings.yaml"
    assert [c["spec"]["names"]["kind"] for c in committed] == ["ClusterKopfPeering", "KopfPeering"]
    assert all("subresources" not in v for c in committed for v in c["spec"]["versions"])  # kopf patches status


def test_peering_objects_and_priorities() -> None:
    assert build_peering_object("moonlease")["kind"] == "ClusterKopfPeering"
    namespaced = build_peering_object("moonlease", "inference")
    assert namespaced["kind"] == "KopfPeering" and namespaced["metadata"]["namespace"] == "inference"
    priorities = {choose_priority() for _ in range(50)}
    assert len(priorities) > 45 and all(1 <= p < 2**31 for p in priorities)  # equal ones would pause both
