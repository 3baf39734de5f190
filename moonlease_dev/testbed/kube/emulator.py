"""The API server emulator: kmock's KubernetesEmulator with the semantics and limits of a real
Kubernetes API server that kopf and the operator depend on.

Not pure: it serves HTTP from the caller's event loop (see `server.py` for how it is started).

What kmock 0.8 leaves out and this emulator adds, each something a client could get wrong
against a real cluster and right here otherwise:

- resourceVersion: one cluster-wide counter, bumped on every write (a no-op write is not a new
  version); every write that carries a `metadata.resourceVersion` (PUT, merge/strategic/JSON
  patch, status writes) must carry the current one, else 409 Conflict; JSON-patch `test` ops;
  DELETE preconditions (resourceVersion, uid); PUT of a custom resource without one is 422.
  metadata.generation bumps on spec changes; uid, creationTimestamp, generateName (cut to 58
  characters) are server-set.
- Validation (422 Invalid with `details.causes`): object names (RFC 1123 subdomain; namespaces
  RFC 1123 label; services RFC 1035 label; CRDs `<plural>.<group>`), label keys and values
  (qualified names, values of at most 63 characters), annotation keys and their 256 KiB total,
  finalizer names — on the object and on a workload's pod template and selector; ConfigMap and
  Secret data keys and their 1 MiB total; CRD schemas (pruning, defaulting, openAPIV3Schema
  validation, then the CRD's CEL rules: see `cel`).
- Size: a request body over 3 MiB, or an object over 1.5 MiB as stored (etcd's limit,
  measured as compact JSON), answers 413 RequestEntityTooLarge.
- LIST: label selectors (syntax checked: 400 BadRequest), field selectors limited to the fields
  each resource supports (400 "field label not supported"), `limit`/`continue` pagination with
  consistent pages at the first page's resourceVersion (410 Expired once compacted), sorted by
  namespace/name, `remainingItemCount`.
- WATCH: from a resourceVersion, only later changes (from a bounded history per resource type;
  older than the history → an `ERROR` event with 410 Expired); `allowWatchBookmarks` →
  `BOOKMARK` events every `bookmark_interval`; `sendInitialEvents`; `timeoutSeconds`; selector
  transitions as ADDED/DELETED. `compact()` and `close_watches()` let tests break watches the
  way a real cluster does.
- The status subresource (writes to the object ignore status, writes to /status ignore
  everything else); JSON merge, JSON and strategic-merge patches; namespaces that must exist;
  CRDs that take effect when created; ownerReference cascade on deletion; 201 on create; list
  kinds; errors as `kind: Status` bodies.

- What kubectl reads: Table responses (`tables`), watch streams as `application/json`,
  server-side dry run (`dryRun=All`: admitted and answered, nothing written, no event), OpenAPI
  v2/v3 (`openapi`; built-in kinds' unknown fields dropped, or a 400 under fieldValidation=Strict;
  v2 also as gnostic's protobuf, `openapi_protobuf`, which is all client-go reads: kubectl's
  validation, `explain --output=plaintext-openapiv2`, Helm's `install --dry-run=server`), protobuf
  bodies of the kinds kubectl's typed commands send (`protobuf`),
  the `scale` subresource and Deployment/StatefulSet validation and defaulting (`workloads`),
  a CRD's CEL rules (`cel`), `/version` 1.32.
- Field managers and server-side apply (`managed_fields`): every HTTP write records its
  `fieldManager` (else the User-Agent's product) in metadata.managedFields; apply patches
  (`application/apply-patch+yaml`) merge, conflict (409, `force=true` takes over) and create.
  In-process writes (test helpers, the simulated controllers) record no manager.

Every HTTP request is recorded as an `ApiCall` (with its RBAC verb) and counted in `traffic`
(requests and response bytes per verb and resource). `inject_failures` makes the next N requests
to an object answer 409 or a 5xx, for testing clients' retries.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import secrets
import string
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import jsonpointer
import kmock
import yaml
from kmock._internal import parsing as kmock_parsing

from moonlease_dev.testbed.kube import errors
from moonlease_dev.testbed.kube.calls import ApiCall, Traffic, rbac_verb
from moonlease_dev.testbed.kube.cel import rule_errors
from moonlease_dev.testbed.kube.dispatch import dispatch
from moonlease_dev.testbed.kube.faults import FAULT_REASONS, InjectedFault
from moonlease_dev.testbed.kube.managed_fields import ApplyConflicts, apply_config, record_update
from moonlease_dev.testbed.kube.openapi import definition_name, openapi_v2, openapi_v3, openapi_v3_index, prune_builtin
from moonlease_dev.testbed.kube.openapi_protobuf import JSON_CONTENT_TYPE, encode_document, negotiate
from moonlease_dev.testbed.kube.pagination import decode_continue, page, parse_limit, sort_key
from moonlease_dev.testbed.kube.patches import PATCH_BODIES, merge_patch, strategic_merge_patch
from moonlease_dev.testbed.kube.protobuf import UnreadableBody, decode_object
from moonlease_dev.testbed.kube.resources import (
    BUILTIN_RESOURCES,
    CONFIGMAPS,
    CRDS,
    DEPLOYMENTS,
    NAMESPACES,
    SECRETS,
    STATEFULSETS,
    VERBS,
    ResourceType,
)
from moonlease_dev.testbed.kube.schemas import apply_schema_defaults, prune_unknown_fields, schema_errors
from moonlease_dev.testbed.kube.selectors import parse_field_selector, parse_label_selector
from moonlease_dev.testbed.kube.store_index import StoreIndex
from moonlease_dev.testbed.kube.tables import Column, columns_for, table, wants_table
from moonlease_dev.testbed.kube.timestamps import now_rfc3339
from moonlease_dev.testbed.kube.validation import (
    MAX_OBJECT_BYTES,
    MAX_REQUEST_BODY_BYTES,
    ErrorType,
    FieldError,
    config_data_errors,
    generated_name,
    object_meta_errors,
    selector_label_errors,
    stored_size,
)
from moonlease_dev.testbed.kube.watches import DEFAULT_WATCH_HISTORY, Change, WatchCache, WatchFilter
from moonlease_dev.testbed.kube.workloads import default_workload, scale_view, scaled, workload_errors

JsonObj = dict[str, Any]

#: Called with every write as it is published: (type, "ADDED" | "MODIFIED" | "DELETED", the
#: object as stored — read it, never change it).
WriteListener = Callable[[ResourceType, str, JsonObj], None]

_WRITE_METHODS = frozenset({"POST", "PUT", "PATCH"})
#: Request bodies that are not JSON: protobuf is read for some kinds (`protobuf`), the rest and
#: CBOR are answered 415.
PROTOBUF = "application/vnd.kubernetes.protobuf"
_UNREADABLE_BODIES = frozenset({PROTOBUF, "application/cbor", "application/apply-patch+cbor"})
#: What /version answers: a release the chart supports (kubectl warns beyond one minor of skew).
SERVER_VERSION: JsonObj = {
    "major": "1", "minor": "32", "gitVersion": "v1.32.0+moonlease", "gitCommit": "", "gitTreeState": "clean",
    "buildDate": "2024-12-11T00:00:00Z", "goVersion": "go1.23.3", "compiler": "gc", "platform": "linux/amd64",
}


def _namespace_aware_parse_path(path: str) -> kmock_parsing.ParsedPath:
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and (
            len(parts) <= 4 or (len(parts) == 5 and parts[4] in ("status", "finalize"))):
        return kmock_parsing.ParsedPath(group="", version="v1", plural="namespaces", namespace=None,
                                        name=parts[3] if len(parts) > 3 else None,
                                        subresource=parts[4] if len(parts) > 4 else None)
    return _KMOCK_PARSE_PATH(path)


_KMOCK_PARSE_PATH = kmock_parsing.parse_path


def _read_namespace_paths() -> None:
    """kmock 0.8 reads `/api/v1/namespaces[/<name>[/status]]` as "a namespace scope without a
    resource": listing namespaces raises ValueError (a 500) and fetching one answers discovery.
    kopf lists and watches namespaces when it serves chosen namespaces, so Namespace object paths
    are parsed first; every other path goes to kmock's parser unchanged. kmock parses requests
    before any handler sees them, hence a patch of its parser — installed when the first emulator
    is built (never at import), once."""
    if kmock_parsing.parse_path is not _namespace_aware_parse_path:
        kmock_parsing.parse_path = _namespace_aware_parse_path


@attrs.define(kw_only=True)
class ApiServerEmulator(kmock.KubernetesEmulator):
    """kmock's KubernetesEmulator with the object semantics of a real API server (see module doc).

    Objects live in kmock's `objects` array (so kmock-style assertions and per-object history
    work); every write goes through `create_object`/`patch_object`/`replace_object`/
    `delete_object`, from HTTP or from in-process helpers alike.
    """

    #: Changes per resource type that watches can resume from (older: 410 Gone).
    watch_history: int = DEFAULT_WATCH_HISTORY
    #: Seconds between BOOKMARK events on watches that allow them (the real server: a minute).
    bookmark_interval: float = 60.0
    max_object_bytes: int = MAX_OBJECT_BYTES
    #: Whether a CRD's CEL rules are evaluated at admission, as every supported API server does.
    #: Off: a server that stores what passes the schema alone (a CRD installed without its
    #: rules) — how tests reach the operator's own mirror of the rules.
    cel_rules: bool = True
    max_request_body_bytes: int = MAX_REQUEST_BODY_BYTES
    #: Requests and bytes served, per (RBAC verb, resource).
    traffic: Traffic = attrs.field(factory=Traffic, init=False)

    _types: dict[kmock.resource, ResourceType] = attrs.field(factory=dict, init=False)
    _kinds: dict[tuple[str, str], ResourceType] = attrs.field(factory=dict, init=False)
    _schemas: dict[kmock.resource, JsonObj] = attrs.field(factory=dict, init=False)
    #: A CRD version's additionalPrinterColumns, per custom resource type (Table responses).
    _printer_columns: dict[kmock.resource, list[JsonObj]] = attrs.field(factory=dict, init=False)
    _revision: int = attrs.field(default=0, init=False)
    _faults: list[InjectedFault] = attrs.field(factory=list, init=False)
    _watches: WatchCache = attrs.field(init=False)
    _index: StoreIndex = attrs.field(factory=StoreIndex, init=False)
    _listeners: list[WriteListener] = attrs.field(factory=list, init=False)
    #: The last /openapi/v2 protobuf encoding, by its document's ETag (encoding takes tens of ms).
    _openapi_v2_protobuf: tuple[str, bytes] = attrs.field(default=("", b""), init=False)

    def __attrs_post_init__(self) -> None:
        _read_namespace_paths()
        self._watches = WatchCache(self.watch_history)
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

    def register(self, rtype: ResourceType, schema: JsonObj | None = None,
                 printer_columns: list[JsonObj] | None = None) -> None:
        """Serve a resource type (discovery, CRUD); a schema applies to its objects' writes;
        `printer_columns` (a CRD's additionalPrinterColumns) shape its Table responses."""
        self._types[rtype.ref] = rtype
        self._kinds[(rtype.api_version, rtype.kind)] = rtype
        if schema is not None:
            self._schemas[rtype.ref] = schema
        if printer_columns is not None:
            self._printer_columns[rtype.ref] = printer_columns
        self.resources[rtype.ref] = kmock.ResourceInfo(
            kind=rtype.kind, singular=rtype.singular or rtype.kind.lower(), namespaced=rtype.namespaced,
            verbs=set(VERBS), shortnames=set(rtype.short_names), subresources=set(rtype.subresources),
        )

    def unregister(self, rtype: ResourceType) -> None:
        self._types.pop(rtype.ref, None)
        self._kinds.pop((rtype.api_version, rtype.kind), None)
        self._schemas.pop(rtype.ref, None)
        self._printer_columns.pop(rtype.ref, None)
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

    # ---- breaking watches the way a real cluster does -----------------------------------------

    def compact(self, revision: int | None = None) -> None:
        """Forget history at or below `revision` (default: now), as etcd's compaction does:
        watches and continue tokens from before it get 410 Gone."""
        self._watches.compact(self._revision if revision is None else revision)

    def close_watches(self, what: Any = None) -> int:
        """End the open watch streams (of one type, or all), as an API server restart would;
        returns how many were open. Clients reconnect from their last resourceVersion."""
        return self._watches.close_all(None if what is None else self.resource_type(what).ref)

    @property
    def open_watches(self) -> int:
        return self._watches.open_count

    def open_watches_of(self, what: Any) -> int:
        """Open watch streams of one resource type: a test that breaks a client's watch waits
        for that watch, not for any."""
        return self._watches.open_count_of(self.resource_type(what).ref)

    def expired_watches(self) -> list[tuple[str, int]]:
        """(resource plural, resourceVersion) of every watch answered 410 Gone so far."""
        return [(ref.plural or "", since) for ref, since in self._watches.expired]

    # ---- injected failures ------------------------------------------------------------------

    def inject_failures(self, what: Any, namespace: str | None = None, name: str | None = None, *,
                        status: int = 409, count: int = 1, verbs: Iterable[str] = ("patch", "update"),
                        subresource: str | None = "*") -> InjectedFault:
        """Make the next `count` HTTP requests with one of `verbs` (RBAC verbs: get, list, watch,
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
                    raise errors.conflict(rtype, request.name or "", "injected conflict: the object has been modified")
                raise errors.error(fault.status, FAULT_REASONS.get(fault.status, "InternalError"),
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

    def stored_object(self, what: Any, namespace: str | None, name: str) -> Mapping[str, Any] | None:
        """The live object as stored, not copied: read it, never change it (the simulated
        controllers read thousands of objects a tick; a deep copy each cost seconds)."""
        key = self._key(self.resource_type(what), namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return self.objects[key].raw

    def list_objects(self, what: Any, namespace: str | None = None, *,
                     label_selector: str | None = None, field_selector: str | None = None) -> list[JsonObj]:
        """Live objects of a type (deep copies, in creation order), optionally in one namespace
        and filtered (field selectors unrestricted here: this is the admin's view)."""
        rtype = self.resource_type(what)
        selection = WatchFilter(namespace=namespace,
                                labels=parse_label_selector(label_selector) if label_selector else (),
                                fields=parse_field_selector(field_selector) if field_selector else ())
        return self._select_live(rtype, selection)

    def _select_live(self, rtype: ResourceType, selection: WatchFilter) -> list[JsonObj]:
        """Live objects matching `selection` (deep copies, creation order)."""
        return [copy.deepcopy(raw) for raw in self._match_live(rtype, selection)]

    def _match_live(self, rtype: ResourceType, selection: WatchFilter) -> list[JsonObj]:
        """Live objects matching `selection`, as stored (read-only: copy what leaves the
        emulator), found through the index: the type, the namespace, the label terms."""
        found = []
        for key in self._index.live_keys(rtype.ref, selection.namespace, selection.labels):
            raw = self.objects[key].raw
            if selection.matches(raw):
                found.append(raw)
        return found

    def _match_at(self, rtype: ResourceType, selection: WatchFilter, revision: int) -> list[JsonObj]:
        """The objects as they were at `revision`, rebuilt from their histories (as stored,
        read-only)."""
        found = []
        for key in self._index.keys(rtype.ref, selection.namespace):
            state = None
            for version in self.objects[key].history:
                if version is None:  # a deletion, at the revision of the version before it
                    state = None
                    continue
                if int(version.raw.get("metadata", {}).get("resourceVersion", 0)) > revision:
                    break
                state = version.raw
            if state is not None and selection.matches(state):
                found.append(state)
        return found

    def live_names(self, what: Any, namespace: str | None = None) -> list[tuple[str | None, str]]:
        """(namespace, name) of every live object of a type, creation order, without copying
        any object."""
        return [(ns, name) for _, ns, name in self._index.live_keys(self.resource_type(what).ref, namespace)]

    def owned_objects(self, what: Any, uid: str) -> list[Mapping[str, Any]]:
        """Live objects of a type whose ownerReferences name `uid`, as stored (read-only, like
        `stored_object`), through the owner index: a controller's view of its dependents."""
        ref = self.resource_type(what).ref
        return [self.objects[key].raw for key in self._index.owned_by(uid) if key[0] == ref]

    def objects_by_owner(self, what: Any) -> dict[str, list[JsonObj]]:
        """Live objects of a type (deep copies) grouped by the uid of each owner they name."""
        rtype = self.resource_type(what)
        found: dict[str, list[JsonObj]] = {}
        for raw in self._match_live(rtype, WatchFilter(namespace=None)):
            for owner in raw.get("metadata", {}).get("ownerReferences") or []:
                found.setdefault(owner.get("uid", ""), []).append(copy.deepcopy(raw))
        return found

    def add_write_listener(self, listener: WriteListener) -> None:
        """Call `listener` with every write as it is published (synchronously, in the writer's
        task): how the simulated controllers act only on what changed instead of rescanning
        the store."""
        self._listeners.append(listener)

    def remove_write_listener(self, listener: WriteListener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

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

    def _publish(self, rtype: ResourceType, event_type: str, raw: JsonObj, previous: JsonObj | None = None) -> None:
        """Hand a write to the watches. Synchronous on purpose: between a revision being handed
        out and its event reaching the watch queues nothing else runs, so a BOOKMARK never claims
        a revision whose event is still on its way."""
        self._watches.record(rtype.ref, Change(int(raw["metadata"]["resourceVersion"]), event_type, raw, previous))
        meta = raw["metadata"]
        self._index.record(self._key(rtype, meta.get("namespace"), meta["name"]),
                           None if event_type == "DELETED" else raw)
        for listener in list(self._listeners):
            listener(rtype, event_type, raw)

    # ---- writes -----------------------------------------------------------------------------

    async def create_object(self, what: Any, body: Mapping[str, Any], *, namespace: str | None = None,
                            strict_fields: bool = False, dry_run: bool = False,
                            field_manager: str | None = None) -> JsonObj:
        """POST semantics: generated name, uid, resourceVersion, generation; 409 if it exists.
        `dry_run`: admitted and answered as if created, but nothing is stored or watched.
        `field_manager`: who owns the fields set (HTTP writes and the simulated controllers; other in-process writes record none)."""
        rtype = self.resource_type(what if what is not None else body)
        async with self._lock:
            return self._create(rtype, body, namespace, strict_fields, dry_run, field_manager)

    def _create(self, rtype: ResourceType, body: Mapping[str, Any], namespace: str | None, strict_fields: bool,
                dry_run: bool, field_manager: str | None) -> JsonObj:
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
            meta["name"] = generated_name(meta["generateName"], suffix)
        name = meta.get("name")
        if not name:
            raise errors.invalid(rtype, None, [FieldError("metadata.name", ErrorType.REQUIRED,
                                                          "name or generateName is required")])
        key = self._key(rtype, namespace, name)
        if key in self.objects and not self.objects[key].deleted:
            raise errors.already_exists(rtype, name)
        obj["apiVersion"], obj["kind"] = rtype.api_version, rtype.kind
        if rtype == CRDS:
            self._check_crd_name(obj)
        obj = self._admit(rtype, obj, strict_fields=strict_fields)
        meta = obj["metadata"]
        for server_field in ("deletionTimestamp", "deletionGracePeriodSeconds", "resourceVersion"):
            meta.pop(server_field, None)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_rfc3339()
        meta["generation"] = 1
        self._manage(rtype, None, obj, field_manager, None)
        if rtype == CRDS:
            obj = self._establish_crd(obj, serve=not dry_run)
        self._check_size(obj)
        if dry_run:
            return copy.deepcopy(obj)  # no resourceVersion: nothing was written
        meta = obj["metadata"]
        meta["resourceVersion"] = self._next_revision()
        if key in self.objects:
            self.objects[key].create(obj)
        else:
            self.objects[key] = obj
        self._publish(rtype, "ADDED", obj)
        return copy.deepcopy(obj)

    async def patch_object(self, what: Any, namespace: str | None, name: str, patch: Any, *,
                           patch_type: str = "merge", subresource: str | None = None,
                           strict_fields: bool = False, dry_run: bool = False,
                           field_manager: str | None = None) -> JsonObj:
        """PATCH semantics. `patch_type`: "merge", "json" or "strategic" (server-side apply:
        `apply_object`)."""
        rtype = self.resource_type(what)
        if patch_type == "strategic" and rtype.custom:
            raise errors.error(415, "UnsupportedMediaType",
                               "strategic merge patch is not supported for custom resources")
        async with self._lock:
            current = self._live(rtype, namespace, name)
            target = self._scale_of(rtype, current) if subresource == "scale" else current
            try:
                match patch_type:
                    case "merge":
                        if not isinstance(patch, Mapping):
                            raise errors.bad_request("a merge patch must be a JSON object")
                        patched = merge_patch(target, patch)
                    case "strategic":
                        if not isinstance(patch, Mapping):
                            raise errors.bad_request("a strategic merge patch must be a JSON object")
                        patched = strategic_merge_patch(target, patch)
                    case "json":
                        patched = jsonpatch.apply_patch(target, list(patch), in_place=False)
                    case _:
                        raise errors.error(415, "UnsupportedMediaType", f"unsupported patch type {patch_type!r}")
            except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
                raise errors.error(422, "Invalid", f"the JSON patch could not be applied: {exc}") from None
            if not isinstance(patched, Mapping):
                raise errors.bad_request("the patched object is not a JSON object")
            self._check_precondition(rtype, name, current, patched)
            if subresource == "scale":
                return self._write_scale(rtype, current, patched, strict_fields, dry_run, field_manager)
            return self._store_update(rtype, current, dict(patched), subresource, strict_fields, dry_run,
                                      field_manager)

    async def apply_object(self, what: Any, namespace: str | None, name: str, config: Mapping[str, Any], *,
                           field_manager: str, force: bool = False, strict_fields: bool = False,
                           dry_run: bool = False) -> tuple[JsonObj, bool]:
        """Server-side apply (see `managed_fields`): the object, and whether it was created.
        409 with the conflicting managers and fields unless `force`."""
        rtype = self.resource_type(what)
        body_name = (config.get("metadata") or {}).get("name")
        if body_name != name:
            raise errors.bad_request(f'the name of the object ({body_name}) does not match the name on the URL'
                                     f' ({name})')
        if (config.get("apiVersion"), config.get("kind")) != (rtype.api_version, rtype.kind):
            raise errors.bad_request(f"the apiVersion and kind of the object ({config.get('apiVersion')}, "
                                     f"{config.get('kind')}) do not match the URL ({rtype.api_version}, {rtype.kind})")
        async with self._lock:
            key = self._key(rtype, namespace, name)
            exists = key in self.objects and not self.objects[key].deleted
            current = self._live(rtype, namespace, name) if exists else None
            if current is not None:
                self._check_precondition(rtype, name, current, config)
            entries = list((current or {}).get("metadata", {}).get("managedFields") or [])
            try:
                merged, managed = apply_config(
                    entries, field_manager, current, config, schema=self._schemas.get(rtype.ref),
                    api_version=rtype.api_version, now=now_rfc3339(), force=force,
                    has_status="status" in rtype.subresources)
            except ApplyConflicts as conflicts:
                raise errors.error(409, "Conflict", conflicts.message, {"causes": conflicts.causes()}) from None
            merged.setdefault("metadata", {})["managedFields"] = managed
            if current is None:
                merged["metadata"].pop("resourceVersion", None)
                return self._create(rtype, merged, namespace, strict_fields, dry_run, None), True
            return self._store_update(rtype, current, merged, None, strict_fields, dry_run), False

    async def replace_object(self, what: Any, namespace: str | None, name: str, body: Mapping[str, Any], *,
                             subresource: str | None = None, strict_fields: bool = False,
                             dry_run: bool = False, field_manager: str | None = None) -> JsonObj:
        """PUT semantics: a full replacement, refused with 409 if resourceVersion is stale (and
        with 422 if a custom resource's is missing)."""
        rtype = self.resource_type(what)
        async with self._lock:
            current = self._live(rtype, namespace, name)
            new = copy.deepcopy(dict(body))
            if not new.get("metadata", {}).get("resourceVersion") and not rtype.unconditional_update:
                raise errors.invalid(rtype, name, [FieldError("metadata.resourceVersion", ErrorType.INVALID,
                                                              "must be specified for an update", 0)])
            self._check_precondition(rtype, name, current, new)
            if subresource == "scale":
                return self._write_scale(rtype, current, new, strict_fields, dry_run, field_manager)
            return self._store_update(rtype, current, new, subresource, strict_fields, dry_run, field_manager)

    async def delete_object(self, what: Any, namespace: str | None, name: str, *,
                            preconditions: Mapping[str, Any] | None = None, dry_run: bool = False) -> JsonObj:
        """DELETE semantics: preconditions (resourceVersion, uid) must hold; finalizers defer
        deletion (deletionTimestamp); owned objects follow. `dry_run`: checked and answered,
        nothing removed."""
        rtype = self.resource_type(what)
        async with self._lock:
            current = self._live(rtype, namespace, name)
            meta = current["metadata"]
            for field, label in (("resourceVersion", "ResourceVersion"), ("uid", "UID")):
                wanted = (preconditions or {}).get(field)
                if wanted is not None and wanted != meta.get(field):
                    hint = "modified" if field == "resourceVersion" else "deleted and then recreated"
                    raise errors.conflict(rtype, name, f"the {label} in the precondition ({wanted}) does not"
                                                       f" match the {label} in record ({meta.get(field)})."
                                                       f" The object might have been {hint}")
            if dry_run:
                if meta.get("finalizers") and not meta.get("deletionTimestamp"):
                    meta["deletionTimestamp"] = now_rfc3339()
                return current  # `_live` made it a copy
            if meta.get("finalizers"):
                if not meta.get("deletionTimestamp"):
                    previous = copy.deepcopy(current)
                    meta["deletionTimestamp"] = now_rfc3339()
                    meta["resourceVersion"] = self._next_revision()
                    self.objects[self._key(rtype, namespace, name)].history.append(current)
                    self._publish(rtype, "MODIFIED", current, previous)
                return copy.deepcopy(current)
            self._remove(rtype, current)
            return current

    def _check_precondition(self, rtype: ResourceType, name: str, current: Mapping[str, Any],
                            new: Mapping[str, Any]) -> None:
        """A write that names a resourceVersion must name the current one (optimistic locking)."""
        sent = (new.get("metadata") or {}).get("resourceVersion")
        if sent not in (None, "") and sent != current["metadata"]["resourceVersion"]:
            raise errors.conflict(rtype, name, errors.STALE_OBJECT)

    def _scale_of(self, rtype: ResourceType, obj: Mapping[str, Any]) -> JsonObj:
        if "scale" not in rtype.subresources:
            raise errors.error(404, "NotFound", "the server could not find the requested resource")
        return scale_view(obj)

    def _write_scale(self, rtype: ResourceType, current: JsonObj, scale: Mapping[str, Any], strict_fields: bool,
                     dry_run: bool, field_manager: str | None = None) -> JsonObj:
        """A write to `/scale`: only the replicas change; the answer is the new Scale."""
        replicas = (scale.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise errors.invalid(rtype, current["metadata"]["name"], [FieldError(
                "spec.replicas", ErrorType.INVALID, "must be greater than or equal to 0", replicas)])
        return scale_view(self._store_update(rtype, current, scaled(current, scale), None, strict_fields, dry_run,
                                             field_manager, manager_subresource="scale"))

    def _live(self, rtype: ResourceType, namespace: str | None, name: str) -> JsonObj:
        key = self._key(rtype, namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            raise errors.not_found(rtype, name)
        return copy.deepcopy(self.objects[key].raw)

    def _require_namespace(self, namespace: str | None) -> None:
        key = self._key(NAMESPACES, None, namespace or "")
        if key not in self.objects or self.objects[key].deleted:
            raise errors.not_found(NAMESPACES, namespace)

    def _store_update(self, rtype: ResourceType, current: JsonObj, new: JsonObj,
                      subresource: str | None, strict_fields: bool, dry_run: bool = False,
                      field_manager: str | None = None, *, manager_subresource: str | None = None) -> JsonObj:
        meta_now = current["metadata"]
        has_status = "status" in rtype.subresources
        if subresource == "status":
            # Writes to /status change the status and nothing else. `current` is this write's own
            # copy: the new version may share its unchanged parts (metadata is copied below).
            merged = dict(current)
            if "status" in new:
                merged["status"] = new["status"]
            else:
                merged.pop("status", None)
            new = merged
        elif subresource:
            raise errors.error(405, "MethodNotAllowed", f"subresource {subresource!r} is not writable here")
        elif has_status:
            # Writes to the object keep the status as it was.
            new = {k: v for k, v in new.items() if k != "status"}
            if "status" in current:
                new["status"] = copy.deepcopy(current["status"])
        new["apiVersion"], new["kind"] = rtype.api_version, rtype.kind
        meta = new["metadata"] = dict(new.get("metadata") or {})  # changed below, never `current`'s
        # Identity and server-owned fields cannot change.
        for fixed in ("name", "namespace", "uid", "creationTimestamp", "generation", "deletionTimestamp"):
            if fixed in meta_now:
                meta[fixed] = meta_now[fixed]
            else:
                meta.pop(fixed, None)
        new = self._admit(rtype, new, strict_fields=strict_fields, old=current)
        meta = new["metadata"]
        if _spec_of(new) != _spec_of(current):
            meta["generation"] = int(meta_now.get("generation", 1)) + 1
        if rtype == CRDS:
            new = self._establish_crd(new, serve=not dry_run)
            meta = new["metadata"]
        meta["resourceVersion"] = meta_now["resourceVersion"]
        self._manage(rtype, current, new, field_manager, manager_subresource or subresource)
        if _without_times(new) == _without_times(current):
            return copy.deepcopy(current)  # a no-op write: no new version, no event (as etcd)
        self._check_size(new)
        if dry_run:
            return copy.deepcopy(new)  # the current resourceVersion: nothing was written
        meta["resourceVersion"] = self._next_revision()
        if meta.get("deletionTimestamp") and not meta.get("finalizers"):
            self._remove(rtype, new)
            return copy.deepcopy(new)
        self.objects[self._key(rtype, meta.get("namespace"), meta["name"])].history.append(new)
        self._publish(rtype, "MODIFIED", new, current)
        return copy.deepcopy(new)

    def _manage(self, rtype: ResourceType, old: JsonObj | None, new: JsonObj, field_manager: str | None,
                subresource: str | None) -> None:
        """Set `new`'s managedFields: those the client sent if it changed them (kubectl's
        client-side to server-side apply upgrade does), else the stored ones; then the update of
        `field_manager`, if any, recorded on them (see `managed_fields`)."""
        meta = new["metadata"]
        before = (old or {}).get("metadata", {}).get("managedFields")
        given = meta.get("managedFields") if "managedFields" in meta else before
        entries = list(given) if isinstance(given, list) else list(before or [])
        if field_manager is not None and (subresource != "status" or old is not None):
            entries = record_update(entries, field_manager, old, new, schema=self._schemas.get(rtype.ref),
                                    api_version=rtype.api_version, now=now_rfc3339(), subresource=subresource,
                                    has_status="status" in rtype.subresources)
        if entries:
            meta["managedFields"] = entries
        else:
            meta.pop("managedFields", None)

    def _remove(self, rtype: ResourceType, obj: JsonObj) -> None:
        meta = obj["metadata"]
        key = self._key(rtype, meta.get("namespace"), meta["name"])
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = self._next_revision()
        self.objects[key].history.append(obj)
        self.objects[key].delete()
        self._publish(rtype, "DELETED", obj)
        if rtype == CRDS:
            self._forget_crd(obj)
        # Cascade to dependents (foreground/background GC collapsed into "right away").
        for key in self._index.owned_by(meta.get("uid") or ""):
            other = self.objects[key]
            dtype = self._types.get(key[0])
            if dtype is not None and not other.deleted:
                self._remove(dtype, copy.deepcopy(other.raw))

    def _admit(self, rtype: ResourceType, obj: JsonObj, *, strict_fields: bool,
               old: JsonObj | None = None) -> JsonObj:
        """Validate metadata (and ConfigMap/Secret data); prune, default and validate custom
        resources against their CRD's schema, then its CEL rules (`old`: the stored version on
        an update, for transition rules and ratcheting)."""
        name = obj.get("metadata", {}).get("name")
        problems: list[FieldError | str] = list(object_meta_errors(obj, rtype.name_rule))
        if rtype in (CONFIGMAPS, SECRETS):
            problems += config_data_errors(obj)
        if rtype in (DEPLOYMENTS, STATEFULSETS):
            obj = default_workload(obj)
            problems += workload_errors(obj)
        if problems:
            raise errors.invalid(rtype, name, problems)
        if not rtype.custom:
            # A built-in kind decodes into its Go type: unknown fields are dropped, or refused
            # under fieldValidation=Strict (what kubectl sends by default).
            obj, dropped = prune_builtin(obj, definition_name(rtype))
            if dropped and strict_fields:
                raise errors.bad_request(
                    f'{rtype.kind} in version "{rtype.version}" cannot be handled as a {rtype.kind}: strict decoding'
                    f' error: ' + ", ".join(f'unknown field "{path}"' for path in dropped))
        schema = self._schemas.get(rtype.ref)
        if schema is None:
            return obj
        pruned, dropped = prune_unknown_fields(obj, schema)
        if dropped and strict_fields:
            raise errors.bad_request(f'{rtype.kind} "{name}": unknown fields: {", ".join(dropped)}')
        defaulted = apply_schema_defaults(pruned, schema)
        problems = list(schema_errors(defaulted, schema))
        if problems:
            raise errors.invalid(rtype, name, problems)
        cel_problems = rule_errors(defaulted, schema, old) if self.cel_rules else []
        if cel_problems:
            raise errors.invalid(rtype, name, cel_problems)
        return defaulted

    def _check_size(self, obj: JsonObj) -> None:
        if stored_size(obj) > self.max_object_bytes:
            # What kube-apiserver answers when etcd refuses the write (kubernetes#74600).
            raise errors.too_large("etcdserver: request is too large")

    # ---- CRDs take effect when stored ---------------------------------------------------------

    def _check_crd_name(self, crd: JsonObj) -> None:
        spec = crd.get("spec", {})
        expected = f"{spec.get('names', {}).get('plural')}.{spec.get('group')}"
        name = crd.get("metadata", {}).get("name")
        if name != expected:
            raise errors.invalid(CRDS, name, [FieldError("metadata.name", ErrorType.INVALID,
                                                         'must be spec.names.plural+"."+spec.group', name)])

    def _establish_crd(self, crd: JsonObj, *, serve: bool = True) -> JsonObj:
        """The CRD with its status as the API server sets it; `serve`: its types are served
        from now on (not for a dry run)."""
        spec = crd.get("spec", {})
        names = spec.get("names", {})
        for version in spec.get("versions", []):
            if not serve or not version.get("served", True):
                continue
            rtype = ResourceType(
                group=spec["group"], version=version["name"], plural=names["plural"], kind=names["kind"],
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                subresources=frozenset(version.get("subresources", {}) or {}),
                short_names=tuple(names.get("shortNames", ())), singular=names.get("singular", ""),
                custom=True,
                field_labels=frozenset(f.get("jsonPath", "").lstrip(".")
                                       for f in version.get("selectableFields", []) or []),
            )
            self.register(rtype, (version.get("schema") or {}).get("openAPIV3Schema"),
                          list(version.get("additionalPrinterColumns") or []))
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

    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        # A protobuf body is not text: kmock would fail decoding it (a 500) before any handler
        # ran. The kinds kubectl's typed commands send are read into JSON (the request goes on
        # as if sent as JSON); anything else gets the real server's answer to a body type it
        # cannot decode, a 415 Status.
        content_type = (raw_request.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if raw_request.method.upper() in _WRITE_METHODS and content_type in _UNREADABLE_BODIES:
            # A clone that claims JSON (cloned before the body is read: aiohttp's rule).
            as_json = raw_request.clone(headers={**raw_request.headers, "Content-Type": JSON})
            body = await as_json.read()
            try:
                if content_type != PROTOBUF:
                    raise UnreadableBody(content_type)
                decoded = json.dumps(decode_object(body)).encode()
            except UnreadableBody as why:
                exc = _unreadable_body(str(why))
                return aiohttp.web.json_response(
                    errors.status_body(exc.status, exc.reason or "", exc.message or "", exc.details), status=415)
            as_json._read_bytes = decoded  # what read(), text() and json() answer from now on
            raw_request = as_json
        return await super().__call__(raw_request)

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        # Skip KubernetesEmulator._handle: its write interception (no resourceVersion, merge-only
        # patches) is replaced by the _serve_* fallbacks below, which write only when no user
        # reaction intercepted the request first.
        verb, resource = _call_verb(request), _call_resource(request)
        self.traffic.count_request(verb, resource)
        if request.url.path.startswith("/openapi/") and str(request.method.value).upper() == "GET":
            return self._serve_openapi(request)
        if str(request.method.value).upper() in _WRITE_METHODS and len(request.body) > self.max_request_body_bytes:
            raise errors.too_large(f"Request entity too large: limit is {self.max_request_body_bytes}")
        response = await dispatch(self, request)  # RawHandler._handle's, in constant time per reaction
        if isinstance(response, aiohttp.web.Response) and isinstance(response.body, bytes | bytearray):
            self.traffic.count_bytes(verb, resource, len(response.body))
        return response

    def _serve_openapi(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        """/openapi/v2, /openapi/v3 and /openapi/v3/<group-version>, built from the served types
        and the schemas held now (a CRD created later shows up in the next request)."""
        path = request.url.path
        types = [(rtype, self._schemas.get(ref)) for ref, rtype in self._types.items()]
        if path == "/openapi/v2":
            return self._serve_openapi_v2(openapi_v2(types), request.headers)
        documents = openapi_v3(types)
        if path == "/openapi/v3":
            return aiohttp.web.json_response(openapi_v3_index(documents))
        document = documents.get(path.removeprefix("/openapi/v3/"))
        if document is None:
            raise errors.error(404, "NotFound", "the server could not find the requested resource")
        return aiohttp.web.json_response(document)

    def _serve_openapi_v2(self, document: JsonObj, headers: Mapping[str, str]) -> aiohttp.web.StreamResponse:
        """The v2 document as kube-openapi's handler serves it: JSON, or gnostic's protobuf to
        a client whose Accept asks for it first (client-go always does), 406 to one that takes
        neither; `Vary: Accept` and one quoted ETag (the JSON's SHA-512) for both encodings, 304
        when `If-None-Match` has it."""
        body = json.dumps(document).encode()
        etag = hashlib.sha512(body).hexdigest().upper()
        content_type = negotiate(headers.get("Accept"))
        answer = {"Vary": "Accept", "Cache-Control": "no-cache, private"}
        if content_type is None:
            return aiohttp.web.Response(status=406, headers=answer)
        answer |= {"Content-Type": content_type, "ETag": f'"{etag}"'}
        if etag in (headers.get("If-None-Match") or ""):
            return aiohttp.web.Response(status=304, headers=answer)
        if content_type != JSON_CONTENT_TYPE:
            if self._openapi_v2_protobuf[0] != etag:
                self._openapi_v2_protobuf = (etag, encode_document(document))
            body = self._openapi_v2_protobuf[1]
        return aiohttp.web.Response(body=body, headers=answer)

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        if isinstance(exc, kmock.KubernetesNotFoundError):
            # kmock's own 404s (unknown resource or path) carry made-up reasons; the real server's:
            exc = errors.error(404, "NotFound", "the server could not find the requested resource")
        if isinstance(exc, kmock.KubernetesError):
            body = errors.status_body(exc.status, exc.reason or "InternalError", exc.message or "", exc.details)
            return aiohttp.web.json_response(body, status=exc.status)
        return await super()._render_error(exc)  # an emulator bug: keep kmock's traceback

    async def _stream_error(self, exc: Exception, raw_response: aiohttp.web.StreamResponse) -> None:
        if isinstance(exc, kmock.KubernetesError):
            body = errors.status_body(exc.status, exc.reason or "InternalError", exc.message or "", exc.details)
            await raw_response.write(json.dumps({"type": "ERROR", "object": body}).encode() + b"\n")
        else:
            await super()._stream_error(exc, raw_response)

    async def _serve_server_version(self, request: kmock.Request) -> kmock.Payload:
        return dict(SERVER_VERSION)

    async def _serve_version(self, request: kmock.Request) -> kmock.Payload:
        payload = await super()._serve_version(request)
        if isinstance(payload, dict) and payload.get("groupVersion", "").startswith("/"):
            payload["groupVersion"] = payload["groupVersion"][1:]  # the core group is "v1", not "/v1"
        for entry in payload.get("resources", []) if isinstance(payload, dict) else []:
            if "/" in entry["name"]:
                # Subresources have no short names or categories (kmock copies the resource's,
                # and kubectl then warns that `deploy` could mean deployments/scale).
                entry["shortNames"], entry["categories"] = [], []
                entry["singularName"] = ""
        return payload

    def _request_type(self, request: kmock.Request) -> ResourceType:
        res = request.resource
        if res is None or res.version is None or res.plural is None:
            # Discovery (/api/v1, /apis/<group>/<version>): let the scaffold's handlers answer.
            # NotImplementedError passes the request on without disabling this reaction.
            raise NotImplementedError
        rtype = self._types.get(res)
        if rtype is None:
            raise kmock.KubernetesResourceNotFoundError()
        return rtype

    def _selection(self, rtype: ResourceType, request: kmock.Request, *, name: str | None = None) -> WatchFilter:
        """The request's namespace, selectors and (for a watch on one object) name, checked as
        the real server checks them (400 BadRequest)."""
        label_text = request.params.get("labelSelector") or ""
        field_text = request.params.get("fieldSelector") or ""
        try:
            labels = parse_label_selector(label_text)
            fields = parse_field_selector(field_text)
        except ValueError as exc:
            raise errors.bad_request(str(exc)) from None
        problems = selector_label_errors((term.key, term.values) for term in labels)
        if problems:
            raise errors.bad_request(f"unable to parse requirement: {'; '.join(problems)}")
        for term in fields:
            if term.path not in rtype.supported_field_labels:
                raise errors.bad_request(f'field label not supported: {term.path}')
        return WatchFilter(namespace=request.namespace if rtype.namespaced else None, name=name,
                           labels=labels, fields=fields)

    def _requested_revision(self, request: kmock.Request) -> int | None:
        """`resourceVersion`: None for "" and "0" (any), else a number not from the future."""
        text = request.params.get("resourceVersion") or ""
        if text in ("", "0"):
            return None
        try:
            revision = int(text)
        except ValueError:
            raise errors.bad_request(f'resourceVersion: Invalid value: "{text}": must be a number') from None
        if revision > self._revision:
            raise errors.error(504, "Timeout", f"Too large resource version: {revision}, current: {self._revision}",
                               {"causes": [{"reason": "ResourceVersionTooLarge",
                                            "message": "Too large resource version"}], "retryAfterSeconds": 1})
        return revision

    async def _serve_list(self, request: kmock.Request) -> kmock.Payload:
        rtype = self._request_type(request)
        self._check_faults(rtype, request, "list")
        selection = self._selection(rtype, request)
        try:
            limit = parse_limit(request.params.get("limit"))
            token = decode_continue(request.params["continue"]) if request.params.get("continue") else None
        except ValueError as exc:
            raise errors.bad_request(str(exc)) from None
        self._requested_revision(request)
        async with self._lock:
            if token is None:
                revision, start = self._revision, ""
                items = self._match_live(rtype, selection)
            else:
                if token.revision < self._watches.horizon(rtype.ref):
                    raise errors.expired("The provided continue parameter is too old to display a consistent list"
                                         " result. You can start a new list without the continue parameter.")
                revision, start = token.revision, token.start
                items = self._match_at(rtype, selection, revision)
            items.sort(key=sort_key)
            chosen = page(items, revision=revision, limit=limit, start=start)
            shown = copy.deepcopy(chosen.items)  # only the page leaves the store, not every match
        metadata: JsonObj = {"resourceVersion": str(revision)}
        if chosen.next_token is not None:
            metadata["continue"] = chosen.next_token
            metadata["remainingItemCount"] = chosen.remaining
        if wants_table(request.headers.get("Accept")):
            return _json(table(self._columns(rtype), shown, list_meta=metadata,
                               include_object=_include_object(request)), TABLE_CONTENT_TYPE)
        return _json({"apiVersion": rtype.api_version, "kind": f"{rtype.kind}List", "metadata": metadata,
                      "items": shown})

    def _columns(self, rtype: ResourceType) -> tuple[Column, ...]:
        return columns_for(rtype.group, rtype.kind, self._printer_columns.get(rtype.ref))

    async def _serve_watch(self, request: kmock.Request) -> kmock.Payload:  # type: ignore[override]
        """A watch stream as Go clients read it: `application/json`, one event per line (the
        objects Tables when the client asked for them, as `kubectl get -w` does)."""
        rtype = self._request_type(request)
        self._check_faults(rtype, request, "watch")
        return kmock.Response(payload=self._watch_stream(rtype, request), headers={"Content-Type": JSON})

    async def _watch_stream(self, rtype: ResourceType, request: kmock.Request) -> AsyncIterator[kmock.Payload]:
        selection = self._selection(rtype, request, name=request.name)
        since = self._requested_revision(request)
        params = request.params
        bookmarks = params.get("allowWatchBookmarks") in ("true", "1")
        initial_events = params.get("sendInitialEvents") in ("true", "1")
        timeout = float(params["timeoutSeconds"]) if params.get("timeoutSeconds") else None
        verb, resource = "watch", rtype.plural
        async with self._lock:  # the snapshot and the subscription together: no event falls between
            if since is None or initial_events:
                first: list[JsonObj] | None = [{"type": "ADDED", "object": obj} for obj in
                                               sorted(self._select_live(rtype, selection), key=sort_key)]
            else:
                first = self._watches.replay(rtype.ref, since, selection)
            watch = self._watches.open(rtype.ref, selection) if first is not None else None
            horizon = self._watches.horizon(rtype.ref)

        as_table = wants_table(request.headers.get("Accept"))
        columns, include, columns_sent = self._columns(rtype), _include_object(request), False

        def encode(event: JsonObj) -> bytes:
            nonlocal columns_sent
            if as_table and event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                # The first Table carries the column definitions, later ones only their row.
                shown = table(columns, [event["object"]], list_meta={}, include_object=include)
                if columns_sent:
                    shown["columnDefinitions"] = []
                event, columns_sent = {"type": event["type"], "object": shown}, True
            data = json.dumps(event).encode() + b"\n"
            self.traffic.count_bytes(verb, resource, len(data))
            return data

        yield b""  # send the headers now, even if nothing happens for a while
        if watch is None or first is None:
            yield encode({"type": "ERROR", "object": errors.status_body(
                410, "Expired", f"too old resource version: {since} ({horizon})")})
            return
        try:
            for initial in first:
                yield encode(initial)
            if initial_events and bookmarks:
                yield encode(self._bookmark(rtype, initial_events_end=True))
            loop = asyncio.get_running_loop()
            deadline = None if timeout is None else loop.time() + timeout
            next_bookmark = loop.time() + self.bookmark_interval
            while True:
                now = loop.time()
                waits = ([next_bookmark - now] if bookmarks else []) + ([deadline - now] if deadline else [])
                try:
                    event = await asyncio.wait_for(watch.queue.get(), max(0.0, min(waits)) if waits else None)
                except TimeoutError:
                    if deadline is not None and loop.time() >= deadline:
                        return  # timeoutSeconds: the server ends the watch; the client resumes
                    yield encode(self._bookmark(rtype))
                    next_bookmark = loop.time() + self.bookmark_interval
                    continue
                if event is None:
                    return  # closed by close_watches()
                yield encode(event)
        finally:
            self._watches.close(watch)

    def _bookmark(self, rtype: ResourceType, *, initial_events_end: bool = False) -> JsonObj:
        """Only the resourceVersion matters: every change up to it was sent (the queue is empty)."""
        meta: JsonObj = {"resourceVersion": str(self._revision)}
        if initial_events_end:
            meta["annotations"] = {"k8s.io/initial-events-end": "true"}
        return {"type": "BOOKMARK", "object": {"kind": rtype.kind, "apiVersion": rtype.api_version, "metadata": meta}}

    async def _serve_fetch(self, request: kmock.Request) -> kmock.Payload:
        rtype = self._request_type(request)
        self._check_faults(rtype, request, "get")
        assert request.name is not None
        obj = self.read_object(rtype, request.namespace, request.name)
        if obj is None:
            raise errors.not_found(rtype, request.name)
        if request.subresource == "scale":
            return _json(self._scale_of(rtype, obj))
        if wants_table(request.headers.get("Accept")):
            return _json(table(self._columns(rtype), [obj], list_meta={"resourceVersion": obj["metadata"].get(
                "resourceVersion", "")}, include_object=_include_object(request)), TABLE_CONTENT_TYPE)
        return _json(obj)

    async def _serve_create(self, request: kmock.Request) -> kmock.Payload:
        rtype = self._request_type(request)
        self._check_faults(rtype, request, "create")
        if not isinstance(request.data, Mapping):
            raise errors.bad_request("the request body must be a JSON object")
        if rtype.namespaced and request.namespace is None:
            raise errors.error(405, "MethodNotAllowed", "create a namespaced object under /namespaces/<ns>/")
        body_ns = request.data.get("metadata", {}).get("namespace")
        if rtype.namespaced and body_ns not in (None, request.namespace):
            raise errors.bad_request("the namespace of the provided object does not match the namespace sent on"
                                     " the request")
        if request.data.get("metadata", {}).get("resourceVersion"):
            raise errors.bad_request("resourceVersion should not be set on objects to be created")
        obj = await self.create_object(rtype, request.data, namespace=request.namespace,
                                       strict_fields=_strict(request), dry_run=_dry_run(request),
                                       field_manager=_field_manager(request))
        return _json(obj, status=201)

    async def _serve_update(self, request: kmock.Request) -> kmock.Payload:
        rtype = self._request_type(request)
        self._check_faults(rtype, request, "patch")
        assert request.name is not None
        content_type = (request.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        patch_type = PATCH_BODIES.get(content_type)
        if patch_type is None:
            raise errors.error(415, "UnsupportedMediaType",
                               f"the body of the request was in an unknown format ({content_type or 'none'}) -"
                               f" accepted media types include: application/json-patch+json,"
                               f" application/merge-patch+json, application/apply-patch+yaml,"
                               f" application/strategic-merge-patch+json")
        force = request.params.get("force")
        if patch_type != "apply" and force is not None:
            raise errors.error(422, "Invalid", 'PatchOptions.meta.k8s.io "" is invalid: force: Forbidden: may not be'
                                               ' specified for non-apply patch')
        if patch_type == "apply":
            return await self._serve_apply(rtype, request, force == "true")
        return _json(await self.patch_object(rtype, request.namespace, request.name, request.data,
                                             patch_type=patch_type, subresource=request.subresource,
                                             strict_fields=_strict(request), dry_run=_dry_run(request),
                                             field_manager=_field_manager(request)))

    async def _serve_apply(self, rtype: ResourceType, request: kmock.Request, force: bool) -> kmock.Payload:
        manager = request.params.get("fieldManager")
        if not manager:
            raise errors.error(422, "Invalid", 'PatchOptions.meta.k8s.io "" is invalid: fieldManager: Required'
                                               ' value: is required for apply patch')
        if request.subresource:
            raise errors.error(405, "MethodNotAllowed", "server-side apply of a subresource is not emulated")
        try:
            config = _apply_body(bytes(request.body).decode() or "{}")
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise errors.bad_request(f"error decoding YAML: {exc}") from None
        if not isinstance(config, Mapping):
            raise errors.bad_request("the applied configuration must be an object")
        assert request.name is not None
        obj, created = await self.apply_object(rtype, request.namespace, request.name, config, field_manager=manager,
                                               force=force, strict_fields=_strict(request), dry_run=_dry_run(request))
        return _json(obj, status=201 if created else None)

    async def _serve_replace(self, request: kmock.Request) -> kmock.Payload:
        if request.name is None:
            raise kmock.KubernetesEndpointNotFoundError()
        rtype = self._request_type(request)
        self._check_faults(rtype, request, "update")
        if not isinstance(request.data, Mapping):
            raise errors.bad_request("the request body must be a JSON object")
        return _json(await self.replace_object(rtype, request.namespace, request.name, request.data,
                                               subresource=request.subresource, strict_fields=_strict(request),
                                               dry_run=_dry_run(request), field_manager=_field_manager(request)))

    async def _serve_delete(self, request: kmock.Request) -> kmock.Payload:
        rtype = self._request_type(request)
        self._check_faults(rtype, request, "delete")
        assert request.name is not None
        options = request.data if isinstance(request.data, Mapping) else {}
        dry_run = _dry_run(request) or options.get("dryRun") == ["All"]
        return _json(await self.delete_object(rtype, request.namespace, request.name,
                                              preconditions=options.get("preconditions"), dry_run=dry_run))

    # ---- the request log ------------------------------------------------------------------------

    def api_calls(self, since: int = 0) -> list[ApiCall]:
        """Every HTTP request so far, oldest first; `since`: only those after the first `since`
        (a caller polling the log reads only what is new)."""
        calls = []
        for req in self._requests[since:]:
            res = req.resource
            is_resource = res is not None and res.plural is not None
            calls.append(ApiCall(
                method=str(req.method.value if hasattr(req.method, "value") else req.method),
                path=req.url.path,
                verb=_call_verb(req),
                group=res.group if res is not None else None,
                version=res.version if res is not None else None,
                resource=res.plural if is_resource and res is not None else None,
                subresource=req.subresource,
                namespace=req.namespace,
                name=req.name,
                user_agent=req.headers.get("User-Agent", ""),
            ))
        return calls


def _unreadable_body(why: str) -> kmock.KubernetesError:
    return errors.error(415, "UnsupportedMediaType",
                        f"the body of the request was in an unknown format ({why}) - accepted media types include:"
                        f" application/json, application/json-patch+json, application/merge-patch+json,"
                        f" application/strategic-merge-patch+json, {PROTOBUF} (some kinds)")


def _call_verb(request: kmock.Request) -> str | None:
    res = request.resource
    if res is None or res.plural is None:
        return None
    return rbac_verb(str(request.method.value), request.name, request.params)


def _call_resource(request: kmock.Request) -> str | None:
    res = request.resource
    if res is None or res.plural is None:
        return None
    return f"{res.plural}/{request.subresource}" if request.subresource else res.plural


JSON = "application/json"
TABLE_CONTENT_TYPE = "application/json;as=Table;v=v1;g=meta.k8s.io"


def _json(payload: JsonObj, content_type: str = JSON, status: int | None = None) -> kmock.Response:
    """A JSON response with its content type named every time (kmock keeps a reaction's last
    headers, so a Table's content type must not outlive its request)."""
    return kmock.Response(status=status, payload=payload, headers={"Content-Type": content_type})


def _include_object(request: kmock.Request) -> str:
    value = request.params.get("includeObject") or "Metadata"
    if value not in ("None", "Metadata", "Object"):
        raise errors.bad_request(f'includeObject: Unsupported value: "{value}": supported values: "None",'
                                 f' "Metadata", "Object"')
    return value


def _dry_run(request: kmock.Request) -> bool:
    """`dryRun=All`: admit and answer, write nothing (any other value is a 400, as the real
    server answers it)."""
    values = request.url.query.getall("dryRun", [])
    for value in values:
        if value != "All":
            raise errors.bad_request(f'dryRun: Unsupported value: "{value}": supported values: "All"')
    return bool(values)


def _field_manager(request: kmock.Request) -> str:
    """Who a write's fields belong to: `fieldManager`, else the User-Agent's product (as the API
    server names managers of clients that send none: "kopf", "kubectl")."""
    manager = request.params.get("fieldManager") or (request.headers.get("User-Agent") or "unknown").split("/")[0]
    if len(manager) > 128:
        raise errors.error(422, "Invalid", 'fieldManager: Too long: may not be more than 128 bytes')
    return manager


def _without_times(obj: Mapping[str, Any]) -> Any:
    """An object with its managers' timestamps left out: a write that changes nothing else is a no-op."""
    meta = obj.get("metadata") or {}
    if not meta.get("managedFields"):
        return obj
    entries = [{k: v for k, v in e.items() if k != "time"} for e in meta["managedFields"]]
    return {**obj, "metadata": {**meta, "managedFields": entries}}


def _apply_body(text: str) -> Any:
    """An apply patch (application/apply-patch+yaml). Go clients (kubectl, Helm) send JSON, which
    is YAML too: read as JSON first, else as YAML by libyaml (PyYAML's pure-Python parser took
    about 0.1 s per object of the chart, most of a `helm install` here)."""
    try:
        return json.loads(text)
    except ValueError:
        return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # noqa: S506 (a safe loader)


def _strict(request: kmock.Request) -> bool:
    return request.params.get("fieldValidation", "").lower() == "strict"


def _spec_of(obj: Mapping[str, Any]) -> Any:
    """What bumps metadata.generation: everything but metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}

