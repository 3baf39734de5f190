"""Serving a request by the first reaction that sees it, as kmock's `RawHandler._handle` does, in
time independent of how many requests the server has served.

kmock asks each reaction whether it sees a request with `request in view`, which walks every
request the server ever got through the view's filters: each request cost time in proportion to
the server's age (3.5 ms per request after 500, 54 ms after 3,000 here), so a long test or the
demo slowed down as it went. A view that is a chain of plain filters over the server (all of
the emulator's own fallbacks) sees the newest request exactly when every filter's criteria
match it; any other view (slices, groups, exclusions) is asked kmock's way.
"""

from __future__ import annotations

from typing import Any

import aiohttp.web
from kmock._internal import dsl as kmock_dsl
from kmock._internal import rendering as kmock_rendering


def sees(view: Any, request: kmock_rendering.Request) -> bool:
    """`request in view` for the request being served (the newest the server got)."""
    node = view
    while True:
        if isinstance(node, kmock_dsl.Root):
            return True
        if type(node) is kmock_dsl.Filter:
            if not node.criteria(request):
                return False
        elif type(node) is not kmock_dsl.Priority:
            return request in view
        node = node._source


async def dispatch(root: kmock_dsl.Root, request: kmock_rendering.Request) -> aiohttp.web.StreamResponse:
    """kmock's reaction order and depletion rules (highest priority first; a reaction that
    mismatches or runs out is disabled), with `sees` for the membership test."""
    priorities = [payload.priorities for payload in root._payloads]
    longest = max((len(p) for p in priorities), default=0)
    keys = [tuple(-p for p in priority) + (0,) * (longest - len(priority)) for priority in priorities]
    for index in sorted(range(len(keys)), key=lambda i: keys[i]):
        payload = root._payloads[index]
        if payload._disabled.is_set() or not sees(payload._source, request):
            continue
        try:
            return await payload(request)
        except kmock_rendering.ReactionMismatchError:  # a mismatch or a depleted reaction
            payload._disabled.set()
        except NotImplementedError:  # matched, but nothing to respond with
            pass
    raise NotImplementedError("Undefined server behaviour: no reaction matching the request is defined.")
