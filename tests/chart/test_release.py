"""`make release` (tools/release.py): it packages the chart only when users could install it —
the versions agree, the CHANGELOG describes the version, and the chart's default images name a
registry that can hold them (not Docker Hub by default, not `localhost` where `make images` tags
them). Chart-only releases here (`--skip-images`); the release with its images and their SBOMs is
tests/images/test_release_images.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

from tests.chart.rendering import CHART_DIR

pytestmark = pytest.mark.chart

REPO = CHART_DIR.parents[1]
sys.path.insert(0, str(REPO / "tools"))
import release  # noqa: E402 (tools/ is not a package)


@pytest.mark.parametrize(("image", "registry"), [
    ("moonlease/operator:0.1.0", None),  # Docker Hub by default
    ("operator:0.1.0", None),
    ("registry.example.com/ml/moonlease/operator:0.1.0", "registry.example.com"),
    ("registry:5000/moonlease/operator@sha256:" + "ab" * 32, "registry:5000"),
    ("localhost/moonlease/operator:0.1.0", "localhost"),
])
def test_the_registry_an_image_names(image: str, registry: str | None) -> None:
    assert release.registry_of(image) == registry


def test_images_without_a_registry_or_on_a_local_one_are_unheld() -> None:
    assert release.unheld_images([
        "moonlease/operator:0.1.0", "localhost/moonlease/mooncake:0.3.14", "127.0.0.1:5000/x:1",
        "localhost:5000/y:1", "ghcr.io/acme/moonlease/operator:0.1.0", "registry.example.com:5000/z:1",
    ]) == ["127.0.0.1:5000/x:1", "localhost/moonlease/mooncake:0.3.14", "localhost:5000/y:1",
           "moonlease/operator:0.1.0"]


def read_member(tar: tarfile.TarFile, name: str | tarfile.TarInfo) -> bytes:
    extracted = tar.extractfile(name)
    assert extracted is not None, name
    return extracted.read()


def run_release(out: Path, *args: str, images: bool = False, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """tools/release.py, a chart-only release unless `images`."""
    skip = () if images else ("--skip-images",)
    return subprocess.run([sys.executable, str(REPO / "tools" / "release.py"), "--out", str(out), *skip, *args],
                          capture_output=True, text=True, cwd=REPO, timeout=timeout)


def test_an_unknown_image_target_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    result = run_release(tmp_path / "dist", "--registry", "registry.example.com/ml", "--images", "operator", "gpu",
                         images=True)
    assert result.returncode == 1 and "unknown target gpu" in result.stderr, (result.stdout, result.stderr)
    assert "[images] building" not in result.stdout + result.stderr
    assert not (tmp_path / "dist").exists()


def test_the_registry_a_built_image_is_pushed_to_is_the_one_the_chart_pulls_from() -> None:
    assert release.pushed_as("localhost/moonlease/operator:0.1.0", "registry.example.com/ml/") == \
        "registry.example.com/ml/moonlease/operator:0.1.0"


def test_the_default_images_are_refused_with_what_to_do(tmp_path: Path) -> None:
    for args in ((), ("--registry", "localhost"), ("--registry", "localhost:5000/team")):
        result = run_release(tmp_path / "dist", *args, images=True)  # refused before any image is built
        assert result.returncode == 1, (args, result.stdout, result.stderr)
        assert "[images]" not in result.stdout + result.stderr
        assert "refused" in result.stderr and "REGISTRY=<registry>" in result.stderr, result.stderr
        assert "moonlease/operator:0.1.0" in result.stderr
        assert not (tmp_path / "dist").exists() or not list((tmp_path / "dist").iterdir())


def test_a_registry_gives_a_packaged_chart_whose_defaults_pull_from_it(tmp_path: Path) -> None:
    result = run_release(tmp_path / "dist", "--registry", "registry.example.com/ml/")
    assert result.returncode == 0, result.stderr
    archive = tmp_path / "dist" / "moonlease-0.1.0.tgz"
    assert f"{archive} (chart 0.1.0; images: registry.example.com/ml/moonlease/mooncake:0.3.14" in result.stdout
    digest, name = (tmp_path / "dist" / "moonlease-0.1.0.tgz.sha256").read_text().split()
    assert name == archive.name and len(digest) == 64
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        values = yaml.safe_load(read_member(tar, "moonlease/values.yaml"))
    assert values["global"]["imageRegistry"] == "registry.example.com/ml"
    assert "moonlease/crds/mooncakeleasepolicies.yaml" in names and "moonlease/README.md" in names
    assert not [n for n in names if n.startswith("moonlease/ci/")]  # the test values stay in the repository
    # Everything else is the repository's chart, byte for byte.
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            relative = member.name.removeprefix("moonlease/")
            if member.isfile() and relative not in ("values.yaml", "Chart.yaml"):
                assert read_member(tar, member) == (CHART_DIR / relative).read_bytes(), relative


def _repo_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "repo"
    (copy / "charts").mkdir(parents=True)
    shutil.copy(REPO / "pyproject.toml", copy / "pyproject.toml")
    for folder in release.RELEASED_WITH:
        (copy / folder).mkdir()
        shutil.copy(REPO / folder / "pyproject.toml", copy / folder / "pyproject.toml")
    shutil.copy(REPO / "CHANGELOG.md", copy / "CHANGELOG.md")
    shutil.copytree(CHART_DIR, copy / "charts" / "moonlease")
    return copy


def test_the_repository_s_versions_agree(tmp_path: Path) -> None:
    assert release.check_versions(_repo_copy(tmp_path)) == "0.1.0"


#: (file of a repository copy, text in it, its replacement, what the release then says)
DISAGREEMENTS = {
    "chart": ("charts/moonlease/Chart.yaml", 'appVersion: "0.1.0"', 'appVersion: "0.2.0"',
              "appVersion is 0.2.0, pyproject.toml's version 0.1.0"),
    "connector": ("connector/pyproject.toml", 'version = "0.1.0"', 'version = "0.1.1"',
                  "connector/pyproject.toml version is 0.1.1, pyproject.toml's 0.1.0"),
    "settings": ("settings/pyproject.toml", 'version = "0.1.0"', 'version = "0.2.0"',
                 "settings/pyproject.toml version is 0.2.0, pyproject.toml's 0.1.0"),
    "pin": ("connector/pyproject.toml", '"moonlease-settings==0.1.0"', '"moonlease-settings==0.0.9"',
            "connector/pyproject.toml requires moonlease-settings==0.0.9, not moonlease-settings==0.1.0"),
    "changelog": ("CHANGELOG.md", "## [0.1.0]", "## [0.0.9]", r"CHANGELOG.md has no section '## \[0.1.0\]'"),
}


@pytest.mark.parametrize("case", DISAGREEMENTS)
def test_the_versions_and_the_changelog_must_agree(tmp_path: Path, case: str) -> None:
    path, text, replacement, refusal = DISAGREEMENTS[case]
    copy = _repo_copy(tmp_path)
    edited = copy / path
    assert text in edited.read_text()
    edited.write_text(edited.read_text().replace(text, replacement, 1))
    with pytest.raises(release.Refusal, match=refusal):
        release.check_versions(copy)
