"""The SBOM writer of `make release` (tools/sbom.py) against a small real environment: a fresh
virtualenv (what ensurepip puts there), this machine's dpkg database, and the same virtualenv's
files under another root as an image's mounted file system would be. The images' SBOMs are
tests/images/test_release_images.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import venv
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import sbom  # noqa: E402 (tools/ is not a package)

pytestmark = pytest.mark.slow  # cyclonedx-py starts in seconds


@pytest.fixture(scope="module")
def small_venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], dict[str, str]]:
    """A fresh virtualenv: its python, its sys.path, and {distribution: version} as pip lists it."""
    root = tmp_path_factory.mktemp("small") / "venv"
    venv.EnvBuilder(with_pip=True).create(root)
    python = root / "bin" / "python"
    path = json.loads(subprocess.run([str(python), "-c", sbom.SYS_PATH_PROBE], capture_output=True, text=True,
                                     check=True, cwd=root).stdout)
    listed = json.loads(subprocess.run([str(python), "-m", "pip", "list", "--format=json", "--disable-pip-version-check"],
                                       capture_output=True, text=True, check=True).stdout)
    return python, path, {d["name"].lower(): d["version"] for d in listed}


def python_purls(document: dict[str, Any]) -> dict[str, str]:
    return {c["name"].lower(): c["purl"] for c in document.get("components", []) if c.get("purl", "").startswith("pkg:pypi/")}


def test_the_python_components_are_the_environments_distributions(
        small_venv: tuple[Path, list[str], dict[str, str]]) -> None:
    _, path, installed = small_venv
    assert "pip" in installed
    found = python_purls(sbom.python_components(path))
    assert found == {name: f"pkg:pypi/{name}@{version}" for name, version in installed.items()}


def test_an_environment_under_another_root_is_read_there(
        small_venv: tuple[Path, list[str], dict[str, str]], tmp_path: Path) -> None:
    """As in a mounted image: the path names the image's folders, the files lie under its root."""
    python, path, installed = small_venv
    prefix = python.parents[1]
    site = next(entry for entry in path if entry.startswith(str(prefix)) and entry.endswith("site-packages"))
    root = tmp_path / "rootfs"
    shutil.copytree(site, root / "opt" / "env" / "site-packages")
    image_path = ["/usr/lib/python311.zip", "/opt/env/site-packages", "relative/ignored"]
    assert python_purls(sbom.python_components(image_path, root)).keys() == installed.keys()
    assert python_purls(sbom.python_components(["/opt/env/site-packages"], tmp_path / "elsewhere")) == {}


def test_the_debian_packages_are_the_installed_ones() -> None:
    status = Path("/var/lib/dpkg/status").read_text()
    packages = {p["name"]: p for p in sbom.debian_packages(status)}
    version = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "dpkg"], capture_output=True, text=True,
                             check=True).stdout
    assert packages["dpkg"]["version"] == version and packages["dpkg"]["arch"]
    # A package that was removed but whose configuration files remain is not in the image.
    removed = "Package: gone\nStatus: deinstall ok config-files\nVersion: 1.0\n\nPackage: kept\nStatus: install ok installed\n" \
              "Architecture: all\nVersion: 1:2.3-4+deb12u1\n"
    assert sbom.debian_packages(removed) == [{"name": "kept", "version": "1:2.3-4+deb12u1", "arch": "all"}]
    assert sbom.debian_component({"name": "kept", "version": "1:2.3-4+deb12u1", "arch": "all"})["purl"] == \
        "pkg:deb/debian/kept@1%3A2.3-4%2Bdeb12u1?arch=all"


def test_the_image_is_the_subject_and_the_written_sbom_is_valid_cyclonedx(
        small_venv: tuple[Path, list[str], dict[str, str]], tmp_path: Path) -> None:
    _, path, installed = small_venv
    debian = [{"name": "libc6", "version": "2.36-9+deb12u13", "arch": "amd64"}]
    document = sbom.with_image(sbom.python_components(path), "localhost/moonlease/operator:0.1.0", "sha256:ab", debian)
    written = sbom.write_sbom(document, tmp_path / sbom.sbom_file_name("localhost/moonlease/operator:0.1.0"))
    assert written.name == "operator-0.1.0.cdx.json"
    read = json.loads(written.read_text())
    assert read["bomFormat"] == "CycloneDX" and read["specVersion"] == sbom.SPEC_VERSION
    subject = read["metadata"]["component"]
    assert (subject["type"], subject["name"], subject["version"]) == ("container", "localhost/moonlease/operator", "0.1.0")
    (image_deps,) = [d for d in read["dependencies"] if d["ref"] == subject["bom-ref"]]
    assert len(image_deps["dependsOn"]) == len(installed) + 1 == len(read["components"])
    # Invalid CycloneDX is refused and nothing is left behind.
    read["components"][0]["type"] = "not-a-type"
    with pytest.raises(sbom.SbomError, match="not valid CycloneDX"):
        sbom.write_sbom(read, tmp_path / "bad.cdx.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["operator-0.1.0.cdx.json"]


def test_sbom_file_names() -> None:
    assert sbom.sbom_file_name("localhost/moonlease/vllm-connector:0.1.0-vllm-cpu0.32.0") == \
        "vllm-connector-0.1.0-vllm-cpu0.32.0.cdx.json"
    assert sbom.sbom_file_name("registry.example.com:5000/moonlease/mooncake") == "mooncake-latest.cdx.json"
