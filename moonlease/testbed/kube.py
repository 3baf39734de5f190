"""A local Kubernetes API server for tests and the demo: kmock's emulator, made strict enough that
kopf runs against it for real, plus a simulator that plays the Deployment/StatefulSet controller.

Not pure: it serves HTTP on 127.0.0.1 from the caller's event loop. Callers are the pytest
fixtures (`tests/fixtures/kube.py`) and `moonlease demo`. Outside pytest::

    async with local_api_server() as kube:                 # CRDs + backbone, simulator ticking
        await kube.create(deployment_manifest("llama-decode", namespace="default"))
        async with OperatorThread(connection=kube.connection_info()):  # moonlease_operator.runner
            await kube.create(policy)                       # kopf handles it over HTTP
            await kube.wait_for(lambda: kube.get("mlp", "default", "fleet").get("status"))

Synchronous programs use `LocalApiServerThread` instead (the server in a thread of its own).

What kmock 0.8 leaves out and this module adds (each one something kopf or the operator needs):
resourceVersion (one global counter, bumped on every write, checked by JSON-patch `test` ops,
PUT and patches that carry one), metadata.generation (bumped on spec changes), uid,
creationTimestamp, generateName; the status subresource (writes to the object ignore status,
writes to /status ignore everything else); JSON merge, JSON and strategic-merge patches (the
latter with the merge keys of containers, env, ports, volumes); namespaces that must exist;
label and field selectors on list and watch; CRDs that take effect when created (discovery,
pruning, defaulting and openAPIV3Schema validation of custom resources — CEL rules are not
evaluated); ownerReference cascade on deletion; 201 on create; list kinds. Every HTTP request is
recorded as an `ApiCall` (with its RBAC verb) for later comparison with RBAC rules.
`inject_failures` makes the next N requests to an object answer 409 or a 5xx, for testing
clients' retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import enum
import functools
import hashlib
import json
import logging
import re
import secrets
import string
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import jsonpointer
import jsonschema
import kmock
import yaml
from kmock._internal import apps as kmock_apps
from kmock._internal import parsing as kmock_parsing

log = logging.getLogger(__name__)

JsonObj = dict[str, Any]


# kmock 0.8 reads `/api/v1/namespaces[/<name>[/status]]` as "a namespace scope without a
# resource": listing namespaces raises ValueError (a 500) and fetching one answers discovery.
# kopf lists and watches namespaces when it serves chosen namespaces, so Namespace object paths
# are parsed here first; every other path goes to kmock's parser unchanged.
_kmock_parse_path = kmock_parsing.parse_path


def _parse_path(path: str) -> kmock_parsing.ParsedPath:
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and (
            len(parts) <= 4 or (len(parts) == 5 and parts[4] in ("status", "finalize"))):
        return kmock_parsing.ParsedPath(group="", version="v1", plural="namespaces", namespace=None,
                                        name=parts[3] if len(parts) > 3 else None,
                                        subresource=parts[4] if len(parts) > 4 else None)
    return _kmock_parse_path(path)


if getattr(kmock_parsing.parse_path, "__module__", "") != __name__:
    kmock_parsing.parse_path = _parse_path


# --------------------------------------------------------------------------------------------
# Resource types
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ResourceType:
    """What the API server knows about one resource: its address and discovery information."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    subresources: frozenset[str] = frozenset()
    short_names: tuple[str, ...] = ()
    singular: str = ""
    custom: bool = False  # defined by a CRD: merge/JSON patches only, schema applies

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @functools.cached_property
    def ref(self) -> kmock.resource:
        # Cached: building a kmock.resource is slow (a Protocol isinstance check), and the
        # simulator compares refs for every object on every tick.
        return kmock.resource(self.group, self.version, self.plural)

    def path(self, namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
        """The URL path of a collection, an object or a subresource."""
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace is not None:
            base += f"/namespaces/{namespace}"
        base += f"/{self.plural}"
        if name is not None:
            base += f"/{name}"
            if subresource:
                base += f"/{subresource}"
        return base


_VERBS = ("create", "delete", "get", "list", "patch", "update", "watch")

NAMESPACES = ResourceType("", "v1", "namespaces", "Namespace", False, frozenset({"status"}), ("ns",))
CRDS = ResourceType("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition",
                    False, frozenset({"status"}), ("crd", "crds"))
EVENTS = ResourceType("", "v1", "events", "Event", True, short_names=("ev",))
CONFIGMAPS = ResourceType("", "v1", "configmaps", "ConfigMap", True, short_names=("cm",))
SECRETS = ResourceType("", "v1", "secrets", "Secret", True)
SERVICES = ResourceType("", "v1", "services", "Service", True, frozenset({"status"}), ("svc",))
PODS = ResourceType("", "v1", "pods", "Pod", True, frozenset({"status"}), ("po",))
DEPLOYMENTS = ResourceType("apps", "v1", "deployments", "Deployment", True,
                           frozenset({"status", "scale"}), ("deploy",))
STATEFULSETS = ResourceType("apps", "v1", "statefulsets", "StatefulSet", True,
                            frozenset({"status", "scale"}), ("sts",))
LEASES = ResourceType("coordination.k8s.io", "v1", "leases", "Lease", True)

#: Served from the start: what kopf scans (namespaces, CRDs, events) and what the operator touches.
BUILTIN_RESOURCES: tuple[ResourceType, ...] = (
    NAMESPACES, CRDS, EVENTS, CONFIGMAPS, SECRETS, SERVICES, PODS, DEPLOYMENTS, STATEFULSETS, LEASES,
)


# --------------------------------------------------------------------------------------------
# Pure helpers: patches, selectors, schemas
# --------------------------------------------------------------------------------------------

def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch: objects merge recursively, null deletes, the rest replaces."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


#: List fields that a strategic merge patch merges by key instead of replacing (k8s.io/api tags).
STRATEGIC_MERGE_KEYS: Mapping[str, str] = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name",
    "env": "name", "ports": "containerPort", "volumes": "name", "volumeMounts": "mountPath",
    "volumeDevices": "devicePath", "imagePullSecrets": "name", "conditions": "type",
    "hostAliases": "ip", "resourceClaims": "name",
}


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Kubernetes' strategic merge patch for the built-in kinds, as far as tests need it.

    Like a merge patch, except that lists in `STRATEGIC_MERGE_KEYS` merge element-wise by their
    key, `$patch: delete` removes an element, `$patch: replace` replaces a map or list, and the
    `$setElementOrder/*` and `$retainKeys` hints are ignored. Other lists are replaced (atomic).
    """
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    result = dict(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if key.startswith("$setElementOrder/") or key in ("$retainKeys", "$patch"):
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and key in STRATEGIC_MERGE_KEYS and isinstance(result.get(key), list):
            result[key] = _merge_keyed_list(result[key], value, STRATEGIC_MERGE_KEYS[key])
        elif isinstance(value, list):
            result[key] = [_strip_directives(v) for v in value if not _is_delete(v)]
        else:
            result[key] = strategic_merge_patch(result.get(key), value)
    return result


def _is_delete(item: Any) -> bool:
    return isinstance(item, Mapping) and item.get("$patch") == "delete"


def _strip_directives(item: Any) -> Any:
    if isinstance(item, Mapping):
        return strategic_merge_patch({}, item)
    return copy.deepcopy(item)


def _merge_keyed_list(current: list[Any], patch: list[Any], key: str) -> list[Any]:
    if any(isinstance(item, Mapping) and item.get("$patch") == "replace" for item in patch):
        return [_strip_directives(i) for i in patch if not (isinstance(i, Mapping) and "$patch" in i)]
    result = [copy.deepcopy(item) for item in current]
    for item in patch:
        if not isinstance(item, Mapping) or key not in item:
            result.append(copy.deepcopy(item))
            continue
        index = next((i for i, old in enumerate(result)
                      if isinstance(old, Mapping) and old.get(key) == item[key]), None)
        if _is_delete(item):
            if index is not None:
                del result[index]
        elif index is None:
            result.append(_strip_directives(item))
        else:
            result[index] = strategic_merge_patch(result[index], item)
    return result


@dataclass(frozen=True)
class SelectorTerm:
    """One term of a label selector string: `key op values`."""

    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!exists"
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        match self.op:
            case "=":
                return present and labels[self.key] in self.values
            case "!=":
                return not present or labels[self.key] not in self.values
            case "in":
                return present and labels[self.key] in self.values
            case "notin":
                return not present or labels[self.key] not in self.values
            case "exists":
                return present
            case _:
                return not present


_SET_TERM = re.compile(r"^\s*(!?)\s*([^\s!=,()]+)\s*(?:(in|notin)\s*\(([^)]*)\)|(==|=|!=)\s*([^\s,]*))?\s*$")


def parse_label_selector(text: str) -> tuple[SelectorTerm, ...]:
    """Parse `a=b,c!=d,e in (x,y),f notin (z),g,!h` (kubectl's syntax); raises ValueError."""
    terms: list[SelectorTerm] = []
    for raw in _split_selector(text):
        match = _SET_TERM.match(raw)
        if not match:
            raise ValueError(f"unable to parse requirement: {raw!r}")
        neg, key, set_op, set_values, eq_op, eq_value = match.groups()
        if set_op:
            values = frozenset(v.strip() for v in set_values.split(",") if v.strip())
            terms.append(SelectorTerm(key, set_op, values))
        elif eq_op:
            terms.append(SelectorTerm(key, "!=" if eq_op == "!=" else "=", frozenset({eq_value})))
        else:
            terms.append(SelectorTerm(key, "!exists" if neg else "exists"))
    return tuple(terms)


def _split_selector(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in text:
        depth += (char == "(") - (char == ")")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [p for p in parts if p.strip()]


def match_label_selector(terms: Iterable[SelectorTerm], labels: Mapping[str, str]) -> bool:
    return all(term.matches(labels) for term in terms)


def match_field_selector(text: str, obj: Mapping[str, Any]) -> bool:
    """`metadata.name=x,involvedObject.kind!=Pod`: dotted paths compared as strings."""
    for raw in _split_selector(text):
        negate = "!=" in raw
        path, _, expected = raw.partition("!=" if negate else ("==" if "==" in raw else "="))
        value: Any = obj
        for part in path.strip().split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        actual = "" if value is None else str(value)
        if (actual == expected.strip()) == negate:
            return False
    return True


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


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --------------------------------------------------------------------------------------------
# Errors in the API's own shape (kopf and the Kubernetes client map them by status code)
# --------------------------------------------------------------------------------------------

def _error(status: int, reason: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=status, reason=reason, message=message, details={})


def _not_found(rtype: ResourceType, name: str | None) -> kmock.KubernetesError:
    return _error(404, "NotFound", f'{rtype.plural}{"." + rtype.group if rtype.group else ""} "{name}" not found')


def _conflict(rtype: ResourceType, name: str, why: str) -> kmock.KubernetesError:
    return _error(409, "Conflict", f'Operation cannot be fulfilled on {rtype.plural} "{name}": {why}')


def _invalid(rtype: ResourceType, name: str | None, problems: Sequence[str]) -> kmock.KubernetesError:
    return _error(422, "Invalid", f'{rtype.kind} "{name}" is invalid: ' + "; ".join(problems))


# --------------------------------------------------------------------------------------------
# Request log
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ApiCall:
    """One HTTP request the server got, in RBAC terms (verb, group, resource, subresource)."""

    method: str
    path: str
    verb: str | None  # get/list/watch/create/update/patch/delete/deletecollection; None: not a resource
    group: str | None
    version: str | None
    resource: str | None
    subresource: str | None
    namespace: str | None
    name: str | None
    user_agent: str

    @property
    def rbac_resource(self) -> str | None:
        """`resource` or `resource/subresource`, as RBAC rules spell it."""
        if self.resource is None:
            return None
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource


def _rbac_verb(method: str, name: str | None, params: Mapping[str, str]) -> str | None:
    match method.upper(), name is not None:
        case "GET", _ if params.get("watch") in ("true", "1"):
            return "watch"
        case "GET", True:
            return "get"
        case "GET", False:
            return "list"
        case "POST", _:
            return "create"
        case "PUT", _:
            return "update"
        case "PATCH", _:
            return "patch"
        case "DELETE", True:
            return "delete"
        case "DELETE", False:
            return "deletecollection"
    return None


# --------------------------------------------------------------------------------------------
# Injected failures
# --------------------------------------------------------------------------------------------

_FAULT_REASONS = {401: "Unauthorized", 403: "Forbidden", 409: "Conflict", 422: "Invalid", 429: "TooManyRequests",
                  500: "InternalError", 503: "ServiceUnavailable", 504: "Timeout"}


@dataclass
class InjectedFault:
    """The next `remaining` HTTP requests matching this answer `status` instead of being served
    (the object is left untouched). `fired` counts the answers given so far."""

    ref: kmock.resource
    namespace: str | None
    name: str | None
    verbs: frozenset[str]
    subresource: str | None
    status: int
    remaining: int
    fired: int = 0

    def matches(self, rtype: ResourceType, request: kmock.Request, verb: str) -> bool:
        return (self.remaining > 0 and rtype.ref == self.ref and verb in self.verbs
                and (self.namespace is None or request.namespace == self.namespace)
                and (self.name is None or request.name == self.name)
                and (self.subresource == "*" or request.subresource == self.subresource))


# --------------------------------------------------------------------------------------------
# The API server emulator
# --------------------------------------------------------------------------------------------

@attrs.define(kw_only=True)
class ApiServerEmulator(kmock.KubernetesEmulator):
    """kmock's KubernetesEmulator with the object semantics of a real API server (see module doc).

    Objects live in kmock's `objects` array (so kmock-style assertions and per-object history
    work); every write goes through `create_object`/`patch_object`/`replace_object`/
    `delete_object`, from HTTP or from in-process helpers alike.
    """

    _types: dict[kmock.resource, ResourceType] = attrs.field(factory=dict, init=False)
    _kinds: dict[tuple[str, str], ResourceType] = attrs.field(factory=dict, init=False)
    _schemas: dict[kmock.resource, JsonObj] = attrs.field(factory=dict, init=False)
    _revision: int = attrs.field(default=0, init=False)
    _faults: list[InjectedFault] = attrs.field(factory=list, init=False)

    def __attrs_post_init__(self) -> None:
        # Our fallbacks first: at equal priority the first registered wins over the emulator's.
        self.fallback[kmock.action.LIST] << self._serve_list
        self.fallback[kmock.action.WATCH] << self._serve_watch
        self.fallback[kmock.action.FETCH] << self._serve_fetch
        self.fallback[kmock.action.CREATE] << self._serve_create
        self.fallback[kmock.action.UPDATE] << self._serve_update
        self.fallback[kmock.action.DELETE] << self._serve_delete
        self.fallback[kmock.method.PUT] << self._serve_replace
        super().__attrs_post_init__()
        for rtype in BUILTIN_RESOURCES:
            self.register(rtype)

    # ---- resource registry ---------------------------------------------------------------

    def register(self, rtype: ResourceType, schema: JsonObj | None = None) -> None:
        """Serve a resource type (discovery, CRUD); a schema applies to its objects' writes."""
        self._types[rtype.ref] = rtype
        self._kinds[(rtype.api_version, rtype.kind)] = rtype
        if schema is not None:
            self._schemas[rtype.ref] = schema
        self.resources[rtype.ref] = kmock.ResourceInfo(
            kind=rtype.kind, singular=rtype.singular or rtype.kind.lower(), namespaced=rtype.namespaced,
            verbs=set(_VERBS), shortnames=set(rtype.short_names), subresources=set(rtype.subresources),
        )

    def unregister(self, rtype: ResourceType) -> None:
        self._types.pop(rtype.ref, None)
        self._kinds.pop((rtype.api_version, rtype.kind), None)
        self._schemas.pop(rtype.ref, None)
        if rtype.ref in self.resources:
            del self.resources[rtype.ref]

    def resource_type(self, what: str | ResourceType | kmock.resource | Mapping[str, Any]) -> ResourceType:
        """Find a served type by `ResourceType`, a kmock resource or string ("apps/v1/deployments",
        "deployments.v1.apps", "v1/pods"), a kind ("Deployment", "deploy"), or an object's
        apiVersion+kind."""
        if isinstance(what, ResourceType):
            return what
        if isinstance(what, Mapping):
            found = self._kinds.get((what.get("apiVersion", ""), what.get("kind", "")))
            if found is None:
                raise LookupError(f"no resource serves {what.get('apiVersion')}/{what.get('kind')}")
            return found
        if isinstance(what, str) and "/" not in what and "." not in what:
            for rtype in self._types.values():
                if what in (rtype.kind, rtype.plural, rtype.singular, *rtype.short_names) \
                        or what.lower() == rtype.kind.lower():
                    return rtype
            raise LookupError(f"no resource type named {what!r}")
        ref = what if isinstance(what, kmock.resource) else kmock.resource(what)
        for key, rtype in self._types.items():
            if ref.check(key):
                return rtype
        raise LookupError(f"no resource type {what!r}")

    @property
    def resource_version(self) -> int:
        """The last resourceVersion handed out (the cluster-wide counter)."""
        return self._revision

    # ---- injected failures ------------------------------------------------------------------

    def inject_failures(self, what: Any, namespace: str | None = None, name: str | None = None, *,
                        status: int = 409, count: int = 1, verbs: Iterable[str] = ("patch", "update"),
                        subresource: str | None = "*") -> InjectedFault:
        """Make the next `count` HTTP requests with one of `verbs` (RBAC verbs: get, list,
        create, patch, update, delete) to this object (any object of the type if `name` is None)
        fail with `status` — 409 Conflict, 429, 500, 503 — before they touch anything.
        `subresource`: "*" any, None the object itself, "status" only its status."""
        fault = InjectedFault(ref=self.resource_type(what).ref, namespace=namespace, name=name,
                              verbs=frozenset(verbs), subresource=subresource, status=status, remaining=count)
        self._faults.append(fault)
        return fault

    def _check_faults(self, rtype: ResourceType, request: kmock.Request, verb: str) -> None:
        for fault in self._faults:
            if fault.matches(rtype, request, verb):
                fault.remaining -= 1
                fault.fired += 1
                if fault.status == 409:
                    raise _conflict(rtype, request.name or "", "injected conflict: the object has been modified")
                raise _error(fault.status, _FAULT_REASONS.get(fault.status, "InternalError"),
                             f"injected failure {fault.status}")

    # ---- object access (lock held by callers that mutate) -----------------------------------

    def _key(self, rtype: ResourceType, namespace: str | None, name: str) -> tuple[kmock.resource, str | None, str]:
        return (rtype.ref, namespace if rtype.namespaced else None, name)

    def read_object(self, what: Any, namespace: str | None, name: str) -> JsonObj | None:
        """The live object (a deep copy), or None."""
        rtype = self.resource_type(what)
        key = self._key(rtype, namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(self.objects[key].raw)

    def list_objects(self, what: Any, namespace: str | None = None, *,
                     label_selector: str | None = None, field_selector: str | None = None) -> list[JsonObj]:
        """Live objects of a type (deep copies), optionally in one namespace and filtered."""
        rtype = self.resource_type(what)
        terms = parse_label_selector(label_selector) if label_selector else ()
        found = []
        for (ref, ns, _), obj in self.objects.items():
            if ref != rtype.ref or obj.deleted or (namespace is not None and ns != namespace):
                continue
            raw = obj.raw
            if terms and not match_label_selector(terms, raw.get("metadata", {}).get("labels") or {}):
                continue
            if field_selector and not match_field_selector(field_selector, raw):
                continue
            found.append(copy.deepcopy(raw))
        return found

    def objects_by_owner(self, what: Any) -> dict[str, list[JsonObj]]:
        """Live objects of a type (deep copies) grouped by the uid of each owner they name: one
        pass over the store, for the simulator's per-tick pod bookkeeping."""
        ref = self.resource_type(what).ref
        found: dict[str, list[JsonObj]] = {}
        for (obj_ref, _, _), obj in self.objects.items():
            if obj_ref != ref or obj.deleted:
                continue
            raw = obj.raw
            for owner in raw.get("metadata", {}).get("ownerReferences") or []:
                found.setdefault(owner.get("uid", ""), []).append(copy.deepcopy(raw))
        return found

    def history(self, what: Any, namespace: str | None, name: str) -> list[JsonObj | None]:
        """Every stored version of an object, oldest first (None marks a deletion)."""
        rtype = self.resource_type(what)
        key = self._key(rtype, namespace, name)
        if key not in self.objects:
            return []
        return [None if v is None else copy.deepcopy(v.raw) for v in self.objects[key].history]

    def _next_revision(self) -> str:
        self._revision += 1
        return str(self._revision)

    async def _publish(self, rtype: ResourceType, event_type: str, raw: JsonObj) -> None:
        await self._buses[rtype.ref].put({"type": event_type, "object": copy.deepcopy(raw)})

    # ---- writes -----------------------------------------------------------------------------

    async def create_object(self, what: Any, body: Mapping[str, Any], *, namespace: str | None = None,
                            strict_fields: bool = False) -> JsonObj:
        """POST semantics: generated name, uid, resourceVersion, generation; 409 if it exists."""
        rtype = self.resource_type(what if what is not None else body)
        async with self._lock:
            obj = copy.deepcopy(dict(body))
            meta = obj.setdefault("metadata", {})
            namespace = namespace or meta.get("namespace") or ("default" if rtype.namespaced else None)
            if rtype.namespaced:
                meta["namespace"] = namespace
                self._require_namespace(namespace)
            else:
                meta.pop("namespace", None)
            if not meta.get("name") and meta.get("generateName"):
                suffix = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(5))
                meta["name"] = meta["generateName"] + suffix
            name = meta.get("name")
            if not name:
                raise _invalid(rtype, None, ["metadata.name: Required value: name or generateName is required"])
            key = self._key(rtype, namespace, name)
            if key in self.objects and not self.objects[key].deleted:
                raise _error(409, "AlreadyExists", f'{rtype.plural} "{name}" already exists')
            obj["apiVersion"], obj["kind"] = rtype.api_version, rtype.kind
            obj = self._admit(rtype, obj, strict_fields=strict_fields)
            meta = obj["metadata"]
            for server_field in ("deletionTimestamp", "deletionGracePeriodSeconds"):
                meta.pop(server_field, None)
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = now_rfc3339()
            meta["generation"] = 1
            meta["resourceVersion"] = self._next_revision()
            if rtype == CRDS:
                obj = self._establish_crd(obj)
            if key in self.objects:
                self.objects[key].create(obj)
            else:
                self.objects[key] = obj
            await self._publish(rtype, "ADDED", obj)
            return copy.deepcopy(obj)

    async def patch_object(self, what: Any, namespace: str | None, name: str, patch: Any, *,
                           patch_type: str = "merge", subresource: str | None = None,
                           strict_fields: bool = False) -> JsonObj:
        """PATCH semantics. `patch_type`: "merge", "json" or "strategic"."""
        rtype = self.resource_type(what)
        if patch_type == "strategic" and rtype.custom:
            raise _error(415, "UnsupportedMediaType",
                         "strategic merge patch is not supported for custom resources")
        async with self._lock:
            current = self._live(rtype, namespace, name)
            try:
                match patch_type:
                    case "merge":
                        if not isinstance(patch, Mapping):
                            raise _error(400, "BadRequest", "a merge patch must be a JSON object")
                        patched = merge_patch(current, patch)
                    case "strategic":
                        if not isinstance(patch, Mapping):
                            raise _error(400, "BadRequest", "a strategic merge patch must be a JSON object")
                        patched = strategic_merge_patch(current, patch)
                    case "json":
                        patched = jsonpatch.apply_patch(current, list(patch), in_place=False)
                    case _:
                        raise _error(415, "UnsupportedMediaType", f"unsupported patch type {patch_type!r}")
            except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
                raise _error(422, "Invalid", f"the JSON patch could not be applied: {exc}") from None
            sent_rv = patched.get("metadata", {}).get("resourceVersion")
            if patch_type != "json" and sent_rv not in (None, current["metadata"]["resourceVersion"]):
                raise _conflict(rtype, name, "the object has been modified; please apply your changes"
                                             " to the latest version and try again")
            return await self._store_update(rtype, current, patched, subresource, strict_fields)

    async def replace_object(self, what: Any, namespace: str | None, name: str, body: Mapping[str, Any], *,
                             subresource: str | None = None, strict_fields: bool = False) -> JsonObj:
        """PUT semantics: a full replacement, refused with 409 if resourceVersion is stale."""
        rtype = self.resource_type(what)
        async with self._lock:
            current = self._live(rtype, namespace, name)
            new = copy.deepcopy(dict(body))
            sent_rv = new.get("metadata", {}).get("resourceVersion")
            if sent_rv is not None and sent_rv != current["metadata"]["resourceVersion"]:
                raise _conflict(rtype, name, "the object has been modified; please apply your changes"
                                             " to the latest version and try again")
            return await self._store_update(rtype, current, new, subresource, strict_fields)

    async def delete_object(self, what: Any, namespace: str | None, name: str) -> JsonObj:
        """DELETE semantics: finalizers defer deletion (deletionTimestamp); owned objects follow."""
        rtype = self.resource_type(what)
        async with self._lock:
            current = self._live(rtype, namespace, name)
            if current["metadata"].get("finalizers"):
                if not current["metadata"].get("deletionTimestamp"):
                    current["metadata"]["deletionTimestamp"] = now_rfc3339()
                    current["metadata"]["resourceVersion"] = self._next_revision()
                    self.objects[self._key(rtype, namespace, name)].history.append(current)
                    await self._publish(rtype, "MODIFIED", current)
                return copy.deepcopy(current)
            await self._remove(rtype, current)
            return current

    def _live(self, rtype: ResourceType, namespace: str | None, name: str) -> JsonObj:
        key = self._key(rtype, namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            raise _not_found(rtype, name)
        return copy.deepcopy(self.objects[key].raw)

    def _require_namespace(self, namespace: str | None) -> None:
        key = self._key(NAMESPACES, None, namespace or "")
        if key not in self.objects or self.objects[key].deleted:
            raise _error(404, "NotFound", f'namespaces "{namespace}" not found')

    async def _store_update(self, rtype: ResourceType, current: JsonObj, new: JsonObj,
                            subresource: str | None, strict_fields: bool) -> JsonObj:
        meta_now = current["metadata"]
        has_status = "status" in rtype.subresources
        if subresource == "status":
            # Writes to /status change the status and nothing else.
            merged = copy.deepcopy(current)
            if "status" in new:
                merged["status"] = new["status"]
            else:
                merged.pop("status", None)
            new = merged
        elif subresource:
            raise _error(405, "MethodNotAllowed", f"subresource {subresource!r} is not writable here")
        elif has_status:
            # Writes to the object keep the status as it was.
            new = {k: v for k, v in new.items() if k != "status"}
            if "status" in current:
                new["status"] = copy.deepcopy(current["status"])
        new["apiVersion"], new["kind"] = rtype.api_version, rtype.kind
        meta = new.setdefault("metadata", {})
        # Identity and server-owned fields cannot change.
        for fixed in ("name", "namespace", "uid", "creationTimestamp", "generation", "deletionTimestamp"):
            if fixed in meta_now:
                meta[fixed] = meta_now[fixed]
            else:
                meta.pop(fixed, None)
        new = self._admit(rtype, new, strict_fields=strict_fields)
        meta = new["metadata"]
        if _spec_of(new) != _spec_of(current):
            meta["generation"] = int(meta_now.get("generation", 1)) + 1
        if rtype == CRDS:
            new = self._establish_crd(new)
            meta = new["metadata"]
        meta["resourceVersion"] = meta_now["resourceVersion"]
        if new == current:
            return copy.deepcopy(current)  # a no-op write: no new version, no event (as etcd)
        meta["resourceVersion"] = self._next_revision()
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            await self._remove(rtype, new)
            return copy.deepcopy(new)
        self.objects[self._key(rtype, meta.get("namespace"), meta["name"])].history.append(new)
        await self._publish(rtype, "MODIFIED", new)
        return copy.deepcopy(new)

    async def _remove(self, rtype: ResourceType, obj: JsonObj) -> None:
        meta = obj["metadata"]
        key = self._key(rtype, meta.get("namespace"), meta["name"])
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = self._next_revision()
        self.objects[key].history.append(obj)
        self.objects[key].delete()
        await self._publish(rtype, "DELETED", obj)
        if rtype == CRDS:
            self._forget_crd(obj)
        # Cascade to dependents (foreground/background GC collapsed into "right away").
        uid = meta.get("uid")
        for (ref, _, _), other in list(self.objects.items()):
            if other.deleted:
                continue
            owners = other.raw.get("metadata", {}).get("ownerReferences") or []
            if any(o.get("uid") == uid for o in owners):
                dependent = copy.deepcopy(other.raw)
                dtype = self._types.get(ref)
                if dtype is not None:
                    await self._remove(dtype, dependent)

    def _admit(self, rtype: ResourceType, obj: JsonObj, *, strict_fields: bool) -> JsonObj:
        """Prune, default and validate against the CRD schema (custom resources only)."""
        schema = self._schemas.get(rtype.ref)
        if schema is None:
            return obj
        name = obj.get("metadata", {}).get("name")
        pruned, dropped = prune_unknown_fields(obj, schema)
        if dropped and strict_fields:
            raise _error(400, "BadRequest", f'{rtype.kind} "{name}": unknown fields: {", ".join(dropped)}')
        defaulted = apply_schema_defaults(pruned, schema)
        problems = schema_errors(defaulted, schema)
        if problems:
            raise _invalid(rtype, name, problems)
        return defaulted

    # ---- CRDs take effect when stored ---------------------------------------------------------

    def _establish_crd(self, crd: JsonObj) -> JsonObj:
        spec = crd.get("spec", {})
        names = spec.get("names", {})
        for version in spec.get("versions", []):
            if not version.get("served", True):
                continue
            rtype = ResourceType(
                group=spec["group"], version=version["name"], plural=names["plural"], kind=names["kind"],
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                subresources=frozenset(version.get("subresources", {}) or {}),
                short_names=tuple(names.get("shortNames", ())), singular=names.get("singular", ""),
                custom=True,
            )
            self.register(rtype, (version.get("schema") or {}).get("openAPIV3Schema"))
        crd = copy.deepcopy(crd)
        crd["status"] = {
            "acceptedNames": copy.deepcopy(names),
            "storedVersions": [v["name"] for v in spec.get("versions", []) if v.get("storage")],
            "conditions": [
                {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts",
                 "message": "no conflicts found", "lastTransitionTime": now_rfc3339()},
                {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
                 "message": "the initial names have been accepted", "lastTransitionTime": now_rfc3339()},
            ],
        }
        return crd

    def _forget_crd(self, crd: JsonObj) -> None:
        spec = crd.get("spec", {})
        for version in spec.get("versions", []):
            ref = kmock.resource(spec.get("group"), version.get("name"), spec.get("names", {}).get("plural"))
            if ref in self._types:
                self.unregister(self._types[ref])

    # ---- HTTP -----------------------------------------------------------------------------------

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        # Skip KubernetesEmulator._handle: its write interception (no resourceVersion, merge-only
        # patches) is replaced by the _serve_* fallbacks below, which write only when no user
        # reaction intercepted the request first.
        return await kmock_apps.RawHandler._handle(self, request)

    async def _serve_version(self, request: kmock.Request) -> kmock.Payload:
        payload = await super()._serve_version(request)
        if isinstance(payload, dict) and payload.get("groupVersion", "").startswith("/"):
            payload["groupVersion"] = payload["groupVersion"][1:]  # the core group is "v1", not "/v1"
        return payload

    def _request_type(self, request: kmock.Request) -> ResourceType:
        res = request.resource
        if res is None or res.version is None or res.plural is None:
            # Discovery (/api/v1, /apis/<group>/<version>): let the scaffold's handlers answer.
            # NotImplementedError passes the request on without disabling this reaction.
            raise NotImplementedError
        rtype = self._types.get(request.resource)
        if rtype is None:
            raise kmock.KubernetesResourceNotFoundError()
        return rtype

    async def _serve_list(self, request: kmock.Request) -> kmock.Payload:
        rtype = self._request_type(request)
        self._check_faults(rtype, request, "list")
        async with self._lock:
            items = self._select(rtype, request)
            revision = str(self._revision)
        return {
            "apiVersion": rtype.api_version, "kind": f"{rtype.kind}List",
            "metadata": {"resourceVersion": revision}, "items": items,
        }

    def _select(self, rtype: ResourceType, request: kmock.Request) -> list[JsonObj]:
        try:
            return self.list_objects(
                rtype, request.namespace,
                label_selector=request.params.get("labelSelector") or None,
                field_selector=request.params.get("fieldSelector") or None,
            )
        except ValueError as exc:
            raise _error(400, "BadRequest", str(exc)) from None

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[kmock.Payload]:
        rtype = self._request_type(request)
        yield b""  # send the headers now, even if nothing happens for a while
        terms = parse_label_selector(request.params.get("labelSelector") or "")
        fields = request.params.get("fieldSelector") or ""
        if request.name is not None:
            fields = ",".join(f for f in (fields, f"metadata.name={request.name}") if f)
        bus = self._buses[rtype.ref]
        async with self._lock:  # snapshot and bus mark together: no event falls in between
            existing = self._select(rtype, request) if request.name is None else [
                o for o in self.list_objects(rtype, request.namespace) if o["metadata"]["name"] == request.name]
            mark = await bus.mark()
        timeout = float(request.params["timeoutSeconds"]) if request.params.get("timeoutSeconds") else None
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for obj in existing:
                yield {"type": "ADDED", "object": obj}
            stream = aiter(bus.stream(since=mark))
            while True:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    event = await asyncio.wait_for(anext(stream), remaining)
                except TimeoutError:
                    return
                obj = event.get("object", {})
                meta = obj.get("metadata", {})
                if request.namespace is not None and meta.get("namespace") != request.namespace:
                    continue
                if terms and not match_label_selector(terms, meta.get("labels") or {}):
                    continue
                if fields and not match_field_selector(fields, obj):
                    continue
                yield event
        finally:
            with contextlib.suppress(ValueError):
                await bus.unmark(mark)

    async def _serve_fetch(self, request: kmock.Request) -> kmock.Payload:
        rtype = self._request_type(request)
        self._check_faults(rtype, request, "get")
        assert request.name is not None
        obj = self.read_object(rtype, request.namespace, request.name)
        if obj is None:
            raise _not_found(rtype, request.name)
        return obj

    async def _serve_create(self, request: kmock.Request) -> kmock.Payload:
        rtype = self._request_type(request)
        self._check_faults(rtype, request, "create")
        if not isinstance(request.data, Mapping):
            raise _error(400, "BadRequest", "the request body must be a JSON object")
        if rtype.namespaced and request.namespace is None:
            raise _error(405, "MethodNotAllowed", "create a namespaced object under /namespaces/<ns>/")
        body_ns = request.data.get("metadata", {}).get("namespace")
        if rtype.namespaced and body_ns not in (None, request.namespace):
            raise _error(400, "BadRequest", "the namespace of the object does not match the URL")
        obj = await self.create_object(rtype, request.data, namespace=request.namespace,
                                       strict_fields=_strict(request))
        return kmock.Response(status=201, payload=obj)

    async def _serve_update(self, request: kmock.Request) -> kmock.Payload:
        rtype = self._request_type(request)
        self._check_faults(rtype, request, "patch")
        assert request.name is not None
        content_type = (request.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        patch_type = {
            "application/merge-patch+json": "merge",
            "application/json-patch+json": "json",
            "application/strategic-merge-patch+json": "strategic",
        }.get(content_type)
        if patch_type is None:
            raise _error(415, "UnsupportedMediaType", f"the body of the request was in an unknown format"
                                                      f" ({content_type or 'none'}); server-side apply is"
                                                      f" not emulated")
        return await self.patch_object(rtype, request.namespace, request.name, request.data,
                                       patch_type=patch_type, subresource=request.subresource,
                                       strict_fields=_strict(request))

    async def _serve_replace(self, request: kmock.Request) -> kmock.Payload:
        if request.name is None:
            raise kmock.KubernetesEndpointNotFoundError()
        rtype = self._request_type(request)
        self._check_faults(rtype, request, "update")
        if not isinstance(request.data, Mapping):
            raise _error(400, "BadRequest", "the request body must be a JSON object")
        return await self.replace_object(rtype, request.namespace, request.name, request.data,
                                         subresource=request.subresource, strict_fields=_strict(request))

    async def _serve_delete(self, request: kmock.Request) -> kmock.Payload:
        rtype = self._request_type(request)
        self._check_faults(rtype, request, "delete")
        assert request.name is not None
        return await self.delete_object(rtype, request.namespace, request.name)

    # ---- the request log ------------------------------------------------------------------------

    def api_calls(self) -> list[ApiCall]:
        """Every HTTP request so far, oldest first."""
        calls = []
        for req in list(self._requests):
            res = req.resource
            is_resource = res is not None and res.plural is not None
            calls.append(ApiCall(
                method=str(req.method.value if hasattr(req.method, "value") else req.method),
                path=req.url.path,
                verb=_rbac_verb(str(req.method.value), req.name, req.params) if is_resource else None,
                group=res.group if res is not None else None,
                version=res.version if res is not None else None,
                resource=res.plural if is_resource else None,
                subresource=req.subresource,
                namespace=req.namespace,
                name=req.name,
                user_agent=req.headers.get("User-Agent", ""),
            ))
        return calls


def _strict(request: kmock.Request) -> bool:
    return request.params.get("fieldValidation", "").lower() == "strict"


def _spec_of(obj: Mapping[str, Any]) -> Any:
    """What bumps metadata.generation: everything but metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}


# --------------------------------------------------------------------------------------------
# The Deployment / StatefulSet controller, simulated
# --------------------------------------------------------------------------------------------

class RolloutBehaviour(str, enum.Enum):
    """How the simulated controller treats a workload's rollouts."""

    COMPLETE = "complete"  # one more replica updated and ready per tick, until all are
    STALL = "stall"  # observed, but not one replica moves: the rollout never finishes
    FAIL = "fail"  # the first new replica never gets ready; Deployments report the deadline


@dataclass
class _Rule:
    behaviour: RolloutBehaviour
    when: Callable[[Mapping[str, Any]], bool] | None


@dataclass
class WorkloadRollout:
    """What the simulator knows about one workload (read it in tests; it writes the status)."""

    kind: str
    namespace: str
    name: str
    stable_revision: str | None = None  # the revision every replica ran last time it settled
    stable_template: JsonObj | None = None
    update_revision: str | None = None
    update_template: JsonObj | None = None
    updated: int = 0  # replicas on update_revision
    ticks_in_rollout: int = 0
    failed: bool = False
    completed_rollouts: list[str] = field(default_factory=list)

    @property
    def progressing(self) -> bool:
        return self.update_revision is not None and self.update_revision != self.stable_revision


def template_revision(template: Mapping[str, Any]) -> str:
    """A short stable hash of a pod template (like pod-template-hash / controller-revision-hash)."""
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


class RolloutSimulator:
    """Plays the Deployment and StatefulSet controllers on the emulator, one tick at a time.

    Per tick and workload: a new generation is observed (status.observedGeneration); a changed
    pod template starts a rollout that, under `COMPLETE`, moves one replica per tick to the new
    revision until all are updated, ready and available (then Progressing=True
    NewReplicaSetAvailable). Pods are kept in step (owned by the workload, labelled with
    pod-template-hash or controller-revision-hash, Ready or CrashLoopBackOff). `stall()` and
    `fail()` change that for a named workload, optionally only for templates matching `when`
    (e.g. "the one with the new flag"), so a rollback to an older template can still succeed.

    Drive it with `await tick()` for determinism, or `start()` a background task.
    """

    def __init__(self, emulator: ApiServerEmulator, *, fail_after_ticks: int = 2) -> None:
        self.emulator = emulator
        self.fail_after_ticks = fail_after_ticks
        self._rules: dict[tuple[str, str, str], _Rule] = {}
        self._state: dict[tuple[str, str, str], WorkloadRollout] = {}
        self._task: asyncio.Task[None] | None = None
        self._pods_by_owner: dict[str, list[JsonObj]] = {}
        self.ticks = 0

    # ---- test controls ------------------------------------------------------------------------

    def set_behaviour(self, kind: str, namespace: str, name: str, behaviour: RolloutBehaviour, *,
                      when: Callable[[Mapping[str, Any]], bool] | None = None) -> None:
        """Rollouts of this workload (to templates matching `when`, if given) behave so."""
        self._rules[(kind, namespace, name)] = _Rule(RolloutBehaviour(behaviour), when)

    def stall(self, kind: str, namespace: str, name: str, *,
              when: Callable[[Mapping[str, Any]], bool] | None = None) -> None:
        self.set_behaviour(kind, namespace, name, RolloutBehaviour.STALL, when=when)

    def fail(self, kind: str, namespace: str, name: str, *,
             when: Callable[[Mapping[str, Any]], bool] | None = None) -> None:
        self.set_behaviour(kind, namespace, name, RolloutBehaviour.FAIL, when=when)

    def heal(self, kind: str, namespace: str, name: str) -> None:
        """Back to COMPLETE; a failed or stalled rollout resumes on the next tick."""
        self._rules.pop((kind, namespace, name), None)

    def state(self, kind: str, namespace: str, name: str) -> WorkloadRollout | None:
        return self._state.get((kind, namespace, name))

    # ---- running --------------------------------------------------------------------------------

    def start(self, interval: float = 0.05) -> None:
        """Tick in the background every `interval` seconds (in the running loop)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(interval), name="rollout simulator")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    @property
    def running(self) -> bool:
        return self._task is not None

    async def _run(self, interval: float) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # a bad object must not stop the controller, as in a real cluster
                log.exception("rollout simulator tick failed")
            await asyncio.sleep(interval)

    async def tick(self) -> None:
        """Advance every Deployment and StatefulSet by one step."""
        self.ticks += 1
        self._pods_by_owner = self.emulator.objects_by_owner(PODS)
        for rtype in (DEPLOYMENTS, STATEFULSETS):
            for obj in self.emulator.list_objects(rtype):
                if obj["metadata"].get("deletionTimestamp"):
                    continue
                await self._step(rtype, obj)
        live = {(o["kind"], o["metadata"]["namespace"], o["metadata"]["name"])
                for rtype in (DEPLOYMENTS, STATEFULSETS) for o in self.emulator.list_objects(rtype)}
        for key in list(self._state):
            if key not in live:
                del self._state[key]

    async def _step(self, rtype: ResourceType, obj: JsonObj) -> None:
        meta, spec = obj["metadata"], obj.get("spec", {})
        key = (rtype.kind, meta["namespace"], meta["name"])
        st = self._state.setdefault(key, WorkloadRollout(*key))
        template = spec.get("template", {})
        revision = template_revision(template)
        replicas = int(spec.get("replicas", 1))
        behaviour = self._behaviour(key, template)

        if revision != st.update_revision:  # a new rollout (the first one, or back to the stable one)
            st.update_revision, st.update_template = revision, copy.deepcopy(template)
            st.updated = replicas if revision == st.stable_revision else 0
            st.ticks_in_rollout, st.failed = 0, False
        elif spec.get("paused"):
            pass
        elif revision != st.stable_revision:
            st.ticks_in_rollout += 1
            if behaviour is RolloutBehaviour.COMPLETE:
                st.updated, st.failed = st.updated + 1, False
            elif behaviour is RolloutBehaviour.FAIL:
                st.updated = max(st.updated, 1)
                st.failed = st.failed or st.ticks_in_rollout >= self.fail_after_ticks
        else:
            st.updated = replicas  # a scale change of a settled workload
        st.updated = min(st.updated, replicas)
        if revision != st.stable_revision and behaviour is RolloutBehaviour.COMPLETE and st.updated >= replicas:
            st.stable_revision, st.stable_template = revision, copy.deepcopy(template)
            st.completed_rollouts.append(revision)

        in_rollout = revision != st.stable_revision
        broken = in_rollout and behaviour is RolloutBehaviour.FAIL and st.updated > 0
        old = replicas - st.updated if in_rollout and st.stable_revision is not None else 0
        ready = st.updated - (1 if broken else 0) + old
        await self._sync_pods(rtype, obj, st, revision, old, broken)
        build = self._deployment_status if rtype == DEPLOYMENTS else self._statefulset_status
        status = build(obj, st, replicas=replicas, ready=ready, old=old, revision=revision)
        if status != obj.get("status"):
            # A merge patch of /status, not a PUT: a client may have written the object meanwhile.
            await self.emulator.patch_object(rtype, meta["namespace"], meta["name"], {"status": status},
                                             subresource="status")

    def _behaviour(self, key: tuple[str, str, str], template: Mapping[str, Any]) -> RolloutBehaviour:
        rule = self._rules.get(key)
        if rule is None or (rule.when is not None and not rule.when(template)):
            return RolloutBehaviour.COMPLETE
        return rule.behaviour

    def _deployment_status(self, obj: JsonObj, st: WorkloadRollout, *, replicas: int, ready: int,
                           old: int, revision: str) -> JsonObj:
        done = st.stable_revision == revision and ready == replicas
        previous = {c["type"]: c for c in obj.get("status", {}).get("conditions", [])}
        if st.failed:
            progressing = ("False", "ProgressDeadlineExceeded",
                           f'ReplicaSet "{obj["metadata"]["name"]}-{revision}" has timed out progressing.')
        elif done:
            progressing = ("True", "NewReplicaSetAvailable",
                           f'ReplicaSet "{obj["metadata"]["name"]}-{revision}" has successfully progressed.')
        else:
            progressing = ("True", "ReplicaSetUpdated",
                           f'ReplicaSet "{obj["metadata"]["name"]}-{revision}" is progressing.')
        # maxUnavailable 25% (rounded down), the Deployment default.
        available = ("True", "MinimumReplicasAvailable", "Deployment has minimum availability.") \
            if ready >= replicas - replicas // 4 else \
            ("False", "MinimumReplicasUnavailable", "Deployment does not have minimum availability.")
        return {
            "observedGeneration": obj["metadata"]["generation"],
            "replicas": replicas,
            "updatedReplicas": st.updated,
            "readyReplicas": ready,
            "availableReplicas": ready,
            "unavailableReplicas": max(0, replicas - ready),
            "conditions": [
                _condition(previous, "Available", *available),
                _condition(previous, "Progressing", *progressing),
            ],
        }

    def _statefulset_status(self, obj: JsonObj, st: WorkloadRollout, *, replicas: int, ready: int,
                            old: int, revision: str) -> JsonObj:
        name = obj["metadata"]["name"]
        current = st.stable_revision or revision
        return {
            "observedGeneration": obj["metadata"]["generation"],
            "replicas": replicas,
            "readyReplicas": ready,
            "availableReplicas": ready,
            "currentReplicas": replicas - st.updated if current != revision else replicas,
            "updatedReplicas": st.updated,
            "currentRevision": f"{name}-{current}",
            "updateRevision": f"{name}-{revision}",
            "collisionCount": 0,
        }

    async def _sync_pods(self, rtype: ResourceType, obj: JsonObj, st: WorkloadRollout, revision: str,
                         old: int, broken: bool) -> None:
        """Make the workload's pods match the rollout: `old` on the stable template, the rest new."""
        meta = obj["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        hash_label = "pod-template-hash" if rtype == DEPLOYMENTS else "controller-revision-hash"
        wanted: dict[str, tuple[JsonObj, str, bool]] = {}
        # Old pods first: a StatefulSet updates from the highest ordinal down.
        plans: list[tuple[JsonObj, str, int, bool]] = []
        if old and st.stable_template is not None and st.stable_revision is not None:
            plans.append((st.stable_template, st.stable_revision, old, False))
        plans.append((st.update_template or {}, revision, st.updated, broken))
        ordinal = 0
        for template, rev, count, with_broken in plans:
            for i in range(count):
                pod_name = f"{name}-{rev}-{i}" if rtype == DEPLOYMENTS else f"{name}-{ordinal}"
                ordinal += 1
                unready = with_broken and i == count - 1
                wanted[pod_name] = (template, rev, unready)
        existing = {p["metadata"]["name"]: p for p in self._pods_by_owner.get(meta["uid"], [])
                    if p["metadata"].get("namespace") == namespace}
        for pod_name, pod in existing.items():
            rev = (pod["metadata"].get("labels") or {}).get(hash_label, "")
            if pod_name not in wanted or (rtype == STATEFULSETS and rev != wanted[pod_name][1]):
                await self.emulator.delete_object(PODS, namespace, pod_name)
                existing[pod_name] = {}
        for pod_name, (template, rev, unready) in wanted.items():
            if existing.get(pod_name):
                pod = existing[pod_name]
                status = _pod_status(template, ready=not unready)
                if pod.get("status", {}).get("phase") != status["phase"] or \
                        _pod_ready(pod) != (not unready):
                    await self.emulator.patch_object(PODS, namespace, pod_name, {"status": status},
                                                     subresource="status")
                continue
            labels = {**(template.get("metadata", {}).get("labels") or {}), hash_label: rev}
            pod = {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {
                    "name": pod_name, "namespace": namespace, "labels": labels,
                    "annotations": dict(template.get("metadata", {}).get("annotations") or {}),
                    "ownerReferences": [{"apiVersion": rtype.api_version, "kind": rtype.kind, "name": name,
                                         "uid": meta["uid"], "controller": True}],
                },
                "spec": copy.deepcopy(template.get("spec", {})),
            }
            await self.emulator.create_object(PODS, pod, namespace=namespace)
            await self.emulator.patch_object(PODS, namespace, pod_name,
                                             {"status": _pod_status(template, ready=not unready)},
                                             subresource="status")


def _condition(previous: Mapping[str, JsonObj], type_: str, status: str, reason: str, message: str) -> JsonObj:
    old = previous.get(type_)
    now = now_rfc3339()
    changed = old is None or old.get("status") != status
    return {
        "type": type_, "status": status, "reason": reason, "message": message,
        "lastUpdateTime": now if old is None or old.get("reason") != reason else old.get("lastUpdateTime", now),
        "lastTransitionTime": now if changed else old.get("lastTransitionTime", now),
    }


def _pod_ready(pod: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in pod.get("status", {}).get("conditions", []))


def _pod_status(template: Mapping[str, Any], *, ready: bool) -> JsonObj:
    containers = template.get("spec", {}).get("containers", [])
    flag = "True" if ready else "False"
    now = now_rfc3339()
    return {
        "phase": "Running",
        "podIP": "127.0.0.1",  # every pod's servers run on this machine's loopback
        "conditions": [{"type": "Ready", "status": flag, "lastTransitionTime": now},
                       {"type": "ContainersReady", "status": flag, "lastTransitionTime": now}],
        "containerStatuses": [
            {"name": c.get("name", ""), "image": c.get("image", ""), "ready": ready,
             "restartCount": 0 if ready else 3,
             "state": {"running": {"startedAt": now}} if ready else
             {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off restarting failed container"}}}
            for c in containers
        ],
    }


def is_rollout_complete(obj: Mapping[str, Any]) -> bool:
    """`kubectl rollout status` for a Deployment or StatefulSet, from the object alone."""
    meta, spec, status = obj.get("metadata", {}), obj.get("spec", {}), obj.get("status", {}) or {}
    replicas = int(spec.get("replicas", 1))
    if status.get("observedGeneration", 0) < meta.get("generation", 1):
        return False
    if obj.get("kind") == "StatefulSet":
        return (status.get("updatedReplicas", 0) == replicas and status.get("readyReplicas", 0) == replicas
                and status.get("currentRevision") == status.get("updateRevision"))
    conditions = {c["type"]: c for c in status.get("conditions", [])}
    if conditions.get("Progressing", {}).get("reason") == "ProgressDeadlineExceeded":
        return False
    return (status.get("updatedReplicas", 0) == replicas and status.get("replicas", 0) == replicas
            and status.get("availableReplicas", 0) == replicas)


# --------------------------------------------------------------------------------------------
# Manifests
# --------------------------------------------------------------------------------------------

def namespace_manifest(name: str) -> JsonObj:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}


def _workload(kind: str, name: str, namespace: str, replicas: int, containers: Sequence[Mapping[str, Any]] | None,
              labels: Mapping[str, str] | None) -> JsonObj:
    selector = {"app.kubernetes.io/name": name}
    pod_labels = {**selector, **(labels or {})}
    return {
        "apiVersion": "apps/v1", "kind": kind,
        "metadata": {"name": name, "namespace": namespace, "labels": dict(pod_labels)},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {"containers": [dict(c) for c in containers] if containers else
                         [{"name": "main", "image": "registry.local/app:1"}]},
            },
        },
    }


def deployment_manifest(name: str, *, namespace: str = "default", replicas: int = 2,
                        containers: Sequence[Mapping[str, Any]] | None = None,
                        labels: Mapping[str, str] | None = None) -> JsonObj:
    """A minimal valid apps/v1 Deployment (selector = app.kubernetes.io/name=<name>)."""
    return _workload("Deployment", name, namespace, replicas, containers, labels)


def statefulset_manifest(name: str, *, namespace: str = "default", replicas: int = 2,
                         containers: Sequence[Mapping[str, Any]] | None = None,
                         labels: Mapping[str, str] | None = None) -> JsonObj:
    """A minimal valid apps/v1 StatefulSet."""
    obj = _workload("StatefulSet", name, namespace, replicas, containers, labels)
    obj["spec"]["serviceName"] = name
    return obj


# --------------------------------------------------------------------------------------------
# The façade
# --------------------------------------------------------------------------------------------

class LocalApiServer:
    """A running emulator with its HTTP server: the object tests and the demo hold.

    The CRUD helpers act like an admin's kubectl: they go through the same write path as HTTP
    (validation, resourceVersion, watch events) but are not recorded as API calls, so
    `api_calls()` shows only what real clients (kopf, the operator) asked for.
    """

    def __init__(self, emulator: ApiServerEmulator, server: kmock.Server, simulator: RolloutSimulator) -> None:
        self.emulator = emulator
        self.server = server
        self.simulator = simulator

    @property
    def url(self) -> str:
        return str(self.server.url).rstrip("/")

    # ---- connection configs ---------------------------------------------------------------------

    def connection_info(self, *, default_namespace: str = "default") -> Any:
        """A `kopf.ConnectionInfo` for this server (plain HTTP, no credentials)."""
        import kopf

        return kopf.ConnectionInfo(server=self.url, insecure=True, default_namespace=default_namespace)

    def kubernetes_configuration(self) -> Any:
        """A `kubernetes.client.Configuration` pointing at this server."""
        import kubernetes.client

        config = kubernetes.client.Configuration(host=self.url)
        config.verify_ssl = False
        return config

    def kubeconfig(self, *, namespace: str = "default") -> JsonObj:
        """A kubeconfig document for kubectl or `kubernetes.config.load_kube_config`."""
        return {
            "apiVersion": "v1", "kind": "Config", "current-context": "moonlease-local",
            "clusters": [{"name": "moonlease-local", "cluster": {"server": self.url}}],
            "users": [{"name": "moonlease-local", "user": {}}],
            "contexts": [{"name": "moonlease-local",
                          "context": {"cluster": "moonlease-local", "user": "moonlease-local",
                                      "namespace": namespace}}],
        }

    def write_kubeconfig(self, path: str | Path, *, namespace: str = "default") -> Path:
        target = Path(path)
        target.write_text(yaml.safe_dump(self.kubeconfig(namespace=namespace)), encoding="utf-8")
        return target

    # ---- objects --------------------------------------------------------------------------------

    async def create(self, body: Mapping[str, Any], *, namespace: str | None = None) -> JsonObj:
        return await self.emulator.create_object(None, body, namespace=namespace)

    async def apply_yaml(self, text: str, *, namespace: str | None = None) -> list[JsonObj]:
        """Create every document of a YAML stream (like `kubectl create -f`)."""
        return [await self.create(doc, namespace=namespace) for doc in yaml.safe_load_all(text) if doc]

    def get(self, what: Any, namespace: str | None, name: str) -> JsonObj | None:
        return self.emulator.read_object(what, namespace, name)

    def list(self, what: Any, namespace: str | None = None, *, label_selector: str | None = None) -> list[JsonObj]:
        return self.emulator.list_objects(what, namespace, label_selector=label_selector)

    async def patch(self, what: Any, namespace: str | None, name: str, patch: Any, *,
                    patch_type: str = "merge", subresource: str | None = None) -> JsonObj:
        return await self.emulator.patch_object(what, namespace, name, patch, patch_type=patch_type,
                                                subresource=subresource)

    async def delete(self, what: Any, namespace: str | None, name: str) -> JsonObj:
        return await self.emulator.delete_object(what, namespace, name)

    def history(self, what: Any, namespace: str | None, name: str) -> list[JsonObj | None]:
        return self.emulator.history(what, namespace, name)

    def events(self, namespace: str | None = None, *, involved_name: str | None = None,
               reason: str | None = None) -> list[JsonObj]:
        """Events, optionally only those about one object or with one reason."""
        found = self.emulator.list_objects(EVENTS, namespace)
        return [e for e in found
                if (involved_name is None or e.get("involvedObject", {}).get("name") == involved_name)
                and (reason is None or e.get("reason") == reason)]

    def api_calls(self) -> list[ApiCall]:
        return self.emulator.api_calls()

    def inject_failures(self, what: Any, namespace: str | None = None, name: str | None = None, *,
                        status: int = 409, count: int = 1, verbs: Iterable[str] = ("patch", "update"),
                        subresource: str | None = "*") -> InjectedFault:
        """See `ApiServerEmulator.inject_failures`: the next `count` matching HTTP requests fail."""
        return self.emulator.inject_failures(what, namespace, name, status=status, count=count, verbs=verbs,
                                             subresource=subresource)

    # ---- waiting --------------------------------------------------------------------------------

    async def wait_for(self, check: Callable[[], Any | Awaitable[Any]], *, timeout: float = 5.0,
                       interval: float = 0.02, what: str = "condition") -> Any:
        """Poll `check` (sync or async) until it returns something truthy; returns that value."""
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if asyncio.iscoroutine(value) or isinstance(value, Awaitable):
                value = await value
            if value:
                return value
            if time.monotonic() >= deadline:
                raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
            await asyncio.sleep(interval)


def default_crds() -> list[JsonObj]:
    """The project's CRDs, built from the models (imported lazily: the testbed must not need the
    operator package unless CRDs are wanted)."""
    from moonlease_operator.crd import build_crd

    return [build_crd()]


@contextlib.asynccontextmanager
async def local_api_server(*, crds: Sequence[Mapping[str, Any]] | None = None,
                           namespaces: Sequence[str] = ("default",), simulate: bool = True,
                           tick_interval: float = 0.05, host: str = "127.0.0.1",
                           port: int | None = None) -> AsyncIterator[LocalApiServer]:
    """Start the emulator on a free port (or `port`) with the backbone resources, `namespaces`,
    the CRDs (default: MooncakeLeasePolicy) and, if `simulate`, a ticking RolloutSimulator.

    Runs in the current event loop; clients in other threads (kopf's runner) reach it over HTTP.
    """
    crds = default_crds() if crds is None else list(crds)
    async with ApiServerEmulator() as emulator:
        async with kmock.Server(emulator, host=host, port=port) as server:
            api = LocalApiServer(emulator, server, RolloutSimulator(emulator))
            for ns in namespaces:
                await api.create(namespace_manifest(ns))
            for crd in crds:
                await api.create(crd)
            if simulate:
                api.simulator.start(tick_interval)
            try:
                yield api
            finally:
                await api.simulator.stop()


class LocalApiServerThread:
    """`local_api_server()` in a background thread with its own event loop, for synchronous
    programs (e.g. a demo driving subprocesses)::

        with LocalApiServerThread() as server, OperatorThread(connection=server.api.connection_info()):
            server.call(server.api.create(policy))
            server.call(server.api.wait_for(lambda: ...))

    Run writes and waits through `call` (they execute in the server's loop); `api.get`/`api.list`
    return deep copies and are safe to call from any thread.
    """

    def __init__(self, *, startup_timeout: float = 10.0, **server_options: Any) -> None:
        self.server_options = server_options
        self.startup_timeout = startup_timeout
        self._api: LocalApiServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @property
    def api(self) -> LocalApiServer:
        if self._api is None:
            raise RuntimeError("the server is not running")
        return self._api

    def start(self) -> LocalApiServer:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="local-api-server",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(self.startup_timeout) or self._api is None:
            raise RuntimeError("the local API server did not start") from self._error
        return self._api

    async def _main(self) -> None:
        try:
            async with local_api_server(**self.server_options) as api:
                self._loop, self._stopping, self._api = asyncio.get_running_loop(), asyncio.Event(), api
                self._ready.set()
                await self._stopping.wait()
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            self._ready.set()

    def call(self, awaitable: Awaitable[Any], *, timeout: float | None = 30.0) -> Any:
        """Run a coroutine in the server's loop and return its result."""
        if self._loop is None:
            raise RuntimeError("the server is not running")

        async def run() -> Any:
            return await awaitable

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)

    def stop(self) -> None:
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._api = self._loop = self._stopping = None

    def __enter__(self) -> LocalApiServerThread:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
