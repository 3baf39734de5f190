"""The Dockerfile is hadolint-clean and builds what the chart deploys: one target per image, each
pinned, unprivileged, without caches, and matching the chart's defaults. (Its install steps are
replayed in tests/packaging/: no Docker engine runs here.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.specifiers import SpecifierSet

from tests.chart.dockerfile import DOCKERFILE, parse
from tests.chart.rendering import CHART_DIR, REPO, container, load_chart, one, render_objects

pytestmark = pytest.mark.chart

HADOLINT = Path(sys.executable).with_name("hadolint")
DOCKERFILE_MODEL = parse()
TARGETS = {"operator": "operator", "connector": "vllm", "mooncake": "mooncake"}  # target -> values key
VALUES = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def hadolint(path: Path) -> list[dict[str, object]]:
    """Findings at every level (style and up), inline `# hadolint ignore` comments not honoured."""
    result = subprocess.run([str(HADOLINT), "--no-color", "--disable-ignore-pragma", "--failure-threshold", "style",
                             "--format", "json", str(path)], capture_output=True, text=True)
    findings: list[dict[str, object]] = json.loads(result.stdout or "[]")
    assert (result.returncode == 0) == (not findings), result.stderr
    return findings


def test_hadolint_finds_nothing() -> None:
    assert hadolint(DOCKERFILE) == []


def test_hadolint_does_find_what_it_should(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11\nRUN pip install kopf\nRUN apt-get update && apt-get install -y gcc\n")
    assert {f["code"] for f in hadolint(bad)} >= {"DL3013", "DL3042", "DL3008"}


def test_one_target_per_image_each_with_its_entry_point() -> None:
    stages = DOCKERFILE_MODEL.stages
    assert set(TARGETS) <= set(stages)
    assert stages["operator"].exec_form("ENTRYPOINT") == ["moonlease"]
    assert stages["connector"].exec_form("ENTRYPOINT") == ["vllm"]
    assert stages["mooncake"].exec_form("ENTRYPOINT") == ["mooncake_master"]
    # The build commands in the header tag the images as the chart's defaults name them.
    header = DOCKERFILE.read_text()
    for target, key in TARGETS.items():
        image = VALUES[key]["image"]
        assert f"--target {target} " in header and f"{image['repository']}:{image['tag']}" in header, target


def test_every_image_runs_as_a_numeric_non_root_user_matching_the_chart() -> None:
    templates = CHART_DIR / "templates"
    expected_uid = {"operator": (templates / "operator-deployment.yaml", "65532"),
                    "mooncake": (templates / "mooncake-master.yaml", "65532"),
                    "connector": (templates / "vllm.yaml", "10001")}
    for target, (template, uid) in expected_uid.items():
        user = DOCKERFILE_MODEL.stages[target].user(DOCKERFILE_MODEL.global_args)
        assert user is not None and re.fullmatch(r"[1-9][0-9]*:[0-9]+", user), (target, user)
        assert user.split(":")[0] == uid, target
        assert f'include "moonlease.podSecurityContext" {uid}' in template.read_text(), target


def test_base_images_are_pinned_and_the_connector_is_on_the_supported_vllm() -> None:
    for name in DOCKERFILE_MODEL.stages:
        base = DOCKERFILE_MODEL.base_image(name)
        if base in DOCKERFILE_MODEL.stages:
            continue  # built on an earlier stage
        image, _, tag = base.partition(":")
        assert tag and tag != "latest" and re.search(r"\d+\.\d+", tag), (name, base)
    vllm = DOCKERFILE_MODEL.base_image("connector")
    version = re.match(r"vllm/vllm-openai:v(\d+\.\d+\.\d+)", vllm)
    assert version is not None
    supported = (REPO / "docs" / "connector.md").read_text()  # its "Supported versions" table
    assert f"`{vllm}`" in supported
    chart = yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())
    assert chart["annotations"]["moonlease.io/vllm-version"] == version.group(1)
    assert VALUES["vllm"]["image"]["tag"].endswith(f"vllm{version.group(1)}")


def test_python_packages_are_pinned_and_caches_are_off() -> None:
    mooncake = chart_mooncake = VALUES["mooncake"]["version"]
    for name, stage in DOCKERFILE_MODEL.stages.items():
        env = stage.env(DOCKERFILE_MODEL.global_args)
        for run in stage.all("RUN"):
            if "pip install" not in run.value:
                continue
            assert env.get("PIP_NO_CACHE_DIR") == "1", name  # no wheel cache left in a layer
            # Every requirement is a pinned name, a wheel built here, or constrained by the lock.
            for requirement in re.findall(r"(?<=\s)([A-Za-z][\w.-]*(?:\[[\w,]+\])?(?:==[\w.+-]+)?)(?=\s|$)",
                                          run.value.split("pip install", 1)[1].split("&&")[0]):
                assert "==" in requirement, (name, requirement)
            # Transitive dependencies come from the lock, except in vLLM's image (and its CPU
            # stand-in's copy of the stage), which brings its own (pip adds only what is
            # missing), and the wheel stage (setuptools has none).
            assert ("--constraint" in run.value) is (name not in ("connector", "connector-cpu", "wheel")), name
            if "mooncake-transfer-engine" in run.value:
                assert f"mooncake-transfer-engine-cuda13=={mooncake}" in run.value, name
    assert chart_mooncake == VALUES["mooncake"]["image"]["tag"]


def test_the_operator_image_gets_no_torch_vllm_or_mooncake() -> None:
    for name in ("operator-venv", "operator"):
        text = " ".join(i.value for i in DOCKERFILE_MODEL.stages[name].instructions).lower()
        assert not re.search(r"torch|vllm|mooncake", text), name
        assert "[operator]" in text or name == "operator"
    extra = PYPROJECT["project"]["optional-dependencies"]["operator"]
    assert not [r for r in extra if re.match(r"(torch|vllm|mooncake)", r)]


def test_the_wheel_version_and_python_match_the_project() -> None:
    version = PYPROJECT["project"]["version"]
    for name in ("operator-venv", "connector"):
        assert DOCKERFILE_MODEL.stages[name].args(DOCKERFILE_MODEL.global_args)["MOONLEASE_VERSION"] == version
    assert VALUES["operator"]["image"]["tag"] == version
    # The wheel goes into vLLM's image, whose Python is 3.12; the others run 3.11.
    supported = SpecifierSet(PYPROJECT["project"]["requires-python"])
    assert "3.12.3" in supported and "3.11.7" in supported


def test_the_build_context_holds_what_the_images_copy_and_nothing_heavy() -> None:
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*"  # everything out, then what the images need back in
    allowed = [p[1:].rstrip("/") for p in patterns if p.startswith("!")]
    sources = [src for stage in DOCKERFILE_MODEL.stages.values() for ins in stage.all("COPY")
               if "from" not in ins.flags for src in ins.value.split()[:-1]]
    sources += [m["source"] for stage in DOCKERFILE_MODEL.stages.values() for ins in stage.all("RUN")
                for m in ins.mounts if "from" not in m]
    for source in sources:
        assert any(source.rstrip("/") == a or source.startswith(a + "/") for a in allowed), source
        assert (REPO / source).exists(), source
    assert not any(a.startswith(".venv") or a.startswith(".git") for a in allowed)


def test_the_images_writable_places_are_the_charts_volumes() -> None:
    """HOME (and the model cache under it) and /tmp: where each image writes, the chart mounts
    a volume, so the root filesystem can stay read-only."""
    with load_chart() as chart:
        objects = render_objects(chart, {})
    pods = {"connector": one(objects, "Deployment", "moonlease-decode"),
            "operator": one(objects, "Deployment", "moonlease-operator"),
            "mooncake": one(objects, "Deployment", "moonlease-mooncake-master")}
    for target, workload in pods.items():
        env = DOCKERFILE_MODEL.stages[target].env(DOCKERFILE_MODEL.global_args, {"PATH": ""})
        mounts = {m["mountPath"] for m in container(workload)["volumeMounts"]}
        assert env["HOME"] in mounts and "/tmp" in mounts, target
    connector_env = DOCKERFILE_MODEL.stages["connector"].env(DOCKERFILE_MODEL.global_args, {"PATH": ""})
    cache = {m["mountPath"]: m["name"] for m in container(pods["connector"], "vllm")["volumeMounts"]}
    assert cache[connector_env["HF_HOME"]] == "model-cache"
