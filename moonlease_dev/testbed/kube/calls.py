"""The request log in RBAC terms, and a traffic counter: what clients asked the local API server
and how many bytes it served them. Pure records; the emulator fills them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

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


def rbac_verb(method: str, name: str | None, params: Mapping[str, str]) -> str | None:
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


@dataclass
class Traffic:
    """What the server served, per (RBAC verb, resource): requests, and bytes of response bodies
    (watch streams counted as they are written). The benchmark's "bytes read at rest" comes from
    here; `since` of an earlier `snapshot()` gives the difference."""

    requests: dict[tuple[str, str], int] = field(default_factory=dict)
    bytes_served: dict[tuple[str, str], int] = field(default_factory=dict)

    def count_request(self, verb: str | None, resource: str | None) -> None:
        key = (verb or "-", resource or "-")
        self.requests[key] = self.requests.get(key, 0) + 1

    def count_bytes(self, verb: str | None, resource: str | None, size: int) -> None:
        key = (verb or "-", resource or "-")
        self.bytes_served[key] = self.bytes_served.get(key, 0) + size

    @property
    def total_requests(self) -> int:
        return sum(self.requests.values())

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes_served.values())

    def snapshot(self) -> Traffic:
        return Traffic(dict(self.requests), dict(self.bytes_served))

    def since(self, earlier: Traffic) -> Traffic:
        """What was served after `earlier` (a snapshot of this counter)."""
        return Traffic(
            {k: v - earlier.requests.get(k, 0) for k, v in self.requests.items() if v != earlier.requests.get(k, 0)},
            {k: v - earlier.bytes_served.get(k, 0) for k, v in self.bytes_served.items()
             if v != earlier.bytes_served.get(k, 0)},
        )
