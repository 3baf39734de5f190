"""`moonlease demo --quick` runs the whole story end to end: act 1 promotes junction retention on
measured store hit rates, act 2 rolls a bad change back with the store's contents intact, no
measurement warnings follow the verdict, and the run ends with a two-line summary."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.store, pytest.mark.operator]


def test_quick_demo_promotes_junction_retention_and_rolls_a_bad_change_back(tmp_path: Path) -> None:
    moonlease = Path(sys.executable).with_name("moonlease")
    run = subprocess.run([str(moonlease), "demo", "--quick", "--workdir", str(tmp_path)],
                         capture_output=True, text=True, timeout=900)
    out = run.stdout
    assert run.returncode == 0, out[-6000:] + run.stderr[-4000:]
    # Act 1: the operator rolled junction retention out to the treatment only, through its
    # settings files, and each engine's running connector switched to it live (same process).
    assert re.search(r"treatment's connector settings file now: \{\"mooncake_junction_retention\": true, .*"
                     r"\"mooncake_lease_mode\": \"leaseAll\"", out), out
    assert re.search(r"control's, untouched: +\{\"mooncake_junction_retention\": false, .*\"mooncake_lease_mode\": \"leaseAll\"",
                     out), out
    assert re.search(r"treatment's engine's connector runs: leaseAll, junction retention true, settings \w+ "
                     r"\(same process", out), out
    assert re.search(r"control's engine's connector runs: leaseAll, junction retention false, settings \w+ "
                     r"\(same process", out), out
    # Intervals measured from the engines' real metrics: store hit rates and TTFT per arm.
    intervals = re.findall(r"interval +\d+: control store hits +([\d.]+)%, TTFT p90 (\d+) ms; "
                           r"treatment store hits +([\d.]+)%, TTFT p90 (\d+) ms", out)
    assert len(intervals) >= 3, out
    # The verdict: a promotion on a significant store-hit-rate gain, as the real `kubectl get mlp`
    # shows it: the CRD's printer columns come only from kubectl and the server's Table response.
    assert re.search(r"\$ kubectl get mlp -n \S+\n +NAME +MODE +PHASE +STAGE +READY +A/B +VERDICT +AGE\n", out), out
    assert re.search(r"junction-ab +\S+ +Ready +(?:\S+ +)?True +Promoted +Success +\d+[smh]", out), out
    # The chart was installed by Helm (its SDK's install, waited on): what the install returned,
    # its NOTES, and, read back by kubectl, Helm's release record and what the release created,
    # labelled and annotated as its own.
    assert re.search(r"Installing charts/moonlease with Helm .*\n +release moonlease in namespace (\S+): revision 1, "
                     r"status deployed, chart moonlease-\S+\n +NOTES:\n +Moonlease \S+ is installed as release "
                     r"\"moonlease\" in namespace \"\1\"", out), out
    assert re.search(r"\$ kubectl get secrets -n \S+ -l owner=helm\n +NAME +TYPE +DATA +AGE\n"
                     r" +sh\.helm\.release\.v1\.moonlease\.v1 +helm\.sh/release\.v1 +1 +\d+s\n", out), out
    deploys = re.search(r"\$ kubectl get deploy -n \S+ -L moonlease.io/arm -L app.kubernetes.io/managed-by\n"
                        r" +NAME +READY +UP-TO-DATE +AVAILABLE +AGE +ARM +MANAGED-BY\n((?: +moonlease-\S+ .*\n)+)", out)
    assert deploys, out
    rows = [line.split() for line in deploys.group(1).splitlines()]
    assert {row[0] for row in rows} == {"moonlease-mooncake-master"} | {
        f"moonlease-{role}-{arm}" for role in ("prefill", "decode") for arm in ("control", "treatment")}, rows
    assert all(row[1] == "1/1" and row[-1] == "Helm" for row in rows), rows
    released = re.search(r"custom-columns=KIND:.kind,NAME:.metadata.name,RELEASE:.*\n +KIND +NAME +RELEASE\n"
                         r"((?: +(?:Deployment|ConfigMap) .*\n)+)", out)
    assert released, out
    objects = [line.split() for line in released.group(1).splitlines()]
    assert len(objects) == 10 and all(row[2] == "moonlease" for row in objects), objects
    assert re.search(r"\$ kubectl apply -f \S+junction-ab.yaml\n +mooncakeleasepolicy.moonlease.io/junction-ab created",
                     out), out
    rates = {arm: float(rate) for arm, rate in re.findall(
        r"^\s+(control|treatment) +leaseAll(?: \+ junction retention)? +([\d.]+)% +\d+ ms", out, flags=re.M)}
    assert rates["treatment"] >= rates["control"] + 2, rates
    assert re.search(r"verdict Success: externalHitRate: treatment [\d.]+ vs control [\d.]+ .*better by at least", out)
    assert (tmp_path / "ab-test.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Act 2: the bad change was refused by the treatment's connector and rolled back by the
    # operator; the store kept every key and its master process.
    assert re.search(r"\$ kubectl patch mlp junction-ab -n \S+ --type merge -p '\{.*\}'\n +mooncakeleasepolicy.moonlease.io/"
                     r"junction-ab patched", out), out
    assert "treatment's connector refused the new settings (model_unsupported)" in out, out
    assert re.search(r"policy Degraded \(RolledBack\): Stage prefill failed", out), out
    store = re.search(r"store: (\d+) keys before the change, (\d+) after the rollback; master the same process", out)
    assert store and store.group(1) == store.group(2) and int(store.group(1)) > 0, out
    assert re.search(r"treatment's engine's connector runs: leaseAll, junction retention true", out.split("Act 2")[-1])
    # No warning spam: nothing is measured once the test is decided.
    assert "MeasurementFailed events after the verdict: 0" in out, out
    # The summary: two lines, what happened and what to run next.
    lines = out.rstrip().splitlines()
    assert lines[-2].startswith("What happened: leaseAll + junction retention won the A/B") and \
        "rolled back in" in lines[-2] and "the store untouched" in lines[-2], lines[-3:]
    assert lines[-1].startswith("Next: "), lines[-3:]
    assert (tmp_path / "logs" / "engine-treatment.log").is_file()
    left = subprocess.run(["pgrep", "-f", f"moonlease_dev.demo_arm {tmp_path}"], capture_output=True, text=True)
    assert left.stdout.strip() == "", "an arm engine outlived the demo"
