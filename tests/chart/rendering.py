"""Rendering the Helm chart offline (helm-python-sdk embeds Helm's Go SDK; no cluster, no helm
binary) and reading what it rendered: shared by the chart tests.

The values sets under `charts/moonlease/ci/` are the chart's examples and test matrix: the
defaults, no vLLM pods, an external master, an A/B pair, and a namespaced operator with RDMA.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART_DIR = REPO / "charts" / "moonlease"
CI_DIR = CHART_DIR / "ci"
RELEASE = "moonlease"
NAMESPACE = "inference"
KUBE_VERSION = "1.34.0"

JsonObj = dict[str, Any]
KUBERNETES_VALIDATE = Path(sys.executable).with_name("kubernetes-validate")


def kubernetes_validate_strict(objects: Sequence[Mapping[str, Any]], path: Path) -> str:
    """Write `objects` to `path` and run `kubernetes-validate --strict` against KUBE_VERSION's
    schemas; asserts it passes and returns its report."""
    path.write_text(yaml.safe_dump_all([dict(o) for o in objects]))
    result = subprocess.run([str(KUBERNETES_VALIDATE), "--strict", "-k", KUBE_VERSION, str(path)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def values_sets() -> dict[str, JsonObj]:
    """The ci/ values sets by short name (`default`, `ab`, ...)."""
    return {path.name.removesuffix("-values.yaml"): yaml.safe_load(path.read_text()) or {}
            for path in sorted(CI_DIR.glob("*-values.yaml"))}


def load_chart() -> helm.Chart:
    return helm.Chart.load(CHART_DIR)


def render(chart: helm.Chart, values: Mapping[str, Any] | None = None, *, name: str = RELEASE,
           namespace: str = NAMESPACE) -> dict[str, str]:
    """Template path -> rendered text, as `helm install --dry-run` would render it."""
    return chart.render(copy.deepcopy(dict(values or {})), name=name, namespace=namespace, is_install=True)


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses a key given twice in one mapping. PyYAML (like `helm lint`)
    keeps the last one silently, and so does the API server's apply: a template that renders
    two `env:` keys loses the first list without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _value in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_all_strict(text: str) -> list[Any]:
    """Every document of a YAML stream, refusing duplicate keys (see _UniqueKeyLoader)."""
    return list(yaml.load_all(text, Loader=_UniqueKeyLoader))


def manifests(rendered: Mapping[str, str]) -> list[JsonObj]:
    """Every object the rendering holds, in template order (NOTES.txt is not a manifest); a
    mapping with a key given twice fails (the apply would drop one silently)."""
    return [doc for path, text in rendered.items() if not path.endswith("NOTES.txt")
            for doc in load_all_strict(text) if doc]


def render_objects(chart: helm.Chart, values: Mapping[str, Any] | None = None, **kwargs: Any) -> list[JsonObj]:
    return manifests(render(chart, values, **kwargs))


def find(objects: list[JsonObj], kind: str, name: str | None = None) -> list[JsonObj]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects: list[JsonObj], kind: str, name: str) -> JsonObj:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}: " + \
        ", ".join(f"{o['kind']}/{o['metadata']['name']}" for o in objects)
    return found[0]


def pod_specs(objects: list[JsonObj]) -> Iterator[tuple[JsonObj, JsonObj]]:
    """(workload, pod spec) for every object that runs pods."""
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield obj, obj["spec"]["template"]["spec"]


def container(obj: JsonObj, name: str | None = None) -> JsonObj:
    containers = obj["spec"]["template"]["spec"]["containers"]
    return containers[0] if name is None else next(c for c in containers if c["name"] == name)


def option(args: list[str], name: str) -> str | None:
    """The value of `--name=value` or `--name value` in an argument list (the last one wins)."""
    found = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(name + "="):
            found = arg[len(name) + 1:]
    return found


def kv_transfer_config(obj: JsonObj) -> JsonObj:
    value = option(container(obj, "vllm")["args"], "--kv-transfer-config")
    assert value is not None, f"{obj['metadata']['name']} has no --kv-transfer-config"
    return json.loads(value)


def env(obj: JsonObj, container_name: str | None = None) -> dict[str, Any]:
    """Env var name -> value (or its valueFrom) of a container."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(obj, container_name).get("env", [])}


def crd() -> JsonObj:
    return yaml.safe_load((CHART_DIR / "crds" / "mooncakeleasepolicies.yaml").read_text())


def crd_schema() -> JsonObj:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
