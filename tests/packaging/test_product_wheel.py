"""The product distributions hold the product only, and install and run on every supported Python.

`moonlease` (the CLI and the operator), `moonlease-connector` (the connector alone, what the
connector image adds to vLLM's) and `moonlease-settings` (the connector's settings contract, which
both require) are built into wheels from this checkout and their contents listed: no test bed,
benchmark, demo or development environment (those are the `moonlease-dev` distribution of
dev/pyproject.toml), no connector in `moonlease`, nothing but the connector in
`moonlease-connector`, nothing but the settings contract in `moonlease-settings`; all three at one
version, pinning each other at it. Then `pip install` of the `moonlease` wheel (the settings wheel
beside it, as both are released), with no extra, into a fresh virtualenv of each supported Python other than the suite's own (3.12, 3.13:
PyPI gives the dependencies; 3.11, the suite's, is tests/operator/test_cli_without_kopf.py's) gives a `moonlease` and a `kubectl-moonlease` that read a policy from the local
API server, a `moonlease demo` that says where the development commands come from, and no
connector.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

from moonlease_dev.testbed.kube import LocalApiServer
from tests.operator.fleet import NS, create_fleet, policy

REPO = Path(__file__).resolve().parents[2]
PRODUCT_PACKAGES = {"moonlease", "moonlease_operator"}
DEVELOPMENT_MODULES = ("testbed", "bench", "devenv", "demo", "terminal")


#: What the four projects' builds read: the product (., connector/, settings/) and the development package (dev/).
SOURCES = ("pyproject.toml", "README.md", "moonlease", "connector", "operator", "settings", "moonlease_dev",
           "dev/pyproject.toml")
#: The product's distributions: the folder of each one's pyproject.toml.
PRODUCT_PROJECTS = {"moonlease": ".", "moonlease-connector": "connector", "moonlease-settings": "settings"}


def build_wheel(project: str, out: Path) -> Path:
    """`pip wheel` of one project of this repository (".", "connector", "settings" or "dev"), from a copy of its sources
    (setuptools writes its egg-info beside them: the checkout stays clean)."""
    copy = out / "src"
    for source in SOURCES:
        if not (copy / source).exists():
            copy_source(REPO / source, copy / source)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(out), str(copy / project)], check=True, capture_output=True, text=True)
    name = tomllib.loads((copy / project / "pyproject.toml").read_text())["project"]["name"].replace("-", "_")
    (wheel,) = out.glob(f"{name}-*.whl")
    return wheel


def copy_source(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    else:
        shutil.copy2(source, target)


def entry_points(archive: zipfile.ZipFile) -> str:
    (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")]
    return archive.read(name).decode()


@pytest.mark.unit
def test_the_product_wheel_holds_no_development_code(tmp_path: Path) -> None:
    with zipfile.ZipFile(build_wheel(".", tmp_path)) as wheel:
        names = [n for n in wheel.namelist() if ".dist-info/" not in n]
        points = entry_points(wheel)
    assert {n.split("/")[0] for n in names} == PRODUCT_PACKAGES, sorted({n.split("/")[0] for n in names})
    cli = sorted(n for n in names if n.startswith("moonlease/"))
    assert cli == ["moonlease/__init__.py", "moonlease/__main__.py", "moonlease/cli.py", "moonlease/drive.py",
                   "moonlease/plan_view.py", "moonlease/py.typed", "moonlease/status_view.py"], cli
    for module in DEVELOPMENT_MODULES:
        assert not [n for n in names if f"/{module}" in n], module
    assert "moonlease = moonlease.cli:main" in points and "kubectl-moonlease = moonlease.cli:kubectl_plugin" in points
    assert "moonlease.commands" not in points  # the development commands are the dev package's


def project(path: str) -> dict[str, Any]:
    return dict(tomllib.loads((REPO / path / "pyproject.toml").read_text())["project"])


@pytest.mark.unit
def test_the_connector_wheel_holds_the_connector_alone(tmp_path: Path) -> None:
    """The connector image adds this wheel and the settings one: no command line, no operator, no
    scripts, and none of the settings contract's modules (one copy of each, in its own wheel)."""
    with zipfile.ZipFile(build_wheel("connector", tmp_path)) as wheel:
        names = [n for n in wheel.namelist() if ".dist-info/" not in n]
        metadata = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    assert {n.split("/")[0] for n in names} == {"moonlease_connector"}, sorted({n.split("/")[0] for n in names})
    assert "moonlease_connector/adapters/vllm_connector.py" in names and "moonlease_connector/py.typed" in names
    for moved in ("config.py", "settings.py", "core/lease_modes.py"):
        assert f"moonlease_connector/{moved}" not in names, moved
    assert metadata == []  # no console scripts


@pytest.mark.unit
def test_the_settings_wheel_holds_the_settings_contract_alone(tmp_path: Path) -> None:
    """What both images hold: the connector's settings models, pure (pydantic its one requirement)."""
    with zipfile.ZipFile(build_wheel("settings", tmp_path)) as wheel:
        names = sorted(n for n in wheel.namelist() if ".dist-info/" not in n)
        metadata = [n for n in wheel.namelist() if n.endswith(".dist-info/entry_points.txt")]
    assert names == ["moonlease_settings/__init__.py", "moonlease_settings/config.py",
                     "moonlease_settings/lease_modes.py", "moonlease_settings/py.typed",
                     "moonlease_settings/retention.py", "moonlease_settings/settings_file.py"], names
    assert metadata == []
    assert [Requirement(r).name for r in project("settings")["dependencies"]] == ["pydantic"]


@pytest.mark.unit
def test_the_product_distributions_are_released_at_one_version_and_pin_each_other_at_it() -> None:
    """`moonlease` and `moonlease-connector` both require the settings contract at their own version
    (the operator renders what the connector reads); `moonlease` requires the connector only in its
    `connector` extra (the operator image holds none); all admit the same Pythons."""
    projects = {name: project(folder) for name, folder in PRODUCT_PROJECTS.items()}
    version = projects["moonlease"]["version"]
    for name, found in projects.items():
        assert found["name"] == name and found["version"] == version, name
        assert found["requires-python"] == projects["moonlease"]["requires-python"], name
    product, connector = projects["moonlease"], projects["moonlease-connector"]
    assert f"moonlease-settings=={version}" in product["dependencies"]
    assert f"moonlease-settings=={version}" in connector["dependencies"]
    assert not [r for r in product["dependencies"] if Requirement(r).name == "moonlease-connector"]
    assert product["optional-dependencies"]["connector"] == [f"moonlease-connector=={version}"]
    # Every pin of one of ours on another, in any project or extra, names the release's version.
    for name, found in projects.items():
        pins = [Requirement(r) for r in [*found.get("dependencies", []),
                                         *sum(found.get("optional-dependencies", {}).values(), [])]]
        for pin in pins:
            if pin.name in projects:
                assert str(pin.specifier) == f"=={version}", (name, str(pin))


@pytest.mark.unit
def test_the_development_wheel_holds_the_tooling_and_plugs_its_commands_in(tmp_path: Path) -> None:
    with zipfile.ZipFile(build_wheel("dev", tmp_path)) as wheel:
        names = [n for n in wheel.namelist() if ".dist-info/" not in n]
        points = entry_points(wheel)
    assert {n.split("/")[0] for n in names} == {"moonlease_dev"}
    for module in DEVELOPMENT_MODULES:
        assert any(n.startswith(f"moonlease_dev/{module}") for n in names), module
    assert "moonlease_dev/devenv/libcuda_stub.c" in names  # built by `python -m moonlease_dev.devenv build-stub`
    assert "[moonlease.commands]\ndev = moonlease_dev.cli:register" in points


def supported_pythons() -> list[str]:
    """Every minor version `requires-python` admits, from 3.11 on."""
    spec = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["requires-python"]
    assert spec.startswith(">=3.11,<3."), spec
    return [f"3.{minor}" for minor in range(11, int(spec.rsplit("<3.", 1)[1]))]


def interpreter(version: str) -> str:
    """`pythonX.Y` on PATH, else pyenv's (this machine kind ships 3.11 to 3.13 with pyenv)."""
    found = shutil.which(f"python{version}")
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"), "versions")
    candidates = sorted(pyenv.glob(f"{version}.*/bin/python{version}"))
    if found and subprocess.run([found, "--version"], capture_output=True).returncode == 0:
        return found
    assert candidates, f"no Python {version} on this machine (PATH or pyenv): the supported range needs it"
    return str(candidates[-1])


@pytest.mark.unit
def test_the_supported_pythons_are_3_11_to_3_13() -> None:
    assert supported_pythons() == ["3.11", "3.12", "3.13"]


#: The supported Pythons but this interpreter's (each fresh install costs a minute or more of PyPI).
OTHER_PYTHONS = [v for v in supported_pythons() if v != f"{sys.version_info.major}.{sys.version_info.minor}"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`pip install <the product wheel>` (no extra) into a fresh virtualenv of each supported
    Python, all at once (the time goes to PyPI); {version: its bin folder}."""
    root = tmp_path_factory.mktemp("installs")
    wheels = [str(build_wheel(".", root)), str(build_wheel("settings", root))]
    # Only the fresh virtualenv: nothing of this checkout or of this test session on its path.
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "VIRTUAL_ENV"))}
    bins = {}
    installs = []
    for version in OTHER_PYTHONS:
        target = root / f"venv-{version}"
        subprocess.run([interpreter(version), "-m", "venv", str(target)], check=True, env=env)
        bins[version] = target / "bin"
        installs.append(subprocess.Popen([str(target / "bin" / "pip"), "install", "--quiet", "--disable-pip-version-check",
                                          *wheels], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                         env=env, cwd=root))
    for version, process in zip(bins, installs):
        _, err = process.communicate(timeout=900)
        assert process.returncode == 0, (version, err[-4000:])
    return bins


async def run(*argv: str, env: dict[str, str]) -> tuple[int, str, str]:
    """Run in $HOME (a temp folder), so that no checkout folder is on the interpreter's path."""
    process = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, cwd=env["HOME"],
                                                   stderr=asyncio.subprocess.PIPE, env=env)
    out, err = await asyncio.wait_for(process.communicate(), timeout=120)
    return process.returncode or 0, out.decode(), err.decode()


@pytest.mark.operator
@pytest.mark.parametrize("version", OTHER_PYTHONS)
async def test_pip_install_moonlease_gives_working_commands(version: str, installed: dict[str, Path],
                                                            kube: LocalApiServer, tmp_path: Path) -> None:
    bin_ = installed[version]
    target = bin_.parent
    # Only the fresh virtualenv: none of this checkout's folders, no test-session variables.
    env = {"PATH": f"{bin_}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path),
           "KUBECONFIG": str(kube.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS))}
    await create_fleet(kube)
    await kube.create(policy())

    code, out, err = await run(str(bin_ / "python"), "-c", "import sys, moonlease; print(sys.version_info[:2], "
                               "moonlease.__file__)", env=env)
    assert code == 0 and out.startswith(f"({version.replace('.', ', ')})") and str(target) in out, (out, err)
    code, out, err = await run(str(bin_ / "moonlease"), "status", "fleet", env=env)
    assert code == 1 and out.startswith(f"{NS}/fleet:"), (out, err)  # read; not reconciled (no operator here)
    code, out, err = await run(str(bin_ / "kubectl-moonlease"), "status", "fleet", "-o", "json", env=env)
    assert code == 1 and '"name": "fleet"' in out, (out, err)
    code, out, err = await run(str(bin_ / "moonlease"), "crd", env=env)
    assert code == 0 and "kind: CustomResourceDefinition" in out, err
    code, out, err = await run(str(bin_ / "moonlease"), "demo", "--quick", env=env)
    assert code == 2 and "development command" in err and "make setup" in err, (out, err)
    code, out, err = await run(str(bin_ / "python"), "-c", "import moonlease_dev", env=env)
    assert code == 1 and "No module named 'moonlease_dev'" in err, (out, err)
    # The command line checks connector settings with the settings contract, not the connector.
    code, out, err = await run(str(bin_ / "python"), "-c", "import moonlease_settings.config, moonlease_connector",
                               env=env)
    assert code == 1 and "No module named 'moonlease_connector'" in err, (out, err)
