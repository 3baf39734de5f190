"""OpenAPI documents built from what the local API server serves: `/openapi/v2` (Swagger 2.0,
one document) and `/openapi/v3` (an index, then one OpenAPI 3.0 document per group-version).

kubectl reads them to validate (`kubectl apply`: when the v3 document's PATCH operation of a
kind takes the `fieldValidation` parameter, kubectl leaves validation to the server) and to
explain (`kubectl explain mlp.spec`: the kind's schema, found by `x-kubernetes-group-version-kind`).

Schemas: a CRD's `openAPIV3Schema` for custom resources (with apiVersion, kind and metadata as
the API server adds them); an open object (`x-kubernetes-preserve-unknown-fields`) for the
built-in kinds, whose schemas this server does not hold. Pure: resource types in, documents out.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

from moonlease_dev.testbed.kube.resources import ResourceType

JsonObj = dict[str, Any]

#: Where the built-in kinds' definitions live in the real documents (by API group).
_BUILTIN_PACKAGES = {
    "": "io.k8s.api.core", "apps": "io.k8s.api.apps", "coordination.k8s.io": "io.k8s.api.coordination",
    "apiextensions.k8s.io": "io.k8s.apiextensions-apiserver.pkg.apis.apiextensions",
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


def _operations(rtype: ResourceType, name: str, *, v3: bool) -> dict[str, JsonObj]:
    """The object and collection paths of a kind with their write operations, each tagged with
    the kind and taking dryRun, fieldManager and fieldValidation (what kubectl checks for)."""
    ref = f"#/components/schemas/{name}" if v3 else f"#/definitions/{name}"
    gvk = {"group": rtype.group, "version": rtype.version, "kind": rtype.kind}

    def parameter(key: str) -> JsonObj:
        described = {"name": key, "in": "query", "description": _QUERY_PARAMETERS[key], "uniqueItems": True}
        return {**described, "schema": {"type": "string"}} if v3 else {**described, "type": "string"}

    def operation(action: str, verb: str) -> JsonObj:
        response = {"description": "OK"}
        if v3:
            response["content"] = {"application/json": {"schema": {"$ref": ref}}}
        else:
            response["schema"] = {"$ref": ref}
        return {"operationId": f"{verb}{rtype.kind}", "x-kubernetes-action": action,
                "x-kubernetes-group-version-kind": gvk,
                "parameters": [parameter(key) for key in _QUERY_PARAMETERS], "responses": {"200": response}}

    base = "/" + group_version_path(rtype) + ("/namespaces/{namespace}" if rtype.namespaced else "")
    return {
        f"{base}/{rtype.plural}": {"post": operation("post", "create")},
        f"{base}/{rtype.plural}/{{name}}": {"put": operation("put", "replace"), "patch": operation("patch", "patch"),
                                          "delete": operation("delete", "delete")},
    }


def openapi_v2(types: Iterable[tuple[ResourceType, Mapping[str, Any] | None]]) -> JsonObj:
    """The Swagger 2.0 document of every served kind."""
    definitions: JsonObj = {}
    paths: JsonObj = {}
    for rtype, schema in types:
        name = definition_name(rtype)
        definitions[name] = kind_schema(rtype, schema)
        paths.update(_operations(rtype, name, v3=False))
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
        document["components"]["schemas"][name] = kind_schema(rtype, schema)
        document["paths"].update(_operations(rtype, name, v3=True))
    return documents


def document_hash(document: Mapping[str, Any]) -> str:
    """What the v3 index appends to each document's URL (`?hash=`), so clients cache by content."""
    return hashlib.sha512(json.dumps(document, sort_keys=True).encode()).hexdigest()[:64].upper()


def openapi_v3_index(documents: Mapping[str, Mapping[str, Any]]) -> JsonObj:
    """`/openapi/v3`: where each group-version's document is."""
    return {"paths": {path: {"serverRelativeURL": f"/openapi/v3/{path}?hash={document_hash(doc)}"}
                      for path, doc in sorted(documents.items())}}
