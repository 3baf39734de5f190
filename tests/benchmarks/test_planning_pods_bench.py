"""The planning-at-scale benchmark runs, tiny, through the planner's public API only (no private
of the planner patched, no test module imported). Assertions are about what it planned, never
timing (speed claims live in the committed results)."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit  # pure planning, about a second

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "planning_pods.py"


def test_tiny_run_plans_a_verifying_reconcile() -> None:
    spec = importlib.util.spec_from_file_location("planning_pods", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.measure(workloads=60, targets=6, repeat=1)
    assert (result["workloads"], result["pods"], result["targets"]) == (61, 61, 7)
    assert result["stage"] == ["Progressing"]  # verifying: the plan reads the pods
    assert all(result[key] > 0 for key in ("plan_ms_pod_cache_index", "plan_ms_pod_index_built_per_plan",
                                           "lookups_ms_scan_per_target", "lookups_ms_pod_set"))


def test_it_uses_public_names_only() -> None:
    tree = ast.parse(SCRIPT.read_text(encoding="utf-8"))
    imported = [(node.module or "", alias.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for alias in node.names]
    assert not [m for m, _ in imported if m.split(".")[0] == "tests"]
    assert not [(m, name) for m, name in imported if m.startswith("moonlease") and name.startswith("_")]
    assert not [node for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")]
