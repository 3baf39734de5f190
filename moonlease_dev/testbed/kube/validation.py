"""The API server's validation of object metadata and size, as far as this project's objects
meet it: name syntax, label and annotation keys and values, finalizer names, the total size of
annotations, ConfigMap/Secret data, and the stored object's size.

Pure functions: each returns `FieldError`s (empty when valid); the emulator turns them into a 422
`Invalid` Status. Rules and messages follow k8s.io/apimachinery's `validation` packages
(`IsDNS1123Subdomain`, `IsDNS1123Label`, `IsDNS1035Label`, `IsQualifiedName`, `IsValidLabelValue`,
`ValidateAnnotations`) and k8s.io/kubernetes' `ValidateConfigMap`.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: etcd's default --max-request-bytes: a stored object larger than this is refused (413).
MAX_OBJECT_BYTES = 3 * 512 * 1024  # 1.5 MiB
#: kube-apiserver's MaxRequestBodyBytes: a larger request body is refused before decoding (413).
MAX_REQUEST_BODY_BYTES = 3 * 1024 * 1024
#: ValidateAnnotations' TotalAnnotationSizeLimitB: keys and values of all annotations together.
MAX_ANNOTATIONS_BYTES = 256 * 1024
#: ValidateConfigMap / ValidateSecret: data and binaryData together.
MAX_CONFIGMAP_BYTES = 1024 * 1024
#: generateName is cut to this length before the 5 random characters (maxGeneratedNameLength).
MAX_GENERATED_NAME_PREFIX = 63 - 5

_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = rf"{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*"
_DNS1035_LABEL = r"[a-z]([-a-z0-9]*[a-z0-9])?"
_QUALIFIED_NAME_PART = r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_LABEL_VALUE = rf"(({_QUALIFIED_NAME_PART})?)"
_CONFIG_KEY = r"[-._a-zA-Z0-9]+"


class NameRule(str, enum.Enum):
    """Which syntax a resource's object names must follow (the Validate*Name of its strategy)."""

    DNS1123_SUBDOMAIN = "dns1123-subdomain"  # most resources, custom resources included
    DNS1123_LABEL = "dns1123-label"  # namespaces
    DNS1035_LABEL = "dns1035-label"  # services
    PATH_SEGMENT = "path-segment"  # RBAC kinds: anything usable in a URL path (`system:auth-delegator`)


class ErrorType(str, enum.Enum):
    """field.ErrorType's reasons, as they appear in a Status' `details.causes[].reason`."""

    INVALID = "FieldValueInvalid"
    TOO_LONG = "FieldValueTooLong"
    REQUIRED = "FieldValueRequired"
    FORBIDDEN = "FieldValueForbidden"
    DUPLICATE = "FieldValueDuplicate"


@dataclass(frozen=True)
class FieldError:
    """One validation failure: where, what kind, the offending value, and why."""

    field: str
    type: ErrorType
    detail: str
    value: Any = None

    @property
    def message(self) -> str:
        """The line the API server prints, e.g. `metadata.name: Invalid value: "A": ...`."""
        return f"{self.field}: {self.body}"

    @property
    def body(self) -> str:
        """The line without the field: a Status cause's message (its `field` says where)."""
        match self.type:
            case ErrorType.REQUIRED:
                text = "Required value"
            case ErrorType.TOO_LONG:
                text = "Too long"
            case ErrorType.FORBIDDEN:
                text = "Forbidden"
            case ErrorType.DUPLICATE:
                text = f"Duplicate value: {json.dumps(self.value)}"
            case _:
                text = f"Invalid value: {json.dumps(self.value)}"
        return f"{text}: {self.detail}" if self.detail else text


def _regex_detail(what: str, example: str, regex: str) -> str:
    return f"{what} (e.g. '{example}', regex used for validation is '{regex}')"


def _name_errors(value: str, max_length: int, regex: str, what: str, example: str) -> list[str]:
    """The API server's two checks of a name: its length, then its syntax (both reported)."""
    problems = []
    if len(value) > max_length:
        problems.append(f"must be no more than {max_length} characters")
    if not re.fullmatch(regex, value):
        problems.append(_regex_detail(what, example, regex))
    return problems


def dns1123_subdomain_errors(value: str) -> list[str]:
    return _name_errors(value, 253, _DNS1123_SUBDOMAIN,
                        "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or"
                        " '.', and must start and end with an alphanumeric character", "example.com")


def dns1123_label_errors(value: str) -> list[str]:
    return _name_errors(value, 63, _DNS1123_LABEL,
                        "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and"
                        " must start and end with an alphanumeric character", "my-name")


def dns1035_label_errors(value: str) -> list[str]:
    return _name_errors(value, 63, _DNS1035_LABEL,
                        "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an"
                        " alphabetic character, and end with an alphanumeric character", "my-name")


def qualified_name_errors(value: str) -> list[str]:
    """`[prefix/]name`: an optional DNS subdomain prefix, a name of at most 63 characters."""
    prefix, slash, name = value.rpartition("/")
    problems = []
    if slash:
        if not prefix:
            problems.append("prefix part must be non-empty")
        else:
            problems.extend(f"prefix part {p}" for p in dns1123_subdomain_errors(prefix))
    if not name:
        problems.append("name part must be non-empty")
    elif value.count("/") > 1:
        problems.append("a qualified name must consist of alphanumeric characters, '-', '_' or '.', and"
                        " must start and end with an alphanumeric character, with an optional DNS"
                        " subdomain prefix and '/'")
    else:
        if len(name) > 63:
            problems.append("name part must be no more than 63 characters")
        if not re.fullmatch(_QUALIFIED_NAME_PART, name):
            problems.append(_regex_detail(
                "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and"
                " end with an alphanumeric character", "MyName", _QUALIFIED_NAME_PART))
    return problems


def label_value_errors(value: str) -> list[str]:
    problems = []
    if len(value) > 63:
        problems.append("must be no more than 63 characters")
    if not re.fullmatch(_LABEL_VALUE, value):
        problems.append(_regex_detail(
            "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or"
            " '.', and must start and end with an alphanumeric character", "MyValue", _QUALIFIED_NAME_PART))
    return problems


def path_segment_errors(name: str) -> list[str]:
    """apimachinery's ValidatePathSegmentName: not `.` or `..`, no `/` or `%`."""
    if name in (".", ".."):
        return [f'may not be \'{name}\'']
    return [f"may not contain '{c}'" for c in ("/", "%") if c in name]


_NAME_CHECKS = {
    NameRule.PATH_SEGMENT: path_segment_errors,
    NameRule.DNS1123_SUBDOMAIN: dns1123_subdomain_errors,
    NameRule.DNS1123_LABEL: dns1123_label_errors,
    NameRule.DNS1035_LABEL: dns1035_label_errors,
}


def name_errors(name: str, rule: NameRule, field: str = "metadata.name") -> list[FieldError]:
    return [FieldError(field, ErrorType.INVALID, problem, name) for problem in _NAME_CHECKS[rule](name)]


def generated_name(prefix: str, suffix: str) -> str:
    """What the API server makes of `generateName`: the prefix cut to leave room for the suffix."""
    return prefix[:MAX_GENERATED_NAME_PREFIX] + suffix


def labels_errors(labels: Any, field: str) -> list[FieldError]:
    if labels is None:
        return []
    if not isinstance(labels, Mapping):
        return [FieldError(field, ErrorType.INVALID, "must be a map of strings to strings", labels)]
    errors = []
    for key, value in labels.items():
        errors += [FieldError(field, ErrorType.INVALID, p, key) for p in qualified_name_errors(str(key))]
        if not isinstance(value, str):
            errors.append(FieldError(f"{field}[{key}]", ErrorType.INVALID, "must be a string", value))
            continue
        errors += [FieldError(field, ErrorType.INVALID, p, value) for p in label_value_errors(value)]
    return errors


def annotations_errors(annotations: Any, field: str) -> list[FieldError]:
    if annotations is None:
        return []
    if not isinstance(annotations, Mapping):
        return [FieldError(field, ErrorType.INVALID, "must be a map of strings to strings", annotations)]
    errors = []
    total = 0
    for key, value in annotations.items():
        errors += [FieldError(field, ErrorType.INVALID, p, key) for p in qualified_name_errors(str(key).lower())]
        if not isinstance(value, str):
            errors.append(FieldError(f"{field}[{key}]", ErrorType.INVALID, "must be a string", value))
            continue
        total += len(str(key)) + len(value)
    if total > MAX_ANNOTATIONS_BYTES:
        errors.append(FieldError(field, ErrorType.TOO_LONG, f"must have at most {MAX_ANNOTATIONS_BYTES} bytes"))
    return errors


def finalizers_errors(finalizers: Any, field: str = "metadata.finalizers") -> list[FieldError]:
    if finalizers is None:
        return []
    if not isinstance(finalizers, list):
        return [FieldError(field, ErrorType.INVALID, "must be a list of strings", finalizers)]
    errors = []
    for i, name in enumerate(finalizers):
        errors += [FieldError(f"{field}[{i}]", ErrorType.INVALID, p, name)
                   for p in qualified_name_errors(str(name))]
    return errors


def object_meta_errors(obj: Mapping[str, Any], rule: NameRule) -> list[FieldError]:
    """metadata (name, labels, annotations, finalizers) and, for workloads, the pod template's
    labels and annotations and the selector's matchLabels, which the apps validation checks too."""
    meta = obj.get("metadata") or {}
    errors: list[FieldError] = []
    name = meta.get("name")
    if isinstance(name, str) and name:
        errors += name_errors(name, rule)
    errors += labels_errors(meta.get("labels"), "metadata.labels")
    errors += annotations_errors(meta.get("annotations"), "metadata.annotations")
    errors += finalizers_errors(meta.get("finalizers"))
    spec = obj.get("spec")
    if isinstance(spec, Mapping):
        template = spec.get("template")
        if isinstance(template, Mapping) and isinstance(template.get("metadata"), Mapping):
            errors += labels_errors(template["metadata"].get("labels"), "spec.template.metadata.labels")
            errors += annotations_errors(template["metadata"].get("annotations"),
                                         "spec.template.metadata.annotations")
        selector = spec.get("selector")
        if isinstance(selector, Mapping) and "matchLabels" in selector:
            errors += labels_errors(selector.get("matchLabels"), "spec.selector.matchLabels")
    return errors


def config_data_errors(obj: Mapping[str, Any]) -> list[FieldError]:
    """ConfigMap/Secret `data` and `binaryData`: valid keys, at most 1 MiB together."""
    errors: list[FieldError] = []
    total = 0
    seen: set[str] = set()
    for section in ("data", "binaryData", "stringData"):
        values = obj.get(section) or {}
        if not isinstance(values, Mapping):
            errors.append(FieldError(section, ErrorType.INVALID, "must be a map", values))
            continue
        for key, value in values.items():
            if len(key) > 253 or not re.fullmatch(_CONFIG_KEY, key):
                errors.append(FieldError(f"{section}[{key}]", ErrorType.INVALID,
                                         "a valid config key must consist of alphanumeric characters, '-',"
                                         " '_' or '.'", key))
            if section != "stringData" and key in seen:
                errors.append(FieldError(f"{section}[{key}]", ErrorType.INVALID,
                                         "duplicate of key present in another section", key))
            seen.add(key)
            total += len(str(value))
    if total > MAX_CONFIGMAP_BYTES:
        errors.append(FieldError("[]", ErrorType.TOO_LONG, f"must have at most {MAX_CONFIGMAP_BYTES} bytes"))
    return errors


def stored_size(obj: Any) -> int:
    """The object's size as stored: compact JSON (what etcd holds for custom resources; built-in
    kinds are stored as protobuf, somewhat smaller, so this errs on the strict side)."""
    return len(json.dumps(obj, separators=(",", ":")).encode())


def selector_label_errors(pairs: Iterable[tuple[str, Iterable[str]]]) -> list[str]:
    """Keys and values of a parsed label selector, as `labels.Parse` checks them."""
    problems = []
    for key, values in pairs:
        problems += [f"key {key!r}: {p}" for p in qualified_name_errors(key)]
        for value in values:
            problems += [f"values[0][{key}]: Invalid value: {value!r}: {p}" for p in label_value_errors(value)]
    return problems
