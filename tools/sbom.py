"""CycloneDX SBOMs of the images `make release` builds (tools/release.py), one JSON file per image.

    python tools/sbom.py localhost/moonlease/operator:0.1.0 --out dist

What an SBOM lists, read from the image itself (podman mounts it; nothing runs but the image's
own Python, once, to say its `sys.path`):

* every Python distribution on that path: cyclonedx-py (cyclonedx-bom from PyPI, installed by
  `make setup` into .venv-sbom) run against the image's environment: the interpreter it is
  given is a stand-in that answers the image's `sys.path`, mapped into the mounted image;
* every Debian package the image's dpkg database holds (the base, the libraries Mooncake links),
  as `pkg:deb/debian/<name>@<version>?arch=<arch>`;
* the image as the SBOM's subject (`metadata.component`, type `container`).

The result is validated against the CycloneDX 1.6 JSON schema before it is written.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

REPO = Path(__file__).resolve().parents[1]
SBOM_VENV = REPO / ".venv-sbom"
SPEC_VERSION = "1.6"
#: Asks an interpreter for its module search path, as cyclonedx-py itself does.
SYS_PATH_PROBE = "import json, sys; print(json.dumps(sys.path))"


class SbomError(Exception):
    """An SBOM could not be made, said in one line."""


def cyclonedx_py() -> Path:
    tool = SBOM_VENV / "bin" / "cyclonedx-py"
    if not tool.exists():
        raise SbomError(f"{tool} is missing: run `make setup` (it installs requirements/sbom.txt there)")
    return tool


def python_components(sys_path: Sequence[str], root: Path = Path("/")) -> dict[str, Any]:
    """cyclonedx-py's SBOM (a dict) of the distributions on `sys_path`, a module search path of
    the environment whose file system is mounted at `root`.

    cyclonedx-py learns the path by running the interpreter it is given; the one it is given here
    prints the path, mapped under `root`, whatever it is asked (the image's Python may not run on
    this machine, and need not)."""
    mapped = [str(root / entry.lstrip("/")) for entry in sys_path if entry.startswith("/")]
    with tempfile.TemporaryDirectory(prefix="moonlease-sbom-") as work:
        interpreter = Path(work) / "python"
        interpreter.write_text(f"#!/bin/sh\ncat <<'EOF'\n{json.dumps(mapped)}\nEOF\n")
        interpreter.chmod(interpreter.stat().st_mode | stat.S_IXUSR)
        output = Path(work) / "python.cdx.json"
        result = subprocess.run([str(cyclonedx_py()), "environment", "--sv", SPEC_VERSION, "--of", "JSON", "--no-validate",
                                 "-o", str(output), str(interpreter)], capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise SbomError(f"cyclonedx-py failed ({result.returncode}): {result.stderr.strip()[-2000:]}")
        sbom: dict[str, Any] = json.loads(output.read_text())
    return sbom


def debian_packages(status: str) -> list[dict[str, str]]:
    """The installed packages of a dpkg status database (its text): name, version, architecture."""
    packages = []
    for stanza in re.split(r"\n\s*\n", status):
        fields = dict(re.findall(r"^([A-Za-z-]+): ?(.*)$", stanza, re.MULTILINE))
        if fields.get("Package") and fields.get("Status", "").endswith(" installed"):
            packages.append({"name": fields["Package"], "version": fields.get("Version", ""),
                             "arch": fields.get("Architecture", "")})
    return sorted(packages, key=lambda p: (p["name"], p["arch"]))


def debian_component(package: dict[str, str]) -> dict[str, Any]:
    purl = f"pkg:deb/debian/{quote(package['name'])}@{quote(package['version'], safe='')}"
    if package["arch"]:
        purl += f"?arch={package['arch']}"
    return {"type": "library", "bom-ref": purl, "name": package["name"], "version": package["version"],
            "purl": purl}


def with_image(sbom: dict[str, Any], image: str, image_id: str, debian: list[dict[str, str]]) -> dict[str, Any]:
    """The Python SBOM made the image's: the image as its subject, its Debian packages added."""
    name, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "latest")
    subject = {"type": "container", "bom-ref": image, "name": name, "version": tag,
               "properties": [{"name": "moonlease:image-id", "value": image_id}]}
    sbom.setdefault("metadata", {})["component"] = subject
    components = sbom.setdefault("components", [])
    deb = [debian_component(p) for p in debian]
    components.extend(deb)
    dependencies = sbom.setdefault("dependencies", [])
    dependencies.extend({"ref": c["bom-ref"]} for c in deb)
    # The image depends on everything it holds.
    dependencies.append({"ref": image, "dependsOn": [c["bom-ref"] for c in components]})
    return sbom


def validate(path: Path) -> None:
    """Refuse an SBOM that is not valid CycloneDX (cyclonedx-python-lib's strict JSON schema)."""
    check = ("import sys\n"
             "from cyclonedx.schema import SchemaVersion\n"
             "from cyclonedx.validation.json import JsonStrictValidator\n"
             f"error = JsonStrictValidator(SchemaVersion.V{SPEC_VERSION.replace('.', '_')})"
             ".validate_str(open(sys.argv[1]).read())\n"
             "sys.exit(str(error) if error else 0)\n")
    result = subprocess.run([str(SBOM_VENV / "bin" / "python"), "-c", check, str(path)], capture_output=True,
                            text=True, timeout=120)
    if result.returncode != 0:
        raise SbomError(f"{path} is not valid CycloneDX {SPEC_VERSION}: {result.stderr.strip()[-2000:]}")


def podman(*args: str, timeout: float = 300) -> str:
    result = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise SbomError(f"podman {' '.join(args[:2])} failed: {result.stderr.strip()[-1000:]}")
    return result.stdout.strip()


@contextmanager
def mounted(image: str) -> Iterator[Path]:
    """The image's file system, read from podman's storage (rootful podman)."""
    root = Path(podman("image", "mount", image))
    try:
        yield root
    finally:
        podman("image", "unmount", image)


def image_sbom(image: str) -> dict[str, Any]:
    """The SBOM of a local image: its Python distributions (on the path of the `python3` its
    PATH finds) and its Debian packages."""
    image_id = podman("image", "inspect", "--format", "{{.Id}}", image)
    sys_path = json.loads(podman("run", "--rm", "--read-only", "--network", "none", "--entrypoint", "python3",
                                 image, "-c", SYS_PATH_PROBE))
    with mounted(image) as root:
        sbom = python_components(sys_path, root)
        status = root / "var" / "lib" / "dpkg" / "status"
        debian = debian_packages(status.read_text()) if status.exists() else []
    return with_image(sbom, image, image_id, debian)


def sbom_file_name(image: str) -> str:
    """`localhost/moonlease/vllm-connector:0.1.0-vllm-cpu0.32.0` -> `vllm-connector-0.1.0-vllm-cpu0.32.0.cdx.json`."""
    repository, _, tag = image.rsplit("/", 1)[-1].partition(":")
    return f"{repository}-{tag or 'latest'}.cdx.json"


def write_sbom(sbom: dict[str, Any], path: Path) -> Path:
    """Write `sbom` to `path` after validating it (nothing is left behind when it is invalid)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(sbom, indent=2) + "\n")
    try:
        validate(partial)
    except SbomError:
        partial.unlink()
        raise
    os.replace(partial, path)
    return path


def write_image_sbom(image: str, out: Path) -> Path:
    """The SBOM of a local image, written into `out` under its file name."""
    return write_sbom(image_sbom(image), out / sbom_file_name(image))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("images", nargs="+", help="local images (podman's names)")
    parser.add_argument("--out", type=Path, default=REPO / "dist", help="where the SBOMs go (default dist/)")
    args = parser.parse_args(argv)
    for image in args.images:
        try:
            print(write_image_sbom(image, args.out))
        except SbomError as error:
            sys.exit(f"sbom: {image}: {error}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
