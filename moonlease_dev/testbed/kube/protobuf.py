"""Kubernetes protobuf request bodies (`application/vnd.kubernetes.protobuf`) read as JSON objects.

kubectl's typed commands (`kubectl create namespace|configmap|secret|service|deployment`) send
their bodies as protobuf, and client-go 1.32 does not resend them as JSON after a 415, so a
server that speaks only JSON must read them. This reads the envelope (`k8s\\x00` + a
`runtime.Unknown` with the TypeMeta and the object's bytes) and the object with the field
numbers of the messages those commands fill (a subset of k8s.io/api's generated.proto). A
non-empty field outside that subset raises `UnreadableBody` (the server answers 415), so
nothing is silently dropped. Pure.

Proto fields that are not pointers in Go are always written, empty or not; like the JSON
encoding's `omitempty`, empty values are left out (except `replicas`, where 0 means 0).
"""

from __future__ import annotations

import base64
import datetime
from typing import Any

JsonObj = dict[str, Any]

MAGIC = b"k8s\x00"


class UnreadableBody(ValueError):
    """A protobuf body this server cannot read (a kind or a field outside the known subset)."""


# Field number -> (JSON name, type). Types: "string", "int", "bool", "bytes", a message name,
# "[]T" repeated, "map:T" (entries of key 1 and value 2).
_OBJECT_META = {1: ("name", "string"), 2: ("generateName", "string"), 3: ("namespace", "string"),
                4: ("selfLink", "string"), 5: ("uid", "string"), 6: ("resourceVersion", "string"),
                7: ("generation", "int"), 8: ("creationTimestamp", "Time"), 9: ("deletionTimestamp", "Time"),
                10: ("deletionGracePeriodSeconds", "int"), 11: ("labels", "map:string"),
                12: ("annotations", "map:string"), 13: ("ownerReferences", "[]OwnerReference"),
                14: ("finalizers", "[]string")}
MESSAGES: dict[str, dict[int, tuple[str, str]]] = {
    "Unknown": {1: ("typeMeta", "TypeMeta"), 2: ("raw", "rawbytes"), 3: ("contentEncoding", "string"),
                4: ("contentType", "string")},
    "TypeMeta": {1: ("apiVersion", "string"), 2: ("kind", "string")},
    "ObjectMeta": _OBJECT_META,
    "OwnerReference": {5: ("apiVersion", "string"), 1: ("kind", "string"), 3: ("name", "string"),
                       4: ("uid", "string"), 6: ("controller", "bool"), 7: ("blockOwnerDeletion", "bool")},
    "LabelSelector": {1: ("matchLabels", "map:string"), 2: ("matchExpressions", "[]LabelSelectorRequirement")},
    "LabelSelectorRequirement": {1: ("key", "string"), 2: ("operator", "string"), 3: ("values", "[]string")},
    "Namespace": {1: ("metadata", "ObjectMeta"), 2: ("spec", "NamespaceSpec"), 3: ("status", "Empty")},
    "NamespaceSpec": {1: ("finalizers", "[]string")},
    "ConfigMap": {1: ("metadata", "ObjectMeta"), 2: ("data", "map:string"), 3: ("binaryData", "map:bytes"),
                  4: ("immutable", "bool")},
    "Secret": {1: ("metadata", "ObjectMeta"), 2: ("data", "map:bytes"), 3: ("type", "string"),
               4: ("stringData", "map:string"), 5: ("immutable", "bool")},
    "Service": {1: ("metadata", "ObjectMeta"), 2: ("spec", "ServiceSpec"), 3: ("status", "Empty")},
    "ServiceSpec": {1: ("ports", "[]ServicePort"), 2: ("selector", "map:string"), 3: ("clusterIP", "string"),
                    4: ("type", "string"), 10: ("externalName", "string"), 18: ("clusterIPs", "[]string")},
    "ServicePort": {1: ("name", "string"), 2: ("protocol", "string"), 3: ("port", "int"),
                    4: ("targetPort", "IntOrString"), 5: ("nodePort", "int"), 6: ("appProtocol", "string")},
    "Deployment": {1: ("metadata", "ObjectMeta"), 2: ("spec", "DeploymentSpec"), 3: ("status", "Empty")},
    "DeploymentSpec": {1: ("replicas", "int"), 2: ("selector", "LabelSelector"), 3: ("template", "PodTemplateSpec"),
                       4: ("strategy", "DeploymentStrategy"), 5: ("minReadySeconds", "int"),
                       6: ("revisionHistoryLimit", "int"), 7: ("paused", "bool"),
                       9: ("progressDeadlineSeconds", "int")},
    "DeploymentStrategy": {1: ("type", "string")},
    "PodTemplateSpec": {1: ("metadata", "ObjectMeta"), 2: ("spec", "PodSpec")},
    "PodSpec": {2: ("containers", "[]Container"), 3: ("restartPolicy", "string"),
                4: ("terminationGracePeriodSeconds", "int"), 6: ("dnsPolicy", "string"),
                7: ("nodeSelector", "map:string"), 8: ("serviceAccountName", "string"), 10: ("nodeName", "string"),
                19: ("schedulerName", "string"), 20: ("initContainers", "[]Container")},
    "Container": {1: ("name", "string"), 2: ("image", "string"), 3: ("command", "[]string"), 4: ("args", "[]string"),
                  5: ("workingDir", "string"), 6: ("ports", "[]ContainerPort"), 7: ("env", "[]EnvVar"),
                  8: ("resources", "ResourceRequirements"), 13: ("terminationMessagePath", "string"),
                  14: ("imagePullPolicy", "string"), 16: ("stdin", "bool"), 17: ("stdinOnce", "bool"),
                  18: ("tty", "bool"), 20: ("terminationMessagePolicy", "string"),
                  24: ("restartPolicy", "string")},
    "ContainerPort": {1: ("name", "string"), 2: ("hostPort", "int"), 3: ("containerPort", "int"),
                      4: ("protocol", "string"), 5: ("hostIP", "string")},
    "EnvVar": {1: ("name", "string"), 2: ("value", "string")},
    "ResourceRequirements": {1: ("limits", "map:Quantity"), 2: ("requests", "map:Quantity")},
    "Time": {1: ("seconds", "int"), 2: ("nanos", "int")},
    "IntOrString": {1: ("type", "int"), 2: ("intVal", "int"), 3: ("strVal", "string")},
    "Quantity": {1: ("string", "string")},
    "Empty": {},
}

#: The kinds whose bodies are read, by (apiVersion, kind).
KINDS = {("v1", "Namespace"), ("v1", "ConfigMap"), ("v1", "Secret"), ("v1", "Service"), ("apps/v1", "Deployment")}

#: Pointer fields in Go, where a zero is a value and not "unset".
_ZERO_KEPT = frozenset({"replicas"})


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(data):
            raise UnreadableBody("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _fields(data: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) pairs of a message: varints as ints, length-delimited as bytes."""
    found: list[tuple[int, int | bytes]] = []
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
            found.append((number, value))
        elif wire == 2:
            size, pos = _varint(data, pos)
            if pos + size > len(data):
                raise UnreadableBody("truncated field")
            found.append((number, data[pos:pos + size]))
            pos += size
        else:
            raise UnreadableBody(f"wire type {wire} is not used by Kubernetes objects")
    return found


def _signed(value: int) -> int:
    """int32/int64 varints are two's complement over 64 bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _empty(value: Any) -> bool:
    return value in ("", 0, False, None) or value == {} or value == []


def _scalar(kind: str, raw: int | bytes, where: str) -> Any:
    match kind:
        case "string":
            return _as_bytes(raw, where).decode()
        case "bytes":
            return base64.b64encode(_as_bytes(raw, where)).decode()
        case "rawbytes":
            return _as_bytes(raw, where)
        case "int":
            return _signed(_as_int(raw, where))
        case "bool":
            return bool(_as_int(raw, where))
    return decode_message(kind, _as_bytes(raw, where), where)


def _as_bytes(raw: int | bytes, where: str) -> bytes:
    if not isinstance(raw, bytes):
        raise UnreadableBody(f"{where}: expected a length-delimited field")
    return raw


def _as_int(raw: int | bytes, where: str) -> int:
    if not isinstance(raw, int):
        raise UnreadableBody(f"{where}: expected a varint")
    return raw


def decode_message(name: str, data: bytes, where: str = "") -> Any:
    """One message as its JSON value (Time, IntOrString and Quantity as the JSON encoding
    writes them); empty fields left out."""
    spec = MESSAGES[name]
    result: JsonObj = {}
    for number, raw in _fields(data):
        if number not in spec:
            if raw in (0, b""):
                continue  # an unset field of a message this server reads in part
            raise UnreadableBody(f"{name}{where}: field {number} is not read by the local API server")
        key, kind = spec[number]
        path = f"{where}.{key}"
        if kind.startswith("[]"):
            result.setdefault(key, []).append(_scalar(kind[2:], raw, path))
        elif kind.startswith("map:"):
            entry = dict(_fields(_as_bytes(raw, path)))
            result.setdefault(key, {})[_scalar("string", entry.get(1, b""), path)] = \
                _scalar(kind[4:], entry.get(2, b"" if kind[4:] != "int" else 0), path)
        else:
            result[key] = _scalar(kind, raw, path)
    match name:
        case "Time":
            if not result.get("seconds"):
                return None
            moment = datetime.datetime.fromtimestamp(result["seconds"], datetime.UTC)
            return moment.strftime("%Y-%m-%dT%H:%M:%SZ")
        case "IntOrString":
            return result.get("strVal", "") if result.get("type") == 1 else result.get("intVal", 0)
        case "Quantity":
            return result.get("string", "")
    return {key: value for key, value in result.items() if key in _ZERO_KEPT or not _empty(value)}


def decode_object(body: bytes) -> JsonObj:
    """A protobuf request body as the JSON object it encodes (apiVersion and kind included)."""
    if not body.startswith(MAGIC):
        raise UnreadableBody("not a Kubernetes protobuf body (no k8s\\x00 prefix)")
    envelope = decode_message("Unknown", body[len(MAGIC):])
    type_meta = envelope.get("typeMeta") or {}
    api_version, kind = type_meta.get("apiVersion", ""), type_meta.get("kind", "")
    if (api_version, kind) not in KINDS:
        raise UnreadableBody(f"{api_version}/{kind} bodies are read as JSON only")
    if envelope.get("contentEncoding"):
        raise UnreadableBody(f"content encoding {envelope['contentEncoding']!r} is not supported")
    obj = decode_message(kind, envelope.get("raw", b""))
    return {"apiVersion": api_version, "kind": kind, **obj}
