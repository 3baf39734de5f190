"""Each product image holds its own component and no development code: neither the operator
image nor the connector image can import the development package (test bed, benchmarks, demo)
or the libraries only it uses, and the operator image's `moonlease demo` says where that
command comes from instead."""

from __future__ import annotations

import json

import pytest

from tests.images.conftest import Images
from tests.images.podman import podman

pytestmark = pytest.mark.images

DEVELOPMENT_ONLY = ("moonlease_dev", "kmock", "helm_python", "matplotlib", "pytest", "celpy")
PROBE = ("import importlib.util, json; "
         f"print(json.dumps([m for m in {DEVELOPMENT_ONLY!r} if importlib.util.find_spec(m)]))")


@pytest.mark.parametrize(("target", "python"), [("operator", "python"), ("connector-cpu", "python3")])
def test_no_development_code_in_the_image(images: Images, target: str, python: str) -> None:
    found = podman("run", "--rm", "--read-only", "--entrypoint", python, images[target], "-c", PROBE).stdout
    assert json.loads(found) == [], (target, found)
    # The product itself is there.
    podman("run", "--rm", "--read-only", "--entrypoint", python, images[target], "-c",
           "import moonlease.cli, moonlease_connector.config")


def test_the_operator_image_has_no_development_commands(images: Images) -> None:
    result = podman("run", "--rm", "--read-only", images["operator"], "demo", check=False)
    assert result.returncode == 2 and "development command" in result.stderr, (result.stdout, result.stderr)
