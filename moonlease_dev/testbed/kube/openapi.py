"""OpenAPI documents built from what the local API server serves: `/openapi/v2` (Swagger 2.0,
one document, served as JSON or as protobuf: `openapi_protobuf`) and `/openapi/v3` (an index, then
one OpenAPI 3.0 document per group-version).

kubectl reads them to validate (`kubectl apply`: when the v3 document's PATCH operation of a
kind takes the `fieldValidation` parameter, kubectl leaves validation to the server), to choose
a patch (client-side `kubectl apply` sends a strategic merge patch when the kind's PATCH
`requestBody` lists `application/strategic-merge-patch+json`, a JSON merge patch otherwise) and to
explain (`kubectl explain mlp.spec`: the kind's schema, found by `x-kubernetes-group-version-kind`).

Schemas: a CRD's `openAPIV3Schema` for custom resources (with apiVersion, kind and metadata as
the API server adds them); for the built-in kinds the Kubernetes 1.32 API's own definitions
(`builtin_definitions`: kubernetes-validate's copy of them, with descriptions, required fields and
the `x-kubernetes-*` list and patch annotations), so `kubectl explain deployment.spec` works —
and, where kubernetes-validate is not installed (a demo-only install), an open object
(`x-kubernetes-preserve-unknown-fields`). Resource types in, documents out; the definitions are
read once from the installed package.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from moonlease_dev.testbed.kube.patches import PATCH_BODIES
from moonlease_dev.testbed.kube.resources import ResourceType

JsonObj = dict[str, Any]

#: Where the built-in kinds' definitions live in the real documents (by API group).
_BUILTIN_PACKAGES = {
    "": "io.k8s.api.core", "apps": "io.k8s.api.apps", "coordination.k8s.io": "io.k8s.api.coordination",
    "apiextensions.k8s.io": "io.k8s.apiextensions-apiserver.pkg.apis.apiextensions",
    "policy": "io.k8s.api.policy", "rbac.authorization.k8s.io": "io.k8s.api.rbac",
}

_QUERY_PARAMETERS = {
    "dryRun": "When present, indicates that modifications should not be persisted. Valid values: All.",
    "fieldManager": "A name associated with the actor or entity that is making these changes.",
    "fieldValidation": "How the server handles unknown or duplicate fields: Ignore, Warn or Strict.",
}


def definition_name(rtype: ResourceType) -> str:
    """`io.k8s.api.apps.v1.Deployment` for built-in kinds; the reversed group for custom ones
    (`io.moonlease.v1alpha1.MooncakeLeasePolicy`), as the API server names them."""
    if not rtype.custom and rtype.group in _BUILTIN_PACKAGES:
        return f"{_BUILTIN_PACKAGES[rtype.group]}.{rtype.version}.{rtype.kind}"
    return ".".join([*reversed(rtype.group.split(".")), rtype.version, rtype.kind])


def group_version_path(rtype: ResourceType) -> str:
    """The key of a group-version in the v3 index: `api/v1`, `apis/apps/v1`."""
    return f"apis/{rtype.group}/{rtype.version}" if rtype.group else f"api/{rtype.version}"


#: The Kubernetes release whose built-in definitions are published (the one `/version` names).
BUILTIN_SCHEMA_RELEASE = "v1.32.0"
#: How the JSON-schema copy spells the two string-or-number types the API documents as strings.
_STRING_FORMATS = {"io.k8s.apimachinery.pkg.util.intstr.IntOrString": "int-or-string",
                   "io.k8s.apimachinery.pkg.api.resource.Quantity": "quantity"}


@functools.cache
def builtin_definitions() -> Mapping[str, JsonObj]:
    """The built-in kinds' definitions by name (`io.k8s.api.apps.v1.Deployment`), in the
    JSON-schema form kubernetes-validate ships; empty when it is not installed."""
    try:
        import kubernetes_validate  # type: ignore[import-untyped]
    except ImportError:
        return {}
    path = (Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"{BUILTIN_SCHEMA_RELEASE}-local"
            / "_definitions.json")
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))["$defs"]


def _as_openapi(node: Any, ref_prefix: str, refs: set[str]) -> Any:
    """A JSON-schema node as OpenAPI writes it: one type (no `null`), no apiVersion/kind enums,
    refs under `ref_prefix` (collected in `refs`); in v3 a described reference is an `allOf`, as
    the API server writes it (kubectl explain then shows the field's own description)."""
    if isinstance(node, list):
        return [_as_openapi(item, ref_prefix, refs) for item in node]
    if not isinstance(node, Mapping):
        return node
    if "$ref" in node and len(node) > 1 and ref_prefix.startswith("#/components/"):
        siblings = {k: v for k, v in node.items() if k != "$ref"}
        return {"allOf": [_as_openapi({"$ref": node["$ref"]}, ref_prefix, refs)],
                **_as_openapi(siblings, ref_prefix, refs)}
    result: JsonObj = {}
    for key, value in node.items():
        if key == "properties" and isinstance(value, Mapping):  # field names, not keywords
            result[key] = {name: _as_openapi(sub, ref_prefix, refs) for name, sub in value.items()}
        elif key == "$ref":
            name = str(value).rsplit("/", 1)[-1]
            refs.add(name)
            result[key] = ref_prefix + name
        elif key == "type" and isinstance(value, list):
            result[key] = next((t for t in value if t != "null"), "object")
        elif key == "enum":
            continue
        else:
            result[key] = _as_openapi(value, ref_prefix, refs)
    return result


def prune_builtin(value: Any, root: str, path: str = "") -> tuple[Any, list[str]]:
    """`value` without the fields the built-in definition `root` does not declare, and their
    paths as the API server's strict decoding names them (`spec.template.spec.containers[0].imagePolicy`).
    Free-form objects (no declared properties) are kept whole."""
    definitions = builtin_definitions()

    def walk(value: Any, node: Mapping[str, Any], path: str, dropped: list[str]) -> Any:
        while "$ref" in node:
            node = definitions.get(str(node["$ref"]).rsplit("/", 1)[-1], {})
        if isinstance(value, Mapping):
            props = node.get("properties")
            if props is not None:
                kept = {}
                for key, sub in value.items():
                    if key in props:
                        kept[key] = walk(sub, props[key], f"{path}.{key}" if path else key, dropped)
                    else:
                        dropped.append(f"{path}.{key}" if path else key)
                return kept
            extra = node.get("additionalProperties")
            if isinstance(extra, Mapping):
                return {key: walk(sub, extra, f"{path}.{key}" if path else key, dropped) for key, sub in value.items()}
            return value
        if isinstance(value, list) and isinstance(node.get("items"), Mapping):
            return [walk(item, node["items"], f"{path}[{index}]", dropped) for index, item in enumerate(value)]
        return value

    if root not in definitions:
        return value, []
    dropped: list[str] = []
    return walk(value, definitions[root], path, dropped), dropped


def builtin_schemas(root: str, ref_prefix: str) -> dict[str, JsonObj]:
    """The definition `root` and every definition it refers to, as OpenAPI (empty when the
    definitions are not installed or do not have `root`); the same for every call (built once:
    every OpenAPI request of a client asks for them again)."""
    return dict(_builtin_schemas(root, ref_prefix))


@functools.cache
def _builtin_schemas(root: str, ref_prefix: str) -> Mapping[str, JsonObj]:
    definitions = builtin_definitions()
    if root not in definitions:
        return {}
    found: dict[str, JsonObj] = {}
    pending = [root]
    while pending:
        name = pending.pop()
        if name in found:
            continue
        if name in _STRING_FORMATS:
            found[name] = {"type": "string", "format": _STRING_FORMATS[name],
                           "description": definitions[name].get("description", "")}
            continue
        refs: set[str] = set()
        found[name] = _as_openapi(definitions[name], ref_prefix, refs)
        pending.extend(refs - found.keys())
    return found


def kind_schema(rtype: ResourceType, schema: Mapping[str, Any] | None) -> JsonObj:
    """A kind's schema as published: the CRD's (with apiVersion, kind and metadata declared, as
    the API server publishes them) or an open object; tagged with its group-version-kind."""
    gvk = [{"group": rtype.group, "version": rtype.version, "kind": rtype.kind}]
    if schema is None:
        return {"type": "object", "description": f"{rtype.kind} (schema not held by the local API server).",
                "x-kubernetes-preserve-unknown-fields": True, "x-kubernetes-group-version-kind": gvk}
    published = copy.deepcopy(dict(schema))
    properties = published.setdefault("properties", {})
    properties.setdefault("apiVersion", {
        "type": "string", "description": "APIVersion defines the versioned schema of this representation."})
    properties.setdefault("kind", {"type": "string", "description": "Kind is the type of this object."})
    properties["metadata"] = {"type": "object", "description": "Standard object's metadata.",
                              "x-kubernetes-preserve-unknown-fields": True}
    published["x-kubernetes-group-version-kind"] = gvk
    return published


def _schemas_of(rtype: ResourceType, schema: Mapping[str, Any] | None, name: str, ref_prefix: str) -> dict[str, JsonObj]:
    """The kind's definition and those it refers to: a built-in kind's own, else `kind_schema`'s."""
    if not rtype.custom:
        found = builtin_schemas(name, ref_prefix)
        if found:
            return found
    return {name: kind_schema(rtype, schema)}


#: The PATCH body's definition, as the API server names it (its request bodies refer to it).
PATCH_DEFINITION = "io.k8s.apimachinery.pkg.apis.meta.v1.Patch"
_PATCH_SCHEMA: JsonObj = {
    "type": "object", "description": "Patch is provided to give a concrete name and type to the Kubernetes PATCH"
                                     " request body."}


def patch_media_types(rtype: ResourceType) -> list[str]:
    """The PATCH bodies a kind accepts, as its PATCH operation lists them: strategic merge only
    for built-in kinds (the server refuses it for custom resources, and kubectl apply reads this
    list to choose between a strategic and a JSON merge patch)."""
    return [media for media, kind in PATCH_BODIES.items() if not (rtype.custom and kind == "strategic")]


def _operations(rtype: ResourceType, name: str, *, v3: bool) -> dict[str, JsonObj]:
    """The object and collection paths of a kind with their write operations, each tagged with
    the kind, taking dryRun, fieldManager and fieldValidation (what kubectl checks for) and
    naming the bodies it accepts (v3 `requestBody`, v2 `consumes`)."""
    ref = f"#/components/schemas/{name}" if v3 else f"#/definitions/{name}"
    patch_ref = f"#/components/schemas/{PATCH_DEFINITION}" if v3 else f"#/definitions/{PATCH_DEFINITION}"
    gvk = {"group": rtype.group, "version": rtype.version, "kind": rtype.kind}

    def parameter(key: str) -> JsonObj:
        described = {"name": key, "in": "query", "description": _QUERY_PARAMETERS[key], "uniqueItems": True}
        return {**described, "schema": {"type": "string"}} if v3 else {**described, "type": "string"}

    def operation(action: str, verb: str) -> JsonObj:
        response: JsonObj = {"description": "OK"}
        if v3:
            response["content"] = {"application/json": {"schema": {"$ref": ref}}}
        else:
            response["schema"] = {"$ref": ref}
        accepted = patch_media_types(rtype) if action == "patch" else ["*/*"]
        body_ref = patch_ref if action == "patch" else ref
        described: JsonObj = {"operationId": f"{verb}{rtype.kind}", "x-kubernetes-action": action,
                              "x-kubernetes-group-version-kind": gvk,
                              "parameters": [parameter(key) for key in _QUERY_PARAMETERS],
                              "responses": {"200": response}}
        if action == "delete":
            return described
        if v3:
            described["requestBody"] = {"content": {media: {"schema": {"$ref": body_ref}} for media in accepted},
                                        "required": True}
        else:
            described["consumes"] = accepted
        return described

    base = "/" + group_version_path(rtype) + ("/namespaces/{namespace}" if rtype.namespaced else "")
    return {
        f"{base}/{rtype.plural}": {"post": operation("post", "create")},
        f"{base}/{rtype.plural}/{{name}}": {"put": operation("put", "replace"), "patch": operation("patch", "patch"),
                                          "delete": operation("delete", "delete")},
    }


#: Keywords a CRD's schema may hold that Swagger 2.0 has not (published in v3 only).
_V3_ONLY = frozenset({"allOf", "oneOf", "anyOf", "not", "nullable", "id", "$schema", "patternProperties",
                      "dependencies", "additionalItems", "definitions"})


def as_swagger2(node: Any) -> Any:
    """A custom kind's schema as the API server publishes it in v2 (apiextensions'
    `ToStructuralOpenAPIV2`): no junctors or other v3-only keywords; a nullable field untyped
    (no type, items or properties) and not required; a field that keeps unknown fields without
    items or properties; an array left without items untyped."""
    if isinstance(node, list):
        return [as_swagger2(item) for item in node]
    if not isinstance(node, Mapping):
        return node
    result: JsonObj = {}
    for key, value in node.items():
        if key in _V3_ONLY:
            continue
        if key == "properties" and isinstance(value, Mapping):
            result[key] = {name: as_swagger2(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties"):
            result[key] = as_swagger2(value)
        else:
            result[key] = value  # values (default, enum, vendor extensions) are data, not schemas
    if node.get("nullable") or node.get("x-kubernetes-preserve-unknown-fields"):
        result.pop("items", None)
        result.pop("properties", None)
    if node.get("nullable") or (result.get("type") == "array" and "items" not in result):
        result.pop("type", None)
    nullable = {name for name, sub in (node.get("properties") or {}).items()
                if isinstance(sub, Mapping) and sub.get("nullable")}
    extra = node.get("additionalProperties")
    if isinstance(extra, Mapping) and extra.get("nullable"):
        result.pop("required", None)
    elif nullable and "required" in result:
        result["required"] = [name for name in result["required"] if name not in nullable]
        if not result["required"]:
            del result["required"]
    return result


def openapi_v2(types: Iterable[tuple[ResourceType, Mapping[str, Any] | None]]) -> JsonObj:
    """The Swagger 2.0 document of every served kind (custom kinds' schemas `as_swagger2`)."""
    definitions: JsonObj = {}
    paths: JsonObj = {}
    for rtype, schema in types:
        name = definition_name(rtype)
        found = _schemas_of(rtype, schema, name, "#/definitions/")
        definitions.update({key: as_swagger2(value) for key, value in found.items()} if rtype.custom else found)
        paths.update(_operations(rtype, name, v3=False))
    if paths:
        definitions[PATCH_DEFINITION] = dict(_PATCH_SCHEMA)
    return {"swagger": "2.0", "info": {"title": "Kubernetes", "version": "v1.32.0"}, "paths": paths,
            "definitions": definitions}


def openapi_v3(types: Iterable[tuple[ResourceType, Mapping[str, Any] | None]]) -> dict[str, JsonObj]:
    """One OpenAPI 3.0 document per group-version path (`apis/apps/v1`)."""
    documents: dict[str, JsonObj] = {}
    for rtype, schema in types:
        name = definition_name(rtype)
        document = documents.setdefault(group_version_path(rtype), {
            "openapi": "3.0.0", "info": {"title": "Kubernetes", "version": "v1.32.0"}, "paths": {},
            "components": {"schemas": {}}})
        document["components"]["schemas"].update(_schemas_of(rtype, schema, name, "#/components/schemas/"))
        document["paths"].update(_operations(rtype, name, v3=True))
        document["components"]["schemas"].setdefault(PATCH_DEFINITION, dict(_PATCH_SCHEMA))
    return documents


def document_hash(document: Mapping[str, Any]) -> str:
    """What the v3 index appends to each document's URL (`?hash=`), so clients cache by content."""
    return hashlib.sha512(json.dumps(document, sort_keys=True).encode()).hexdigest()[:64].upper()


def openapi_v3_index(documents: Mapping[str, Mapping[str, Any]]) -> JsonObj:
    """`/openapi/v3`: where each group-version's document is."""
    return {"paths": {path: {"serverRelativeURL": f"/openapi/v3/{path}?hash={document_hash(doc)}"}
                      for path, doc in sorted(documents.items())}}
