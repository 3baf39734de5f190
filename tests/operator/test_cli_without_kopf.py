"""`pip install moonlease` without extras gives a working `moonlease status`, `moonlease plan`
and `kubectl-moonlease`: each runs against the local API server in a subprocess that can import
only what the base dependencies install (an import of any other distribution's module, kopf's
and the connector's first of all, fails as it would there; optional imports fall back as they
would)."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from moonlease_dev.testbed.kube import LocalApiServer
from tests.operator.fleet import NS, create_fleet, policy

pytestmark = pytest.mark.operator

REPO = Path(__file__).resolve().parents[2]
#: Our import packages, each with its distribution: those `moonlease` does not require (the
#: connector) are blocked too, whatever this environment's editable installs say.
OURS = {"moonlease": "moonlease", "moonlease_operator": "moonlease", "moonlease_settings": "moonlease-settings",
        "moonlease_connector": "moonlease-connector"}
# The command line in an interpreter where the modules of `blocked` (JSON list) cannot be imported.
ONLY_BASE = """
import importlib.abc, json, sys
blocked = set(json.loads(sys.argv.pop(1)))
class OnlyBase(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, OnlyBase())
from moonlease.cli import {entry}
sys.exit({entry}() if "{entry}" == "kubectl_plugin" else {entry}(sys.argv[1:]))
"""


def norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


#: Our distributions' requirements come from their pyproject.toml (an editable install's metadata
#: may be another checkout's).
OUR_PROJECTS = {"moonlease": REPO, "moonlease-connector": REPO / "connector", "moonlease-settings": REPO / "settings"}


def requires(name: str) -> list[str]:
    if norm(name) in OUR_PROJECTS:
        return list(tomllib.loads((OUR_PROJECTS[norm(name)] / "pyproject.toml").read_text())["project"]["dependencies"])
    return importlib.metadata.requires(name) or []


def base_distributions() -> set[str]:
    """Distributions `pip install moonlease` installs: the base dependencies and, from the
    installed metadata, theirs (without extras), by normalised name."""
    pending = [Requirement(r) for r in requires("moonlease")]
    found: set[str] = set()
    while pending:
        requirement = pending.pop()
        if norm(requirement.name) in found or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
            continue
        found.add(norm(requirement.name))
        pending.extend(Requirement(r) for r in requires(requirement.name))
    return found


def blocked_modules() -> list[str]:
    """Top-level modules of this environment that only distributions outside the base set provide."""
    base = base_distributions()
    theirs = {module for module, dists in importlib.metadata.packages_distributions().items()
              if module not in OURS and not {norm(d) for d in dists} & base}
    return sorted(theirs | {module for module, dist in OURS.items() if dist != "moonlease" and dist not in base})


async def run_with_base_only(entry: str, *args: str) -> tuple[int, str, str]:
    """`moonlease.cli.<entry>` in a fresh interpreter limited to the base dependencies, with
    `args` on its command line: (exit code, stdout, stderr)."""
    blocked = blocked_modules()
    assert "kopf" in blocked and "aiohttp" not in blocked and "kubernetes" not in blocked
    assert "moonlease_connector" in blocked and "moonlease_settings" not in blocked  # pip install moonlease: no connector
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", ONLY_BASE.format(entry=entry), json.dumps(blocked), *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert "ModuleNotFoundError" not in err.decode(), err.decode()
    return process.returncode or 0, out.decode(), err.decode()


async def test_status_plan_and_the_kubectl_plugin_run_without_kopf(kube: LocalApiServer, tmp_path: Path) -> None:
    await create_fleet(kube)
    await kube.create(policy())
    kubeconfig = str(kube.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS))
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(policy(**{"connector.leaseMode": "leaseAll"})))  # the same policy, changed

    code, out, err = await run_with_base_only("main", "status", "fleet", "--kubeconfig", kubeconfig)
    assert code == 1 and out.startswith(f"{NS}/fleet:"), (out, err)  # not reconciled (no operator): working
    code, out, err = await run_with_base_only("main", "plan", "-f", str(policy_file), "--kubeconfig", kubeconfig)
    assert code == 2, (out, err)  # the policy would change workloads
    code, out, err = await run_with_base_only("main", "status", "fleet", "-o", "json", "--kubeconfig", kubeconfig)
    assert json.loads(out)["name"] == "fleet", (out, err)


async def test_the_kubectl_plugin_entry_point_runs_without_kopf(kube: LocalApiServer, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """`kubectl moonlease status fleet` runs `kubectl-moonlease status fleet` with KUBECONFIG set."""
    await create_fleet(kube)
    await kube.create(policy())
    monkeypatch.setenv("KUBECONFIG", str(kube.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)))
    code, out, err = await run_with_base_only("kubectl_plugin", "status", "fleet")
    assert code == 1 and out.startswith(f"{NS}/fleet:"), (out, err)
