"""Table responses (`Accept: application/json;as=Table;g=meta.k8s.io;v=v1`): what `kubectl get`
prints. Pure: objects in, `meta.k8s.io/v1 Table` out.

Columns: a CRD version's `additionalPrinterColumns` (after the Name column, as the API server's
CRD table convertor does; Name and Age when a CRD declares none), the built-in printers'
columns for the kinds the local API server serves (Deployments: NAME READY UP-TO-DATE AVAILABLE
AGE, wide: CONTAINERS IMAGES SELECTOR; ...), and NAME AGE for anything else. Cells of type
`date` are human durations ("5m", "3h12m"), like the API server writes them.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

JsonObj = dict[str, Any]

_TABLE_MEDIA = re.compile(r"^\s*application/json\s*$")


def wants_table(accept: str | None) -> bool:
    """Whether the first media type of `Accept` the server can answer is a v1 Table (kubectl
    asks for `as=Table;v=v1;g=meta.k8s.io`, then v1beta1, then plain JSON)."""
    for option in (accept or "").split(","):
        media, *params = option.split(";")
        values = dict(p.strip().partition("=")[::2] for p in params)
        if values.get("as") == "Table":
            if values.get("g") == "meta.k8s.io" and values.get("v") == "v1" and _TABLE_MEDIA.match(media):
                return True
            continue  # a Table this server does not serve (v1beta1, protobuf): the next option
        return False
    return False


def human_duration(seconds: float) -> str:
    """A duration as `kubectl get` shows ages (apimachinery's HumanDuration rules)."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        return f"{minutes}m" if s % 60 == 0 else f"{minutes}m{s % 60}s"
    if minutes < 180:
        return f"{minutes}m"
    hours = minutes // 60
    if hours < 8:
        return f"{hours}h" if minutes % 60 == 0 else f"{hours}h{minutes % 60}m"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d" if hours % 24 == 0 else f"{hours // 24}d{hours % 24}h"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    years = hours // (24 * 365)
    if years < 8:
        return f"{years}y{(hours // 24) % 365}d"
    return f"{years}y"


def age(timestamp: str | None, now: datetime.datetime) -> str:
    """`<unknown>` for a missing timestamp, as the API server's printers write it."""
    if not timestamp:
        return "<unknown>"
    then = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    return human_duration((now - then).total_seconds())


# ---- JSONPath, as far as printer columns use it ----------------------------------------------

_STEP = re.compile(r"""\.([A-Za-z0-9_$/-]+)|\[(\d+)\]|\[\?\(@\.([A-Za-z0-9_.-]+)\s*==\s*["']([^"']*)["']\)\]""")


def json_path(obj: Any, path: str) -> list[Any]:
    """Values at a printer column's JSONPath: `.a.b`, `[0]`, `[?(@.type=="Ready")]`; a filter
    yields every matching element. Raises ValueError for anything else."""
    values = [obj]
    position = 0
    text = path.strip()
    if text.startswith("{") and text.endswith("}"):
        text = text[1:-1]
    while position < len(text):
        step = _STEP.match(text, position)
        if step is None:
            raise ValueError(f"unsupported JSONPath {path!r} at {text[position:]!r}")
        key, index, filter_key, filter_value = step.groups()
        following: list[Any] = []
        for value in values:
            if key is not None and isinstance(value, Mapping) and key in value:
                following.append(value[key])
            elif index is not None and isinstance(value, list) and int(index) < len(value):
                following.append(value[int(index)])
            elif filter_key is not None and isinstance(value, list):
                following += [item for item in value
                              if isinstance(item, Mapping) and str(_dig(item, filter_key)) == filter_value]
        values = following
        position = step.end()
    return values


def _dig(obj: Mapping[str, Any], dotted: str) -> Any:
    value: Any = obj
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def _cell(values: Sequence[Any], column_type: str, now: datetime.datetime) -> Any:
    """A printer column's cell as the CRD table convertor writes it: the first value, dates as
    ages, nothing found as None (kubectl prints `<none>`)."""
    if not values or values[0] is None:
        return None
    value = values[0]
    if column_type == "date" and isinstance(value, str):
        return age(value, now)
    if isinstance(value, (dict, list)):
        import json

        return json.dumps(value, separators=(",", ":"))
    return value


# ---- columns ----------------------------------------------------------------------------------

CellFn = Callable[[Mapping[str, Any], datetime.datetime], Any]


@dataclass(frozen=True)
class Column:
    name: str
    type: str
    cell: CellFn
    description: str = ""
    priority: int = 0
    format: str = ""

    def definition(self) -> JsonObj:
        return {"name": self.name, "type": self.type, "format": self.format, "description": self.description,
                "priority": self.priority}


def _meta(obj: Mapping[str, Any], key: str) -> Any:
    return (obj.get("metadata") or {}).get(key)


def _status(obj: Mapping[str, Any], key: str, default: Any = 0) -> Any:
    return (obj.get("status") or {}).get(key, default)


def _containers(obj: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    spec = obj.get("spec") or {}
    pod_spec = (spec.get("template") or {}).get("spec") if "template" in spec else spec
    return list((pod_spec or {}).get("containers") or [])


def _selector(obj: Mapping[str, Any]) -> str:
    labels = ((obj.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "<none>"


NAME = Column("Name", "string", lambda o, _: _meta(o, "name"), "Name must be unique within a namespace.",
              format="name")
AGE = Column("Age", "string", lambda o, now: age(_meta(o, "creationTimestamp"), now),
             "CreationTimestamp is a timestamp representing the server time when this object was created.")
_WIDE_WORKLOAD = (
    Column("Containers", "string", lambda o, _: ",".join(c.get("name", "") for c in _containers(o)),
           "Names of each container in the template.", priority=1),
    Column("Images", "string", lambda o, _: ",".join(c.get("image", "") for c in _containers(o)),
           "Images referenced by each container in the template.", priority=1),
    Column("Selector", "string", lambda o, _: _selector(o), "Label selector for pods.", priority=1),
)


def _ready_pods(pod: Mapping[str, Any]) -> str:
    statuses = _status(pod, "containerStatuses", []) or []
    return f"{sum(1 for s in statuses if s.get('ready'))}/{len(_containers(pod))}"


def _ports(service: Mapping[str, Any]) -> str:
    ports = (service.get("spec") or {}).get("ports") or []
    shown = [f"{p.get('port')}{':' + str(p['nodePort']) if p.get('nodePort') else ''}/{p.get('protocol', 'TCP')}"
             for p in ports]
    return ",".join(shown) or "<none>"


def _involved(event: Mapping[str, Any]) -> str:
    involved = event.get("involvedObject") or {}
    return f"{str(involved.get('kind', '')).lower()}/{involved.get('name', '')}"


def _last_seen(event: Mapping[str, Any], now: datetime.datetime) -> str:
    stamp = event.get("lastTimestamp") or event.get("eventTime") or _meta(event, "creationTimestamp")
    return age(stamp[:19] + "Z" if stamp and len(stamp) > 20 else stamp, now)


#: The built-in printers' columns (k8s.io/kubernetes/pkg/printers/internalversion), by kind.
BUILTIN_COLUMNS: dict[tuple[str, str], tuple[Column, ...]] = {
    ("apps", "Deployment"): (
        NAME,
        Column("Ready", "string", lambda o, _: f"{_status(o, 'readyReplicas')}/{(o.get('spec') or {}).get('replicas', 0)}",
               "Number of the pod with ready state"),
        Column("Up-to-date", "string", lambda o, _: _status(o, "updatedReplicas"),
               "Total number of non-terminated pods targeted by this deployment that have the desired template"
               " spec."),
        Column("Available", "string", lambda o, _: _status(o, "availableReplicas"),
               "Total number of available pods (ready for at least minReadySeconds) targeted by this deployment."),
        AGE, *_WIDE_WORKLOAD),
    ("apps", "ReplicaSet"): (
        NAME,
        Column("Desired", "integer", lambda o, _: (o.get("spec") or {}).get("replicas", 0),
               "Number of desired pods."),
        Column("Current", "integer", lambda o, _: _status(o, "replicas"), "Number of actual pods."),
        Column("Ready", "integer", lambda o, _: _status(o, "readyReplicas"), "Number of ready pods."),
        AGE, *_WIDE_WORKLOAD),
    ("apps", "StatefulSet"): (
        NAME,
        Column("Ready", "string", lambda o, _: f"{_status(o, 'readyReplicas')}/{(o.get('spec') or {}).get('replicas', 0)}",
               "Number of the pod with ready state"),
        AGE, *_WIDE_WORKLOAD[:2]),
    ("", "Pod"): (
        NAME,
        Column("Ready", "string", lambda o, _: _ready_pods(o), "The aggregate readiness state of this pod."),
        Column("Status", "string", lambda o, _: _status(o, "phase", "Unknown"), "The aggregate status of the pod."),
        Column("Restarts", "string", lambda o, _: str(sum(int(s.get("restartCount", 0))
                                                          for s in _status(o, "containerStatuses", []) or [])),
               "The number of times the containers in this pod have been restarted."),
        AGE,
        Column("IP", "string", lambda o, _: _status(o, "podIP", "<none>"), "IP address assigned to the pod.",
               priority=1),
        Column("Node", "string", lambda o, _: (o.get("spec") or {}).get("nodeName", "<none>"),
               "Name of the node the pod is assigned to.", priority=1)),
    ("", "Namespace"): (
        NAME, Column("Status", "string", lambda o, _: _status(o, "phase", "Active"), "The status of the namespace"),
        AGE),
    ("", "ConfigMap"): (
        NAME, Column("Data", "string", lambda o, _: len(o.get("data") or {}) + len(o.get("binaryData") or {}),
                     "Number of data keys"), AGE),
    ("", "Secret"): (
        NAME, Column("Type", "string", lambda o, _: o.get("type", "Opaque"), "The type of the secret"),
        Column("Data", "string", lambda o, _: len(o.get("data") or {}), "Number of data keys"), AGE),
    ("", "Service"): (
        NAME, Column("Type", "string", lambda o, _: (o.get("spec") or {}).get("type", "ClusterIP"),
                     "The type of the service."),
        Column("Cluster-IP", "string", lambda o, _: (o.get("spec") or {}).get("clusterIP") or "<none>",
               "The IP address of the service."),
        Column("External-IP", "string", lambda o, _: ",".join((o.get("spec") or {}).get("externalIPs") or [])
               or "<none>", "The external IP addresses of the service."),
        Column("Port(s)", "string", lambda o, _: _ports(o), "The ports of the service."),
        AGE, Column("Selector", "string", lambda o, _: ",".join(
            f"{k}={v}" for k, v in sorted(((o.get("spec") or {}).get("selector") or {}).items())) or "<none>",
            "The label selector of the service.", priority=1)),
    ("coordination.k8s.io", "Lease"): (
        NAME, Column("Holder", "string", lambda o, _: (o.get("spec") or {}).get("holderIdentity", ""),
                     "The holder of the lease."), AGE),
    ("apiextensions.k8s.io", "CustomResourceDefinition"): (
        NAME, Column("Created At", "date", lambda o, _: _meta(o, "creationTimestamp"),
                     "The time the definition was created.")),
    ("", "Event"): (
        Column("Last Seen", "string", _last_seen, "Time when last this event was observed."),
        Column("Type", "string", lambda o, _: o.get("type", ""), "Type of this event."),
        Column("Reason", "string", lambda o, _: o.get("reason", ""), "Why the action was taken."),
        Column("Object", "string", lambda o, _: _involved(o), "The object that this event is about."),
        Column("Message", "string", lambda o, _: o.get("message", ""), "A human-readable description."),
        # kubectl needs a name column to address rows (-o name, wide): hidden at priority 1 here.
        Column("Name", "string", lambda o, _: _meta(o, "name"), "Name of the event.", priority=1, format="name")),
}


def printer_columns(columns: Iterable[Mapping[str, Any]]) -> tuple[Column, ...]:
    """A CRD version's `additionalPrinterColumns` as table columns (Name first; Name and Age if
    none are declared)."""
    declared = list(columns)
    if not declared:
        return (NAME, AGE)

    def cell(spec: Mapping[str, Any]) -> CellFn:
        path, kind = spec.get("jsonPath", ""), spec.get("type", "string")
        return lambda obj, now: _cell(json_path(obj, path), kind, now)

    return (NAME, *(Column(c["name"], c.get("type", "string"), cell(c), c.get("description", ""),
                           int(c.get("priority", 0)), c.get("format", "")) for c in declared))


def columns_for(group: str, kind: str, crd_columns: Sequence[Mapping[str, Any]] | None) -> tuple[Column, ...]:
    """The columns of a kind: its CRD's, the built-in printer's, or Name and Age."""
    if crd_columns is not None:
        return printer_columns(crd_columns)
    return BUILTIN_COLUMNS.get((group, kind), (NAME, AGE))


def _row_object(obj: Mapping[str, Any], include: str) -> JsonObj | None:
    if include == "None":
        return None
    if include == "Object":
        return dict(obj)
    return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj.get("metadata", {})}


def table(columns: Sequence[Column], objects: Iterable[Mapping[str, Any]], *, list_meta: Mapping[str, Any],
          include_object: str = "Metadata", now: datetime.datetime | None = None) -> JsonObj:
    """A `meta.k8s.io/v1 Table` of `objects`. `include_object`: the request's `includeObject`
    (None, Object, Metadata — the default: PartialObjectMetadata)."""
    moment = now or datetime.datetime.now(datetime.UTC)
    rows = []
    for obj in objects:
        row: JsonObj = {"cells": [column.cell(obj, moment) for column in columns]}
        embedded = _row_object(obj, include_object)
        if embedded is not None:
            row["object"] = embedded
        rows.append(row)
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": dict(list_meta),
            "columnDefinitions": [column.definition() for column in columns], "rows": rows}
