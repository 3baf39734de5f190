"""`make release`: the chart, the images and their SBOMs for a release, refusing what users could not install.

    python tools/release.py --registry registry.example.com/ml --out dist
    python tools/release.py --registry registry.example.com/ml --skip-images   # the chart only

Checks, in order, each refusal one line that says what to change (exit 1):

1. the version: pyproject's `version` is connector/pyproject.toml's and settings/pyproject.toml's,
   every pin of one of our distributions on another (`moonlease-settings==<version>`) names it,
   the chart's `version` and `appVersion` are it, and CHANGELOG.md has its section
   (`## [<version>]`);
2. the images: the chart, rendered with the defaults it will ship, runs only images a registry
   can hold. The defaults name our images without a registry (`moonlease/operator:0.1.0`, which
   would resolve to Docker Hub, where none of them is) and `make images` tags them `localhost/...`:
   `--registry` (where you pushed the images) becomes the packaged chart's
   `global.imageRegistry`; without it the release is refused;
3. `helm lint --strict` of the chart as packaged;

then, unless `--skip-images`, builds the images (`tools/images.sh`, what `make images` runs; by
default its targets: operator, mooncake, connector-cpu; `--images` names others, e.g. `connector`
where vLLM's CUDA image can be had) and writes a CycloneDX SBOM of each (tools/sbom.py:
`<out>/<image>-<tag>.cdx.json`, its Python distributions by cyclonedx-py and its Debian
packages); last it writes `<out>/moonlease-<version>.tgz` (Helm's SDK, helm-python-sdk: no helm
binary needed) and its SHA-256 beside it, and prints the `podman push` of each image built. Pushing
stays your registry's tooling.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sbom  # noqa: E402 (tools/ is not a package)

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "moonlease"
IMAGES_SCRIPT = REPO / "tools" / "images.sh"
#: What `make images` builds (tools/images.sh's default targets): what this machine kind can build.
DEFAULT_TARGETS = ("operator", "mooncake", "connector-cpu")
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


#: The product's distributions released with `moonlease` (pyproject.toml), at its version: the
#: folder of each one's pyproject.toml. They require each other at exactly that version.
RELEASED_WITH = ("connector", "settings")


def check_versions(repo: Path = REPO) -> str:
    """The release version, after checking the other distributions, their pins on each other,
    the chart and the CHANGELOG agree with pyproject."""
    projects = {".": tomllib.loads((repo / "pyproject.toml").read_text())["project"]}
    version = projects["."]["version"]
    for folder in RELEASED_WITH:
        projects[folder] = tomllib.loads((repo / folder / "pyproject.toml").read_text())["project"]
        if projects[folder]["version"] != version:
            raise Refusal(f"{folder}/pyproject.toml version is {projects[folder]['version']}, pyproject.toml's "
                          f"{version}: make them equal (they are released together)")
    ours = {str(project["name"]) for project in projects.values()}
    for folder, project in projects.items():
        pins = [*project.get("dependencies", []),
                *(r for extra in project.get("optional-dependencies", {}).values() for r in extra)]
        for pin in pins:
            name, _, pinned = str(pin).partition("==")
            if name.strip() in ours and pinned.strip() != version:
                where = "pyproject.toml" if folder == "." else f"{folder}/pyproject.toml"
                raise Refusal(f"{where} requires {pin}, not {name.strip()}=={version}: our distributions "
                              "require each other at the release's version")
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


def local_image(target: str) -> str:
    """The name podman gives the image `tools/images.sh` builds for a target (an unqualified
    name is stored under `localhost/`)."""
    result = subprocess.run(["bash", str(IMAGES_SCRIPT), "--name", target], capture_output=True, text=True)
    if result.returncode != 0:
        raise Refusal(f"tools/images.sh: {result.stderr.strip()}")
    name = result.stdout.strip()
    return name if registry_of(name) else f"localhost/{name}"


def build_images(targets: Sequence[str]) -> list[str]:
    """`tools/images.sh TARGET...` (its progress on this process's output); the local images."""
    names = [local_image(target) for target in targets]  # an unknown target is refused before any build
    if subprocess.run(["bash", str(IMAGES_SCRIPT), *targets]).returncode != 0:
        raise Refusal(f"tools/images.sh {' '.join(targets)} failed (its output is above)")
    return names


def pushed_as(image: str, registry: str | None) -> str:
    """Where a local image goes in the registry: the chart pulls `<registry>/<repository>:<tag>`."""
    path = image.removeprefix("localhost/")
    return f"{registry.rstrip('/')}/{path}" if registry else path


def release(out: Path, registry: str | None, targets: Sequence[str] = ()) -> Path:
    """Check, build the images of `targets` with an SBOM each, then package; the archive's path."""
    import helm_python as helm

    version = check_versions()
    with tempfile.TemporaryDirectory(prefix="moonlease-release-") as work:
        staged = stage_chart(Path(work), registry)
        images = check_images(staged)
        report = helm.lint(staged, strict=True, namespace="moonlease")
        findings = report["errors"] + [m for m in report["messages"] if m["severity"] >= 2]  # warning, error
        if findings:
            raise Refusal(f"helm lint --strict: {findings}")
        built = build_images(targets) if targets else []
        out.mkdir(parents=True, exist_ok=True)
        try:
            sboms = [sbom.write_image_sbom(image, out) for image in built]
        except sbom.SbomError as error:
            raise Refusal(f"SBOM: {error}") from error
        archive = Path(helm.package(staged, destination=out))
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    (archive.parent / (archive.name + ".sha256")).write_text(f"{digest}  {archive.name}\n")
    print(f"{archive} (chart {version}; images: {', '.join(images)})")
    for image, written in zip(built, sboms):
        print(f"{written} (SBOM of {image}); push: podman push {image} {pushed_as(image, registry)}")
    unbuilt = sorted(set(images) - {pushed_as(image, registry) for image in built})
    if built and unbuilt:
        print(f"not built by this release (build and push them elsewhere): {', '.join(unbuilt)}")
    return archive


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--registry", default="",
                        help="registry (and path) holding the images, e.g. registry.example.com/ml; "
                             "becomes the packaged chart's global.imageRegistry")
    parser.add_argument("--out", type=Path, default=REPO / "dist",
                        help="where the chart archive and the SBOMs go (default dist/)")
    parser.add_argument("--images", nargs="+", default=list(DEFAULT_TARGETS), metavar="TARGET",
                        help="the Dockerfile targets to build with tools/images.sh, an SBOM each "
                             f"(default: {' '.join(DEFAULT_TARGETS)}; `connector` needs vLLM's CUDA image)")
    parser.add_argument("--skip-images", action="store_true",
                        help="a chart-only release: build no image, write no SBOM (the checks still run)")
    args = parser.parse_args(argv)
    try:
        release(args.out, args.registry or None, () if args.skip_images else args.images)
    except Refusal as refusal:
        sys.stderr.write(f"make release: refused: {refusal}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
