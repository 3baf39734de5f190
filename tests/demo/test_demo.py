"""`moonlease demo --quick` runs the whole story end to end and reports a measured verdict."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.store, pytest.mark.operator]

VERDICTS = ("Success", "Failure", "Inconclusive", "Abort", "NoData", "Error")


def test_quick_demo_ab_tests_selective_against_lease_all_on_measured_metrics(tmp_path: Path) -> None:
    moonlease = Path(sys.executable).with_name("moonlease")
    run = subprocess.run([str(moonlease), "demo", "--quick", "--workdir", str(tmp_path)],
                         capture_output=True, text=True, timeout=900)
    out = run.stdout
    assert run.returncode == 0, out[-6000:] + run.stderr[-4000:]
    # The operator rolled selective out to the treatment only, through its settings files, and
    # each engine's running connector switched to it live (same process).
    assert re.search(r"treatment's connector settings file now: .*\"mooncake_selective_lease\": true", out), out
    assert re.search(r"control's, untouched: +\{\"mooncake_junction_retention\": false, .*\"mooncake_selective_lease\": false",
                     out), out
    assert re.search(r"treatment: lease mode selective \(its engine's connector, settings \w+, same process", out), out
    assert re.search(r"control: lease mode leaseAll \(its engine's connector, settings \w+, same process", out), out
    # Intervals measured from the engines' real metrics: store hit rates and TTFT per arm.
    intervals = re.findall(r"interval +\d+: control store hits +([\d.]+)%, TTFT p90 (\d+) ms; "
                           r"treatment store hits +([\d.]+)%, TTFT p90 (\d+) ms", out)
    assert len(intervals) >= 3, out
    assert all(int(c_ttft) > 0 and int(t_ttft) > 0 for _, c_ttft, _, t_ttft in intervals), intervals
    # A decided test, as `kubectl get mlp` shows it, and the per-arm table.
    row = re.search(r"selective-ab +selective +(\S+) +\S+ +(Promoted|RolledBack|AwaitingDecision) +(\S+)", out)
    assert row and row.group(3) in VERDICTS, out
    for arm, mode in (("control", "leaseAll"), ("treatment", "selective")):
        assert re.search(rf"^\s+{arm} +{mode} +[\d.]+% +[\d.]+% +\d+ ms", out, flags=re.M), out
    assert re.search(r"verdict (Success|Failure|Inconclusive|Abort|NoData|Error) after|verdict \w+: ", out), out
    plot = tmp_path / "ab-test.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Stopping everything" in out and (tmp_path / "logs" / "engine-treatment.log").is_file()
    left = subprocess.run(["pgrep", "-f", f"moonlease.demo_arm {tmp_path}"], capture_output=True, text=True)
    assert left.stdout.strip() == "", "an arm engine outlived the demo"
