"""The operator image's install steps work and give an operator without the connector, torch, vLLM
or Mooncake (the connector's settings contract, `moonlease-settings`, is all it holds of it).

Replays the Dockerfile's `wheel`, `operator-venv` and `operator` stages (their own RUN and COPY
lines, see tests/packaging/image_stages.py) into clean virtualenvs built from this checkout, then
runs what the image runs: the `moonlease` entry point with the final stage's environment, and
the operator's modules.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.packaging.image_stages import build_wheel, dockerfile, this_python_is_the_base_images

pytestmark = pytest.mark.operator


def test_the_operator_stage_installs_without_torch_or_vllm(tmp_path: Path) -> None:
    assert this_python_is_the_base_images()
    stages, _ = build_wheel(tmp_path)
    stages.run_stage("operator-venv")
    stages.run_stage("operator")  # COPY --from=operator-venv: the virtualenv as the image has it
    env = stages.environment("operator")
    python = tmp_path / "opt" / "moonlease" / "bin" / "python"

    installed = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze"], capture_output=True,
                               text=True, env=env)
    # The stage removes pip from the image's virtualenv: ask the base interpreter's pip instead.
    assert installed.returncode != 0 and "No module named pip" in installed.stderr
    listed = subprocess.run([str(stages.bin / "python"), "-m", "pip", "--python", str(python), "list",
                             "--format=freeze"], capture_output=True, text=True, check=True).stdout.lower()
    names = {line.split("==")[0] for line in listed.splitlines()}
    assert "moonlease" in names and "kopf" in names and "kubernetes" in names
    assert "moonlease-settings" in names  # `moonlease` requires it: the connector settings' models
    assert "moonlease-connector" not in names  # the connector image's component, not this one's
    for heavy in ("torch", "vllm", "mooncake"):
        assert not any(name.startswith(heavy) for name in names), heavy

    probe = ("import importlib.util, sys, moonlease_operator.handlers, moonlease_operator.crd, "
             "moonlease_settings.config\n"
             "crd = moonlease_operator.crd.build_crd()\n"
             "assert crd['kind'] == 'CustomResourceDefinition'\n"
             "assert not {'torch', 'vllm', 'mooncake'} & set(sys.modules), sorted(sys.modules)\n"
             "assert importlib.util.find_spec('moonlease_connector') is None\n"
             "assert moonlease_settings.config.__file__.startswith(sys.prefix), moonlease_settings.config.__file__\n"
             "assert moonlease_operator.__file__.startswith(sys.prefix), moonlease_operator.__file__\n"
             "print('ok')")
    run = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]

    # The image's entry point and command, found on the final stage's PATH.
    final = dockerfile().stages["operator"]
    entrypoint, command = final.exec_form("ENTRYPOINT"), final.exec_form("CMD")
    assert entrypoint == ["moonlease"] and command == ["operator", "--standalone"]
    cli = subprocess.run([*entrypoint, "--help"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert cli.returncode == 0 and "operator" in cli.stdout, cli.stderr[-2000:]
    help_ = subprocess.run([*entrypoint, *command, "--help"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert help_.returncode == 0 and "--all-namespaces" in help_.stdout, help_.stderr[-2000:]
