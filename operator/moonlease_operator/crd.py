"""The MooncakeLeasePolicy CustomResourceDefinition, generated from the pydantic models.

Pure. Kubernetes requires a *structural* schema: every node typed, no
`$ref`, no `anyOf` with null, `exclusiveMinimum` as a boolean (OpenAPI 3.0). `build_crd` turns
pydantic's JSON Schema into that; `crds/mooncakeleasepolicies.yaml` is its committed output
(a unit test fails when the file is stale).
"""

from __future__ import annotations

import copy
from typing import Any

import yaml
from pydantic import BaseModel

from moonlease_operator.api import policy, status

CRD_NAME = f"{policy.PLURAL}.{policy.GROUP}"

#: `kubectl get mlp` columns. The Ready column reads the Ready condition's status.
PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Mode", "type": "string", "jsonPath": ".spec.connector.leaseMode",
     "description": "Connector lease mode"},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Policy phase"},
    {"name": "Stage", "type": "string", "jsonPath": ".status.currentStage",
     "description": "Rollout stage in progress"},
    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
     "description": "Ready condition"},
    {"name": "A/B", "type": "string", "jsonPath": ".status.abTest.phase",
     "description": "A/B test phase (strategy ABTest)"},
    {"name": "Verdict", "type": "string", "jsonPath": ".status.abTest.finalVerdict",
     "description": "A/B test verdict, once final (empty while measuring)"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {"name": "Samples", "type": "string", "jsonPath": ".status.abTest.progress", "priority": 1,
     "description": "A/B intervals measured / maxSamples"},
    {"name": "Reason", "type": "string", "jsonPath": ".status.abTest.reason", "priority": 1,
     "description": "Why the A/B test stands where it does"},
]



def build_crd() -> dict[str, Any]:
    """The apiextensions.k8s.io/v1 CustomResourceDefinition for MooncakeLeasePolicy."""
    root = {
        "type": "object",
        "description": "MooncakeLeasePolicy declares how Mooncake store leases are taken across a"
        " Mooncake master and the vLLM workloads using it, and how changes are rolled out.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": build_schema(policy.PolicySpec),
            "status": build_schema(status.PolicyStatus),
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "labels": {"app.kubernetes.io/part-of": "moonlease"},
        },
        "spec": {
            "group": policy.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": policy.KIND,
                "listKind": f"{policy.KIND}List",
                "plural": policy.PLURAL,
                "singular": policy.SINGULAR,
                "shortNames": list(policy.SHORT_NAMES),
                "categories": list(policy.CATEGORIES),
            },
            "versions": [
                {
                    "name": policy.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": root},
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": copy.deepcopy(PRINTER_COLUMNS),
                }
            ],
        },
    }


def build_schema(model: type[BaseModel]) -> dict[str, Any]:
    """A model's structural OpenAPI v3 schema: `$ref`s inlined, optionals un-nulled."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _structural(raw, defs)


def _structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    node = dict(node)
    # A reference or an optional (`X | None`) becomes X, keeping the siblings pydantic put next
    # to it (the field's description, default and x-kubernetes-* keys win over the target's).
    if "$ref" in node:
        target = defs[node.pop("$ref").rsplit("/", 1)[-1]]
        node = {**_structural(target, defs), **node}
    for combinator in ("anyOf", "allOf", "oneOf"):
        if combinator in node:
            branches = [b for b in node.pop(combinator) if b.get("type") != "null"]
            if len(branches) != 1:
                raise ValueError(f"not expressible as a structural schema: {combinator} {branches}")
            node = {**_structural(branches[0], defs), **node}

    out: dict[str, Any] = {}
    for key, value in sorted(node.items(), key=_key_order):
        if key == "title" or (key == "default" and value is None):
            continue
        if key == "additionalProperties" and value is False:
            continue  # the API server prunes unknown fields; `false` is not structural
        if key == "description":
            out[key] = _one_paragraph(value)
        elif key == "properties":
            out[key] = {name: _structural(sub, defs) for name, sub in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _structural(value, defs)
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            # JSON Schema 2020-12 `exclusiveMinimum: 0` is OpenAPI 3.0 `minimum: 0` + flag.
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        else:
            out[key] = copy.deepcopy(value)
    return out


def _key_order(item: tuple[str, Any]) -> tuple[int, str]:
    """Description and type first, then the rest alphabetically: a stable, readable YAML."""
    return ({"description": 0, "type": 1}.get(item[0], 2), item[0])


def _one_paragraph(text: str) -> str:
    return " ".join(text.split())


#: Plain scalars YAML 1.1 reads as booleans that PyYAML writes unquoted. Go's YAML (Helm's and
#: kubectl's reader) follows YAML 1.1: an unquoted key `n` became the property `false`, so a
#: CRD installed by `helm install` lost the status fields named `n` (the A/B analysis' counts).
_YAML11_BOOLEANS = frozenset({"y", "Y", "n", "N"})


class _GoSafeDumper(yaml.SafeDumper):
    """`yaml.SafeDumper` that also quotes the strings Go's YAML 1.1 reader takes for booleans."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    if value in _YAML11_BOOLEANS:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="'")
    return dumper.represent_str(value)


_GoSafeDumper.add_representer(str, _represent_str)


def render_crd_yaml() -> str:
    """The CRD as the YAML committed under crds/ (`make crds`, `moonlease crd`): `yaml.safe_dump`
    in the models' key order, with the strings YAML 1.1 reads as booleans quoted (`'n'`), so
    that every YAML reader, Go's included, reads the same CRD."""
    return yaml.dump(build_crd(), Dumper=_GoSafeDumper, sort_keys=False)


def validation_schema(crd: dict[str, Any], *, strict: bool = True) -> dict[str, Any]:
    """The CRD's openAPIV3Schema as a jsonschema (draft 4) document, for offline validation.

    OpenAPI 3.0's boolean `exclusiveMinimum` is draft-4 syntax, so `Draft4Validator` applies as is.
    With `strict`, objects with declared properties refuse unknown keys, as kubectl's default
    strict field validation does (the API server would otherwise prune them). CEL rules are not
    evaluated here: the models mirror them (see `api.common.CelRule`).
    """
    schema = copy.deepcopy(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    if strict:
        _forbid_unknown(schema)
    return schema


def _forbid_unknown(node: dict[str, Any]) -> None:
    if "properties" in node and "additionalProperties" not in node \
            and not node.get("x-kubernetes-preserve-unknown-fields"):
        node["additionalProperties"] = False
    for sub in node.get("properties", {}).values():
        _forbid_unknown(sub)
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            _forbid_unknown(node[key])
