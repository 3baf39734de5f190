"""`helm install → upgrade → uninstall` of the chart through the Helm SDK (helm-python-sdk: Helm 4's
Go SDK, server-side apply included) against the local API server, with the operator running:
the release installs, the operator reconciles it to Ready, a chart-version upgrade leaves every
pod template as it was (a new master pod would empty the store), and uninstall removes it all."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import helm_python as helm
import pytest
import yaml

from moonlease_dev.testbed.kube import DEPLOYMENTS, REPLICASETS, SECRETS, LocalApiServer, is_rollout_complete
from moonlease_operator.crd import CRD_NAME, build_crd
from moonlease_operator.runner import OperatorThread
from tests.chart.operator_scenario import FAST_OPTIONS, wait_ready
from tests.chart.rendering import CHART_DIR, NAMESPACE, RELEASE

pytestmark = [pytest.mark.chart, pytest.mark.operator]


def bumped_chart(tmp_path: Path, version: str) -> Path:
    """A copy of the chart with another chart version (what a release of the chart changes)."""
    copy = tmp_path / "moonlease"
    shutil.copytree(CHART_DIR, copy)
    chart_yaml = copy / "Chart.yaml"
    meta = yaml.safe_load(chart_yaml.read_text())
    meta["version"] = version
    chart_yaml.write_text(yaml.safe_dump(meta, sort_keys=False))
    return copy


def workloads(kube: LocalApiServer) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in kube.list(DEPLOYMENTS, NAMESPACE)}


def release_versions(kube: LocalApiServer) -> list[str]:
    """Helm's release records (Secrets `sh.helm.release.v1.<release>.v<N>`), by version label."""
    return sorted(s["metadata"]["labels"]["version"] for s in kube.list(SECRETS, NAMESPACE, label_selector="owner=helm"))


async def test_helm_install_upgrade_and_uninstall_with_the_operator_running(
        release_kube: LocalApiServer, tmp_path: Path) -> None:
    kube = release_kube
    config = helm.Config(kubeconfig_content=yaml.safe_dump(kube.kubeconfig(namespace=NAMESPACE)), namespace=NAMESPACE)
    master_name = f"{RELEASE}-mooncake-master"
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS):
        # Helm's calls block: they run in a thread while this loop serves them.
        installed = await asyncio.to_thread(config.install, str(CHART_DIR), RELEASE, {}, namespace=NAMESPACE,
                                            timeout=60)
        assert (installed["status"], installed["revision"], installed["chart_version"]) == ("deployed", 1, "0.1.0")
        assert release_versions(kube) == ["1"]
        # Helm applied the CRD of crds/ as Go's YAML 1.1 reader reads it, to which an unquoted
        # `n:` is the boolean false: a status property `n` arrived as `false`, and the API server
        # pruned the A/B analysis' counts from every status. It must be the models' CRD, key for key.
        assert kube.get("customresourcedefinitions", None, CRD_NAME)["spec"] == build_crd()["spec"]
        found = workloads(kube)
        assert {master_name, f"{RELEASE}-operator", f"{RELEASE}-prefill", f"{RELEASE}-decode"} <= set(found)
        # Helm 4 applies server-side: its field manager (the SDK names it after the process) owns
        # what it wrote, as an Apply; the rest is the Deployment controller's (its status and
        # revision annotation), as on a cluster.
        entries = found[master_name]["metadata"]["managedFields"]
        appliers = {e["manager"] for e in entries if e["operation"] == "Apply"}
        assert len(appliers) == 1, entries
        assert {(e["manager"], e["operation"]) for e in entries if e["operation"] != "Apply"} <= {
            ("kube-controller-manager", "Update")}, entries
        await kube.wait_for(lambda: all(is_rollout_complete(d) for d in workloads(kube).values()), timeout=20,
                            what="the release's Deployments to roll out")
        await wait_ready(kube)
        before = workloads(kube)

        upgraded = await asyncio.to_thread(config.upgrade, str(bumped_chart(tmp_path, "0.1.1")), RELEASE, {},
                                           namespace=NAMESPACE, timeout=60)
        assert (upgraded["status"], upgraded["revision"], upgraded["chart_version"]) == ("deployed", 2, "0.1.1")
        assert release_versions(kube) == ["1", "2"]
        after = workloads(kube)
        # The new chart version reached the objects' labels, and no pod template changed.
        assert after[master_name]["metadata"]["labels"]["helm.sh/chart"] == "moonlease-0.1.1"
        for name, deployment in before.items():
            assert after[name]["spec"]["template"] == deployment["spec"]["template"], name
            assert after[name]["metadata"]["generation"] == deployment["metadata"]["generation"], name
        master_sets = [rs for rs in kube.list(REPLICASETS, NAMESPACE)
                       if rs["metadata"]["ownerReferences"][0]["name"] == master_name]
        assert len(master_sets) == 1  # one master template ever: no master pod was replaced

        await asyncio.to_thread(config.uninstall, RELEASE, timeout=60)
        # The operator releases its finalizer on the policy; everything of the release goes.
        await kube.wait_for(lambda: kube.get("mlp", NAMESPACE, RELEASE) is None, timeout=20,
                            what="the release's policy to be deleted")
    assert workloads(kube) == {}
    assert release_versions(kube) == []
    assert kube.list(REPLICASETS, NAMESPACE) == []
    # Helm never deletes the CRDs of crds/.
    assert kube.get("customresourcedefinitions", None, "mooncakeleasepolicies.moonlease.io") is not None

