"""Injected failures: the next N matching requests answer an error before touching anything."""

from __future__ import annotations

from dataclasses import dataclass

import kmock

from moonlease_dev.testbed.kube.resources import ResourceType

FAULT_REASONS = {401: "Unauthorized", 403: "Forbidden", 409: "Conflict", 422: "Invalid", 429: "TooManyRequests",
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
