"""Each product image holds its own component and no development code: neither the operator
image nor the connector image can import the development package (test bed, benchmarks, demo)
or the libraries only it uses; the connector image holds the connector alone (no command line,
no operator, no kopf); the operator image holds no connector, vLLM, torch or Mooncake; both hold
the connector's settings contract (`moonlease_settings`); and the operator image's `moonlease
demo` says where that command comes from instead."""

from __future__ import annotations

import json

import pytest

from tests.images.conftest import Images
from tests.images.podman import podman

pytestmark = pytest.mark.images

DEVELOPMENT_ONLY = ("moonlease_dev", "kmock", "helm_python", "matplotlib", "pytest", "celpy")
#: What each image must not hold besides the development code: the other component's code and libraries.
OTHER_COMPONENT = {
    "operator": ("moonlease_connector", "vllm", "torch", "mooncake"),
    "connector-cpu": ("moonlease", "moonlease_operator", "kopf"),
}
#: What each image's component is (it must import).
OWN = {
    "operator": "import moonlease.cli, moonlease_operator.handlers, moonlease_settings.config",
    "connector-cpu": "import moonlease_connector.adapters.vllm_connector",
}


def _found(image: str, python: str, modules: tuple[str, ...]) -> list[str]:
    probe = ("import importlib.util, json; "
             f"print(json.dumps([m for m in {modules!r} if importlib.util.find_spec(m)]))")
    return list(json.loads(podman("run", "--rm", "--read-only", "--entrypoint", python, image, "-c", probe).stdout))


@pytest.mark.parametrize(("target", "python"), [("operator", "python"), ("connector-cpu", "python3")])
def test_each_image_holds_its_component_only(images: Images, target: str, python: str) -> None:
    assert _found(images[target], python, DEVELOPMENT_ONLY) == [], target
    assert _found(images[target], python, OTHER_COMPONENT[target]) == [], target
    # The component itself is there, and the probes above can see an installed package.
    podman("run", "--rm", "--read-only", "--entrypoint", python, images[target], "-c", OWN[target])
    assert _found(images[target], python, ("moonlease_settings",)) == ["moonlease_settings"]


def test_the_connector_image_has_no_moonlease_command(images: Images) -> None:
    found = podman("run", "--rm", "--read-only", "--entrypoint", "sh", images["connector-cpu"], "-c",
                   "for c in moonlease kubectl-moonlease vllm; do command -v $c; done", check=False).stdout.split()
    assert [path.rsplit("/", 1)[1] for path in found] == ["vllm"], found


def test_the_operator_image_has_no_development_commands(images: Images) -> None:
    result = podman("run", "--rm", "--read-only", images["operator"], "demo", check=False)
    assert result.returncode == 2 and "development command" in result.stderr, (result.stdout, result.stderr)
