"""The operator-at-scale benchmark runs end to end, tiny: the operator as it ships against one
fleet. Assertions are about requests and bytes, never timing (speed claims live in the
committed results)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.operator

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "operator_scale.py"


def test_tiny_run_measures_the_watch_design(tmp_path: Path) -> None:
    out = tmp_path / "operator_scale.md"
    run = subprocess.run([sys.executable, str(SCRIPT), "--deployments", "40", "--policies", "3",
                          "--rollout-targets", "6", "--rest", "3", "--interval", "0.5", "--tick", "0.1",
                          "--write", str(out)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    result = json.loads(run.stdout)
    assert list(result["designs"]) == ["watch"]  # the operator as it ships; nothing else is run
    watch = result["designs"]["watch"]
    assert watch["rest"]["settled"]
    # At rest the operator sends nothing: every reconcile reads its watch caches.
    assert watch["rest"]["requests_per_minute"] == 0 and watch["rest"]["bytes_per_minute"] == 0
    rollout = watch["rollout"]
    assert rollout["finished"] and rollout["first_patch_s"] is not None
    assert rollout["workload_patches"] >= 7  # the six targets and the master
    assert "list deployments" not in rollout["by_kind"]
    assert rollout["status_bytes"] < 64 * 1024
    assert "| 40 Deployments, 4 policies, 1 namespace | watch | 0.0 |" in out.read_text()


def test_the_committed_report_labels_the_polling_rows_as_recorded() -> None:
    """The design before the watches is no longer in the operator: its rows in the committed
    report are recorded results, re-rendered as such."""
    report = (REPO / "benchmarks" / "results" / "operator_scale.md").read_text(encoding="utf-8")
    rows = [line for line in report.splitlines() if line.startswith("| ") and "Deployments" in line]
    polling = [line for line in rows if "| polling" in line]
    assert polling and all("| polling (recorded) |" in line for line in polling)
    assert "--benchmark-polling" not in report.split("## What these runs show")[0]
