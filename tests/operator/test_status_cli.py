"""`moonlease status NAME` and `kubectl moonlease status NAME` against the local API server,
on a policy the real operator drove to a held A/B decision (issue 17, item 7)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import sys
import tomllib
from pathlib import Path

import pytest

from moonlease_dev.testbed.kube import LocalApiServer
from moonlease_operator.runner import OperatorThread
from tests.fixtures.kube import FAST_OPTIONS
from tests.operator.fleet import NS, phase
from tests.operator.test_ab_metric_sources import ArmExporter
from tests.operator.test_ab_operator import WAIT, ab_policy, create_arms, exporters, port_of, traffic  # noqa: F401 - fixture

pytestmark = pytest.mark.prometheus

REPO = Path(__file__).resolve().parents[2]


async def run(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """A command, without blocking the loop the local API server runs in."""
    process = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                   stderr=asyncio.subprocess.PIPE, env=env)
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    return process.returncode or 0, out.decode(), err.decode()


def plugin_on_path(tmp_path: Path) -> Path:
    """`kubectl-moonlease` as pip writes a console script: the entry point pyproject declares,
    run by this interpreter (the shared development venv may predate the entry point)."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, function = scripts["kubectl-moonlease"].split(":")
    script = tmp_path / "bin" / "kubectl-moonlease"
    script.parent.mkdir()
    script.write_text(f"#!{sys.executable}\nimport sys\nfrom {module} import {function}\nsys.exit({function}())\n")
    script.chmod(0o755)
    return script.parent


async def test_status_shows_the_held_test_and_the_command_that_decides_it(
        kube: LocalApiServer, exporters: tuple[ArmExporter, ArmExporter], tmp_path: Path) -> None:
    control, treatment = exporters
    await create_arms(kube, {"control": port_of(control), "treatment": port_of(treatment)})
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS), \
            traffic(control, treatment, control_rate=0.3, treatment_rate=0.6):
        await kube.create(ab_policy(onSuccess="hold"))
        await kube.wait_for(lambda: phase(kube, "ab") == "AwaitingDecision", timeout=WAIT, what="the held test")
        config_hash = (kube.get("mlp", NS, "ab") or {})["status"]["abTest"]["configHash"]

        code, out, err = await run(sys.executable, "-m", "moonlease.cli", "status", "ab", "--kubeconfig", str(kubeconfig))
        assert code == 2, (out, err)  # waiting for a person
        assert out.startswith(f"{NS}/ab: AwaitingDecision")
        assert re.search(r"A/B: +AwaitingDecision, verdict Success, samples \d+/6", out), out
        # control, treatment, effect, bounds, threshold (minEffect), p, Holm level, lag-1 autocorrelation
        assert re.search(r"externalHitRate +0\.[23]\d* +0\.[56]\d* +0\.[23]\d* +\[0\.\d+, 0\.\d+\] +0\.05 +\S+ +0\.0\d+ +\S+ +Success",
                         out), out
        assert f"run:     moonlease promote -n {NS} ab   # or: moonlease abort -n {NS} ab" in out

        code, out, _ = await run(sys.executable, "-m", "moonlease.cli", "status", "ab", "-o", "json",
                                 "--kubeconfig", str(kubeconfig))
        view = json.loads(out)
        assert view["phase"] == "AwaitingDecision" and view["ab_test"]["finalVerdict"] == "Success"
        [hit_rate] = [c for c in view["ab_test"]["conditions"] if c["metric"] == "externalHitRate"]
        assert hit_rate["lower"] > 0 and view["waiting"]["command"].startswith("moonlease promote")
        assert hit_rate["threshold"] == 0.05 and hit_rate["pValue"] <= hit_rate["level"]
        assert view["ab_test"]["configHash"] == config_hash
        assert sum(view["targets"].values()) == 3  # the master and the treatment's two (the control is held)

        # kubectl finds the plugin on PATH and passes `status ab` through.
        kubectl = shutil.which("kubectl")
        assert kubectl is not None, "kubectl is installed by make setup"
        env = {**os.environ, "PATH": f"{plugin_on_path(tmp_path)}:{os.environ['PATH']}", "KUBECONFIG": str(kubeconfig)}
        code, out, err = await run(kubectl, "moonlease", "status", "ab", env=env)
        assert code == 2 and out.startswith(f"{NS}/ab: AwaitingDecision"), (out, err)

        code, _, err = await run(sys.executable, "-m", "moonlease.cli", "status", "missing",
                                 "--kubeconfig", str(kubeconfig))
        assert code == 3 and "cannot read mooncakeleasepolicy missing" in err
