"""A CRD's structural schema applied to custom resources: defaulting, pruning, validation.
Pure functions (the API server's admission of custom resources, CEL rules left out)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import jsonschema

def apply_schema_defaults(obj: Any, schema: Mapping[str, Any]) -> Any:
    """Fill `default`s the way the API server does: absent fields get the default, then nested
    defaults apply inside it. Returns a new value."""
    if isinstance(obj, Mapping):
        result = dict(obj)
        for name, sub in schema.get("properties", {}).items():
            if name not in result and "default" in sub:
                result[name] = copy.deepcopy(sub["default"])
            if name in result:
                result[name] = apply_schema_defaults(result[name], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, Mapping):
            for name in result:
                if name not in schema.get("properties", {}):
                    result[name] = apply_schema_defaults(result[name], extra)
        return result
    if isinstance(obj, list) and isinstance(schema.get("items"), Mapping):
        return [apply_schema_defaults(item, schema["items"]) for item in obj]
    return obj


def prune_unknown_fields(obj: Any, schema: Mapping[str, Any], path: str = "") -> tuple[Any, list[str]]:
    """Drop fields the structural schema does not declare; returns the value and what was dropped."""
    dropped: list[str] = []
    if isinstance(obj, Mapping) and schema.get("type") == "object":
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return copy.deepcopy(dict(obj)), dropped
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        result: dict[str, Any] = {}
        for name, value in obj.items():
            sub_schema = (props or {}).get(name, extra if isinstance(extra, Mapping) else None)
            if value is None and isinstance(sub_schema, Mapping) and not sub_schema.get("nullable"):
                continue  # nulls of non-nullable fields are pruned (then defaulted), as the API does
            if props is not None and name in props:
                result[name], sub = prune_unknown_fields(value, props[name], f"{path}.{name}")
            elif isinstance(extra, Mapping):
                result[name], sub = prune_unknown_fields(value, extra, f"{path}.{name}")
            elif props is None and extra is None:
                result[name], sub = copy.deepcopy(value), []  # a free-form object (e.g. metadata)
            else:
                dropped.append(f"{path}.{name}".lstrip("."))
                continue
            dropped.extend(sub)
        return result, dropped
    if isinstance(obj, list) and isinstance(schema.get("items"), Mapping):
        items = [prune_unknown_fields(item, schema["items"], f"{path}[{i}]") for i, item in enumerate(obj)]
        return [value for value, _ in items], [d for _, sub in items for d in sub]
    return copy.deepcopy(obj), dropped


def schema_errors(obj: Any, schema: Mapping[str, Any]) -> list[str]:
    """Violations of an OpenAPI v3 (structural) schema, as `path: message` lines.

    OpenAPI 3.0's boolean exclusiveMinimum/Maximum is draft-4 syntax, hence Draft4Validator.
    """
    validator = jsonschema.Draft4Validator(schema)
    lines = []
    for err in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path))):
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err.absolute_path).lstrip(".")
        lines.append(f"{where or '<root>'}: {err.message}")
    return lines

