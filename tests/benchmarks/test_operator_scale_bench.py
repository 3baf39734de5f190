"""The operator-at-scale benchmark (issue 16) runs end to end, tiny: both designs against one
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


def test_tiny_run_compares_the_watch_and_polling_designs(tmp_path: Path) -> None:
    out = tmp_path / "operator_scale.md"
    run = subprocess.run([sys.executable, str(SCRIPT), "--deployments", "40", "--policies", "3",
                          "--rollout-targets", "6", "--rest", "3", "--interval", "0.5", "--tick", "0.1",
                          "--write", str(out)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    result = json.loads(run.stdout)
    watch, polling = result["designs"]["watch"], result["designs"]["polling"]
    assert watch["rest"]["settled"] and polling["rest"]["settled"]
    # At rest the watch design sends nothing; the polling one lists every interval.
    assert watch["rest"]["requests_per_minute"] == 0 and watch["rest"]["bytes_per_minute"] == 0
    assert polling["rest"]["lists_per_minute"] > 0 and polling["rest"]["bytes_per_minute"] > 0
    for design in (watch, polling):
        rollout = design["rollout"]
        assert rollout["finished"] and rollout["first_patch_s"] is not None
        # The six targets (and the master, unless the first design's rollout left it configured:
        # a deleted policy keeps the master's settings by default).
        assert rollout["workload_patches"] >= 6
    assert "list deployments" not in watch["rollout"]["by_kind"]
    assert watch["rollout"]["status_bytes"] < 64 * 1024
    assert "| 40 Deployments, 4 policies, 1 namespace | watch | 0.0 |" in out.read_text()
