"""`make release`: package the Helm chart for a release, refusing what users could not install.

    python tools/release.py --registry registry.example.com/ml --out dist

Checks, in order, each refusal one line that says what to change (exit 1):

1. the version: pyproject's `version` is the chart's `version` and `appVersion`, and CHANGELOG.md
   has its section (`## [<version>]`);
2. the images: the chart, rendered with the defaults it will ship, runs only images a registry
   can hold. The defaults name our images without a registry (`moonlease/operator:0.1.0`, which
   would resolve to Docker Hub, where none of them is) and `make images` tags them `localhost/...`:
   `--registry` (where you pushed the images) becomes the packaged chart's
   `global.imageRegistry`; without it the release is refused;
3. `helm lint --strict` of the chart as packaged;

then writes `<out>/moonlease-<version>.tgz` (Helm's SDK, helm-python-sdk: no helm binary
needed) and its SHA-256 beside it. Building and pushing the images stays `make images` and your
registry's tooling.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import sys
import tempfile
import tomllib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "moonlease"
_DEFAULT_REGISTRY_LINE = re.compile(r'^  imageRegistry: ""$', re.MULTILINE)


class Refusal(Exception):
    """A reason not to release, said in one line."""


def registry_of(image: str) -> str | None:
    """The registry host an image reference names, or None when it names none (Docker's default
    then applies): the first path component, if it has a dot or a port or is `localhost`."""
    first, _, rest = image.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        return first
    return None


def unheld_images(images: Iterable[str]) -> list[str]:
    """The images no registry holds for users: without a registry (Docker Hub has no image of
    ours) or on a local one (`localhost`, a loopback address: what `make images` builds)."""
    local = ("localhost", "127.0.0.1", "[::1]")

    def held(image: str) -> bool:
        registry = registry_of(image)
        return registry is not None and re.sub(r":[0-9]+$", "", registry) not in local

    return sorted({image for image in images if not held(image)})


def check_versions(repo: Path = REPO) -> str:
    """The release version, after checking the chart and the CHANGELOG agree with pyproject."""
    version = tomllib.loads((repo / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((repo / "charts" / "moonlease" / "Chart.yaml").read_text())
    for key in ("version", "appVersion"):
        if str(chart[key]) != version:
            raise Refusal(f"charts/moonlease/Chart.yaml {key} is {chart[key]}, pyproject.toml's version {version}: "
                          "make them equal")
    changelog = repo / "CHANGELOG.md"
    if not changelog.exists() or not re.search(rf"^## \[{re.escape(version)}\]", changelog.read_text(), re.MULTILINE):
        raise Refusal(f"CHANGELOG.md has no section '## [{version}]': describe the release there first")
    return version


def stage_chart(destination: Path, registry: str | None) -> Path:
    """A copy of the chart to package, its default `global.imageRegistry` set to `registry`."""
    staged = destination / "moonlease"
    shutil.copytree(CHART, staged, ignore=shutil.ignore_patterns("ci"))
    if registry:
        values = staged / "values.yaml"
        text, count = _DEFAULT_REGISTRY_LINE.subn(f"  imageRegistry: {registry.rstrip('/')!r}", values.read_text())
        if count != 1:
            raise Refusal('charts/moonlease/values.yaml: expected one `  imageRegistry: ""` line under global')
        values.write_text(text)
    return staged


def images_in(objects: Iterable[dict[str, Any]]) -> Iterator[str]:
    for obj in objects:
        spec = obj.get("spec", {}).get("template", {}).get("spec") if obj.get("kind") in (
            "Deployment", "StatefulSet", "DaemonSet", "Job") else obj.get("spec") if obj.get("kind") == "Pod" else None
        for container in (spec or {}).get("containers", []) + (spec or {}).get("initContainers", []):
            yield container["image"]


def check_images(staged: Path) -> list[str]:
    """Every image the staged chart runs with its defaults; refuses unheld ones."""
    import helm_python as helm

    with helm.Chart.load(staged) as chart:
        rendered = chart.render({}, name="moonlease", namespace="moonlease", is_install=True)
    objects = [doc for path, text in rendered.items() if not path.endswith("NOTES.txt")
               for doc in yaml.safe_load_all(text) if doc]
    images = sorted(set(images_in(objects)))
    unheld = unheld_images(images)
    if unheld:
        raise Refusal("the chart's default images name no registry that holds them ("
                      + ", ".join(unheld) + "): push `make images` to a registry and run "
                      "`make release REGISTRY=<registry>` (it becomes the chart's global.imageRegistry)")
    return images


def release(out: Path, registry: str | None) -> Path:
    """Check, then package; the archive's path."""
    import helm_python as helm

    version = check_versions()
    with tempfile.TemporaryDirectory(prefix="moonlease-release-") as work:
        staged = stage_chart(Path(work), registry)
        images = check_images(staged)
        report = helm.lint(staged, strict=True, namespace="moonlease")
        findings = report["errors"] + [m for m in report["messages"] if m["severity"] >= 2]  # warning, error
        if findings:
            raise Refusal(f"helm lint --strict: {findings}")
        out.mkdir(parents=True, exist_ok=True)
        archive = Path(helm.package(staged, destination=out))
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    (archive.parent / (archive.name + ".sha256")).write_text(f"{digest}  {archive.name}\n")
    print(f"{archive} (chart {version}; images: {', '.join(images)})")
    return archive


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--registry", default="",
                        help="registry (and path) holding the images, e.g. registry.example.com/ml; "
                             "becomes the packaged chart's global.imageRegistry")
    parser.add_argument("--out", type=Path, default=REPO / "dist", help="where the archive goes (default dist/)")
    args = parser.parse_args(argv)
    try:
        release(args.out, args.registry or None)
    except Refusal as refusal:
        sys.stderr.write(f"make release: refused: {refusal}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
