"""Driving a rollout (issue 17, items 6-7): the real operator (kopf) against the local API
server, told what to do by `moonlease promote|abort|pause|resume|retry|approve` run as a user
runs it (a subprocess with a kubeconfig), and `moonlease plan -f` / `status --targets|--watch`
with their output and exit codes asserted."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from moonlease_dev.testbed.kube import LocalApiServer
from moonlease_operator.core.connector_delivery import settings_config_map_name
from moonlease_operator.runner import OperatorThread
from tests.fixtures.kube import FAST_OPTIONS
from tests.operator.fleet import (
    NS,
    WORKLOADS,
    configured,
    create_fleet,
    phase,
    policy,
    reasons,
    stage_phases,
    status,
    workload,
)
from tests.operator.test_ab_operator import CONTROL, TREATMENT, ab_policy, create_arms, exporters, port_of, traffic  # noqa: F401
from tests.operator.test_ab_metric_sources import ArmExporter
from tests.operator.test_status_cli import plugin_on_path, run

WAIT = 20.0


async def moonlease(kubeconfig: Path, *argv: str) -> tuple[int, str, str]:
    return await run(sys.executable, "-m", "moonlease.cli", *argv, "--kubeconfig", str(kubeconfig))


@pytest.mark.operator
async def test_pause_resume_abort_retry_through_the_cli(kube: LocalApiServer, tmp_path: Path) -> None:
    originals = await create_fleet(kube)
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)
    kube.simulator.stall("Deployment", NS, "llama-prefill", when=configured)
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS):
        await kube.create(policy(**{"rollout.stageTimeoutSeconds": 60, "rollout.onFailure": "halt"}))
        await kube.wait_for(lambda: stage_phases(kube).get("prefill") == "Progressing", timeout=WAIT,
                            what="the prefill stage under way")

        code, out, err = await moonlease(kubeconfig, "pause", "fleet")
        assert code == 0 and out.startswith("pause: applied (the operator): holding the policy"), (out, err)
        assert phase(kube) == "Paused" and status(kube)["pausedAt"]
        code, out, _ = await moonlease(kubeconfig, "status", "fleet")
        assert code == 2 and f"run:     moonlease resume -n {NS} fleet" in out
        assert "verb:    pause Applied" in out
        code, out, _ = await moonlease(kubeconfig, "pause", "fleet")  # the same verb again
        assert code == 0 and "already handled" in out

        code, out, _ = await moonlease(kubeconfig, "retry", "fleet", "-o", "json")
        answer = json.loads(out)
        assert code == 4 and answer["outcome"] == "Ignored" and "only a Degraded policy retries" in answer["message"]

        code, out, _ = await moonlease(kubeconfig, "resume", "fleet")
        assert code == 0, out
        code, out, _ = await moonlease(kubeconfig, "abort", "fleet")
        assert code == 0 and "rolling back every stage this attempt changed" in out, out
        await kube.wait_for(lambda: phase(kube) == "Degraded" and stage_phases(kube)["prefill"] == "RolledBack",
                            timeout=WAIT, what="the aborted rollout rolled back (onFailure: halt notwithstanding)")
        # The targets are rolled back; the master keeps its settings (and the store its
        # contents): only its own stage's failure, or an approved rollback, restarts it.
        assert workload(kube, "llama-prefill")["spec"] == originals["llama-prefill"]["spec"]
        assert reasons(kube).count("VerbApplied") == 3 and "VerbIgnored" in reasons(kube)

        kube.simulator.heal("Deployment", NS, "llama-prefill")
        code, out, _ = await moonlease(kubeconfig, "retry", "fleet")
        assert code == 0 and "a new rollout attempt" in out
        await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="the retried rollout Ready")
        assert status(kube)["revision"] == 2

        code, out, _ = await moonlease(kubeconfig, "status", "fleet", "--targets")
        assert code == 0
        for name, kind in (("mooncake-master", "Deployment"), ("llama-prefill", "Deployment"),
                           ("llama-decode", "StatefulSet")):
            row = next(line for line in out.splitlines() if f"{kind}/{name}" in line)
            assert "Ready" in row and "kept" in row and row.rstrip().endswith("fleet"), row
            assert workload(kube, name)["spec"]["template"]["metadata"]["annotations"]["moonlease.io/config-hash"] in row


@pytest.mark.operator
async def test_approve_lets_exactly_the_pending_master_restart_through(kube: LocalApiServer, tmp_path: Path) -> None:
    await create_fleet(kube)
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS):
        code, out, _ = await moonlease(kubeconfig, "approve", "fleet")
        assert code == 3 and "cannot read mooncakeleasepolicy fleet" in _  # no such policy yet
        await kube.create(policy(**{"master.requireApprovalForRestart": True}))
        await kube.wait_for(lambda: phase(kube) == "AwaitingApproval", timeout=WAIT, what="the approval gate")
        code, out, _ = await moonlease(kubeconfig, "status", "fleet")
        assert code == 2 and f"run:     moonlease approve -n {NS} fleet" in out
        pending = status(kube)["pendingApproval"]
        # Through kubectl's plugin mechanism, as a user on a workstation would.
        kubectl = shutil.which("kubectl")
        assert kubectl is not None, "kubectl is installed by make setup"
        env = {**os.environ, "PATH": f"{plugin_on_path(tmp_path)}:{os.environ['PATH']}", "KUBECONFIG": str(kubeconfig)}
        code, out, err = await run(kubectl, "moonlease", "approve", "fleet", "-o", "json", env=env)
        answer = json.loads(out)
        assert code == 0 and answer["value"] == pending and answer["outcome"] == "Applied"
        assert "empties the Mooncake store" in answer["message"]
        await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="Ready after the approval")
        code, out, _ = await moonlease(kubeconfig, "approve", "fleet")
        assert code == 4 and "nothing waits for approval (phase Ready)" in out


@pytest.mark.operator
async def test_plan_previews_the_live_cluster_and_says_so_in_its_exit_code(kube: LocalApiServer,
                                                                          tmp_path: Path) -> None:
    await create_fleet(kube)
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)
    manifest = tmp_path / "policy.yaml"
    manifest.write_text(yaml.safe_dump(policy()))
    code, out, err = await moonlease(kubeconfig, "plan", "-f", str(manifest))
    assert code == 2, (out, err)
    assert out.startswith(f"{NS}/fleet: would be Progressing")
    assert "master:  RESTARTS (restarting the master empties the Mooncake store)" in out
    master = next(line for line in out.splitlines() if line.startswith("  master   Deployment/mooncake-master"))
    assert " yes " in master and "--default_kv_lease_ttl: (unset) -> 5000" in master
    assert "--eviction_ratio: 0.05 -> 0.1" in out.split(master, 1)[1].splitlines()[1]  # the master's next line
    assert "StatefulSet/llama-decode" in out
    assert all(not configured(workload(kube, n)["spec"]["template"]) for n in WORKLOADS)  # nothing written

    code, out, _ = await moonlease(kubeconfig, "plan", "-f", str(manifest), "-o", "json")
    preview = json.loads(out)
    assert code == 2 and preview["masterRestarts"] and not preview["refused"]
    assert [w["stage"] for w in preview["workloads"]] == ["master", "prefill", "decode"]

    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS):
        await kube.create(policy())
        await kube.wait_for(lambda: phase(kube) == "Ready", timeout=WAIT, what="Ready")
    code, out, _ = await moonlease(kubeconfig, "plan", "-f", str(manifest))
    assert code == 0 and "would be Ready" in out and "master:  no restart" in out and "(in sync)" in out

    connector_only = policy(**{"connector.leaseMode": "leaseAll"})
    manifest.write_text(yaml.safe_dump(connector_only))
    code, out, _ = await moonlease(kubeconfig, "plan", "-f", str(manifest))
    assert code == 2 and "master:  no restart" in out

    refused: dict[str, Any] = policy("other")  # claims the same workloads as the live policy
    manifest.write_text(yaml.safe_dump(refused))
    code, out, _ = await moonlease(kubeconfig, "plan", "-f", str(manifest))
    assert code == 4 and "would be Invalid (ConflictingPolicy)" in out and "refused:" in out

    manifest.write_text("kind: ConfigMap\n")
    code, _, err = await moonlease(kubeconfig, "plan", "-f", str(manifest))
    assert code == 3 and "holds 0 MooncakeLeasePolicy objects" in err


@pytest.mark.prometheus
async def test_promote_and_abort_mid_measurement(kube: LocalApiServer, exporters: tuple[ArmExporter, ArmExporter],
                                                 tmp_path: Path) -> None:
    control, treatment = exporters
    originals = await create_arms(kube, {"control": port_of(control), "treatment": port_of(treatment)})
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS), \
            traffic(control, treatment, control_rate=0.5, treatment_rate=0.5):
        await kube.create(ab_policy(minSamples=20, maxSamples=30))
        await kube.wait_for(lambda: phase(kube, "ab") == "Analyzing", timeout=WAIT, what="measuring")

        code, out, _ = await moonlease(kubeconfig, "abort", "ab")
        assert code == 0 and "rolling the A/B treatment back now" in out, out
        await kube.wait_for(lambda: phase(kube, "ab") == "Degraded", timeout=WAIT, what="the treatment rolled back")
        assert status(kube, "ab")["abTest"]["phase"] == "RolledBack"
        assert all((kube.get("deployments", NS, n) or {})["spec"]["template"] == originals[n] for n in TREATMENT)

        code, out, _ = await moonlease(kubeconfig, "retry", "ab")
        assert code == 0
        await kube.wait_for(lambda: phase(kube, "ab") == "Analyzing", timeout=WAIT, what="a fresh test measuring")
        code, out, _ = await moonlease(kubeconfig, "status", "ab", "--watch", "--interval", "0.2", "--count", "2",
                                       "-o", "json")
        screens = [json.loads(line) for line in out.splitlines()]
        assert code == 1 and len(screens) == 2 and all(s["phase"] == "Analyzing" for s in screens)

        # Paused mid-measurement: no interval is measured, however long the pause.
        await kube.wait_for(lambda: status(kube, "ab")["abTest"].get("lastMeasuredAt"), timeout=WAIT,
                            what="the baseline read")
        code, out, _ = await moonlease(kubeconfig, "pause", "ab")
        assert code == 0 and phase(kube, "ab") == "Paused"
        held = status(kube, "ab")["abTest"]
        await asyncio.sleep(6)  # more than one 5 s interval
        assert phase(kube, "ab") == "Paused"
        now = status(kube, "ab")["abTest"]
        assert (now["samples"], now.get("lastMeasuredAt")) == (held["samples"], held.get("lastMeasuredAt"))
        code, out, _ = await moonlease(kubeconfig, "resume", "ab")
        assert code == 0 and phase(kube, "ab") == "Analyzing"

        code, out, _ = await moonlease(kubeconfig, "promote", "ab")
        assert code == 0 and "rolling the treatment's configuration out to the control" in out, out
        await kube.wait_for(lambda: phase(kube, "ab") == "Ready", timeout=WAIT, what="promoted")
        assert status(kube, "ab")["abTest"]["phase"] == "Promoted"
        # The control now runs the treatment's settings: its settings ConfigMaps say the same.
        settings = {n: (kube.get("configmaps", NS, settings_config_map_name(n)) or {}).get("data")
                    for n in CONTROL + TREATMENT}
        assert all(settings[c] and settings[c] == settings[t] for c, t in zip(CONTROL, TREATMENT)), settings
