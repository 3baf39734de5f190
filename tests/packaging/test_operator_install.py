"""The operator side installs and runs without torch, vLLM or a Mooncake client.

Builds the distribution from this checkout into a fresh virtualenv with only the `operator`
extra, as the operator image does, and imports and starts the pieces that image runs.
"""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.operator
REPO = Path(__file__).resolve().parents[2]


def test_operator_extra_installs_without_torch_or_vllm(tmp_path: Path) -> None:
    env_dir = tmp_path / "operator-venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
         f"{REPO}[operator]"], capture_output=True, text=True)
    assert install.returncode == 0, install.stderr[-3000:]

    installed = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze"],
                               capture_output=True, text=True, check=True).stdout.lower()
    for heavy in ("torch", "vllm", "mooncake"):
        assert not any(line.startswith(heavy) for line in installed.splitlines()), heavy

    probe = ("import sys, moonlease_operator.handlers, moonlease_operator.crd, "
             "moonlease_connector.config\n"
             "crd = moonlease_operator.crd.build_crd()\n"
             "assert crd['kind'] == 'CustomResourceDefinition'\n"
             "assert not {'torch', 'vllm', 'mooncake'} & set(sys.modules), sorted(sys.modules)\n"
             "print('ok')")
    run = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]

    cli = subprocess.run([str(env_dir / "bin" / "moonlease"), "--help"], capture_output=True,
                         text=True, cwd=tmp_path)
    assert cli.returncode == 0 and "operator" in cli.stdout, cli.stderr[-2000:]
