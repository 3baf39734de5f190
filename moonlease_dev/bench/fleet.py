"""The replay's fleet: how many prefill and decode engines share the store, and the router. Pure.

A fleet is written `4p1d` (4 prefill engines, 1 decode engine; seed 002's deployment), or as
one number `N`: N-1 prefill engines and 1 decode engine (`1` is a single engine that serves
alone, prefill only, as the replay ran before fleets). Every engine is a connector of its
own — lookup object, save path, retention state — on the one shared store.

A request goes to one prefill engine, chosen by the routing policy, which looks its prompt
up and saves it; then, if the fleet has decode engines, to one decode engine (same policy
over the decode pool), which looks the prompt up and loads what the prefill engine saved.

Routing policies:
- `session`: every turn of a session to the same engine (a stable hash of the session name),
  as prefix-aware routers do (an engine's local prefix cache is not modelled: the store is
  what is measured);
- `random`: a seeded uniform choice per request;
- `round-robin`: engines in turn.
"""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass

ROUTINGS = ("session", "random", "round-robin")
_SPEC = re.compile(r"^(\d+)p(\d+)d$")


@dataclass(frozen=True)
class FleetSpec:
    """Engine counts of the fleet."""

    prefill: int = 4
    decode: int = 1

    def __post_init__(self) -> None:
        if self.prefill < 1:
            raise ValueError("a fleet needs at least one prefill engine")
        if self.decode < 0:
            raise ValueError("decode engines cannot be negative")

    @property
    def engines(self) -> int:
        return self.prefill + self.decode

    @property
    def label(self) -> str:
        return f"{self.prefill}p{self.decode}d"


SINGLE_ENGINE = FleetSpec(1, 0)
DEFAULT_FLEET = FleetSpec(4, 1)


def parse_fleet(text: str) -> FleetSpec:
    """`4p1d` (prefill and decode counts) or `N` (N-1 prefill + 1 decode; 1: one engine alone)."""
    text = text.strip().lower()
    match = _SPEC.match(text)
    try:
        if match:
            return FleetSpec(int(match.group(1)), int(match.group(2)))
        if text.isdigit():
            count = int(text)
            return SINGLE_ENGINE if count == 1 else FleetSpec(count - 1, 1)
    except ValueError as error:
        raise ValueError(f"--engines {text!r}: {error}") from None
    raise ValueError(f"--engines {text!r}: use <prefill>p<decode>d (e.g. 4p1d) or a count N >= 1 "
                     "(N-1 prefill engines and 1 decode engine)")


class Router:
    """Picks an engine of a pool for each request. Seeded, so a run is reproducible."""

    def __init__(self, policy: str, engines: int, seed: int = 0) -> None:
        if policy not in ROUTINGS:
            raise ValueError(f"unknown routing {policy!r}; known: {', '.join(ROUTINGS)}")
        if engines < 1:
            raise ValueError("a router needs at least one engine")
        self.policy = policy
        self.engines = engines
        self._rng = random.Random(seed)
        self._next = 0

    def pick(self, session: str) -> int:
        if self.engines == 1:
            return 0
        if self.policy == "session":
            return zlib.crc32(session.encode()) % self.engines
        if self.policy == "random":
            return self._rng.randrange(self.engines)
        chosen = self._next
        self._next = (self._next + 1) % self.engines
        return chosen
