"""Errors in the API's own shape: a `kind: Status` body with code, reason, message and details
(kopf and the Kubernetes client map them by status code and reason). Builders and the body
renderer only, pure; the emulator raises them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import kmock

from moonlease_dev.testbed.kube.resources import ResourceType
from moonlease_dev.testbed.kube.validation import FieldError

JsonObj = dict[str, Any]


def status_body(code: int, reason: str, message: str, details: Mapping[str, Any] | None = None) -> JsonObj:
    """A failure `Status` as the API server writes it (details left out when there are none)."""
    body: JsonObj = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                     "message": message, "reason": reason, "code": code}
    if details:
        body["details"] = dict(details)
    return body


def error(status: int, reason: str, message: str, details: Mapping[str, Any] | None = None) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=status, reason=reason, message=message, details=dict(details or {}))


def _object_details(rtype: ResourceType, name: str | None) -> JsonObj:
    details: JsonObj = {"kind": rtype.plural}
    if name:
        details["name"] = name
    if rtype.group:
        details["group"] = rtype.group
    return details


def not_found(rtype: ResourceType, name: str | None) -> kmock.KubernetesError:
    return error(404, "NotFound", f'{rtype.plural}{"." + rtype.group if rtype.group else ""} "{name}" not found',
                 _object_details(rtype, name))


def already_exists(rtype: ResourceType, name: str) -> kmock.KubernetesError:
    return error(409, "AlreadyExists",
                 f'{rtype.plural}{"." + rtype.group if rtype.group else ""} "{name}" already exists',
                 _object_details(rtype, name))


def conflict(rtype: ResourceType, name: str, why: str) -> kmock.KubernetesError:
    return error(409, "Conflict",
                 f'Operation cannot be fulfilled on {rtype.plural}{"." + rtype.group if rtype.group else ""}'
                 f' "{name}": {why}', _object_details(rtype, name))


STALE_OBJECT = "the object has been modified; please apply your changes to the latest version and try again"


def invalid(rtype: ResourceType, name: str | None, problems: Sequence[FieldError | str]) -> kmock.KubernetesError:
    """422 Invalid, one cause per problem (`FieldError`s, or `path: message` lines)."""
    causes = []
    lines = []
    for problem in problems:
        # A cause's message leaves out the field (clients print `field: message`).
        if isinstance(problem, FieldError):
            lines.append(problem.message)
            causes.append({"reason": problem.type.value, "message": problem.body, "field": problem.field})
        else:
            field, _, body = problem.partition(": ")
            lines.append(problem)
            causes.append({"reason": "FieldValueInvalid", "message": body, "field": field})
    details = {**_object_details(rtype, name), "kind": rtype.kind, "causes": causes}
    listed = lines[0] if len(lines) == 1 else "[" + ", ".join(lines) + "]"
    return error(422, "Invalid", f'{rtype.qualified_kind} "{name}" is invalid: {listed}', details)


def too_large(message: str) -> kmock.KubernetesError:
    """413: a request body over MaxRequestBodyBytes, or an object etcd would refuse."""
    return error(413, "RequestEntityTooLarge", message)


def expired(message: str) -> kmock.KubernetesError:
    """410 Gone: a resourceVersion or continue token older than the server still remembers."""
    return error(410, "Expired", message)


def bad_request(message: str) -> kmock.KubernetesError:
    return error(400, "BadRequest", message)
