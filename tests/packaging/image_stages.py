"""Replaying the Dockerfile's stages on this machine (no Docker engine): see
tests/chart/dockerfile.py for what is replayed and what is not.

Every image path the stages use is mapped under one temporary folder; the base images'
interpreter is a clean virtualenv of this machine's Python 3.11 (the base images' Python is
3.11.7, the same as this machine's).
"""

from __future__ import annotations

import sys
import venv
from pathlib import Path

from tests.chart.dockerfile import Dockerfile, StageRunner, parse
from tests.chart.rendering import REPO

#: Every absolute path of the image that the stages write or read, relative to the temp root.
IMAGE_PATHS = {
    "/src": "src",
    "/wheels": "wheels",
    "/opt/moonlease": "opt/moonlease",
    "/opt/mooncake": "opt/mooncake",
    "/build": "build",
    "/home/vllm": "home/vllm",
    "/tmp": "tmp",
}


def clean_python(root: Path, name: str) -> Path:
    """A fresh virtualenv standing for a base image's interpreter; returns its python."""
    target = root / "base-images" / name
    venv.EnvBuilder(with_pip=True, clear=True).create(target)
    return target / "bin" / "python"


def runner(root: Path, *, python: Path, python3: Path | None = None) -> StageRunner:
    paths = {image: root / local for image, local in IMAGE_PATHS.items()}
    paths["/constraints/lock.txt"] = REPO / "requirements" / "lock.txt"
    for local in paths.values():
        if local.suffix != ".txt":
            local.mkdir(parents=True, exist_ok=True)
    return StageRunner(parse(), root, paths=paths,
                       interpreters={"python": python, "python3": python3 or python})


def build_wheel(root: Path) -> tuple[StageRunner, Path]:
    """Replay the `wheel` stage; returns the runner and the `moonlease` wheel it built (the
    stage builds exactly it, the `moonlease-connector` wheel and the `moonlease-settings` one)."""
    stages = runner(root, python=clean_python(root, "python-slim"))
    stages.run_stage("wheel")
    version = dockerfile().stages["operator-venv"].args(dockerfile().global_args)["MOONLEASE_VERSION"]
    built = sorted(p.name for p in (root / "wheels").iterdir())
    assert built == [f"moonlease-{version}-py3-none-any.whl", f"moonlease_connector-{version}-py3-none-any.whl",
                     f"moonlease_settings-{version}-py3-none-any.whl"], built
    return stages, root / "wheels" / built[0]


def dockerfile() -> Dockerfile:
    return parse()


def this_python_is_the_base_images() -> bool:
    """The base images' Python (python:3.11.7-*) is this interpreter's version."""
    image = dockerfile().global_args["PYTHON_IMAGE"]
    return image.split(":")[1].startswith(".".join(map(str, sys.version_info[:3])) + "-")
