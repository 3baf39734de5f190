"""When the scheduler's lookup client waits for the worker, and when it answers a miss at once. Pure.

The scheduler asks worker rank 0 for every lookup over one ZMQ REQ socket (upstream's
`LookupKeyClient`); the worker runs the lookup inline, and Mooncake's client calls have no
deadline of their own, so a frozen master holds the worker's answer. The client waits at most
`mooncake_lookup_timeout_ms` for an answer; past it the lookup is a miss. The request it gave
up on is still *out*: the worker is stuck in it (a REQ socket cannot send again before the reply
comes), so a breaker decides what later lookups do:

- `CLOSED`: nothing is out; a lookup is sent and waited for, up to the deadline.
- `OPEN`: a request is out past its deadline; lookups miss at once, without sending. Each one
  first checks (without waiting) whether the late reply has come: then the worker answers
  again, the reply is dropped, the breaker closes and the lookup is sent as usual.
- `PROBING`: open for `probe_after_s` with no reply (the worker may be gone, or its reply lost):
  the next lookup replaces the socket, sends its request on the new one without waiting and
  misses; the probe is then the request that is out, and its reply closes the breaker.

So a stuck worker costs one deadline, then misses at once; lookups hit again from the first one
after the worker answers. The caller supplies the clock's readings (`now`), so every decision
here is a plain function of its inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

#: A breaker probes after this many deadlines without a reply (but at least `MIN_PROBE_AFTER_S`).
PROBE_AFTER_DEADLINES = 5
MIN_PROBE_AFTER_S = 1.0


class BreakerState(str, Enum):
    CLOSED = "closed"  # nothing out: send and wait up to the deadline
    OPEN = "open"  # a request is out past its deadline: miss at once
    PROBING = "probing"  # out for `probe_after_s`: replace the channel and probe


class LookupStep(str, Enum):
    """What the client does with one lookup."""

    SEND = "send"  # send the request and wait for the reply, up to the deadline
    MISS = "miss"  # answer a miss at once, send nothing (a request is still out)
    PROBE = "probe"  # replace the channel, send the request without waiting, answer a miss


@dataclass(frozen=True)
class Breaker:
    """The client's channel: when the request still out was sent (None: nothing is out)."""

    outstanding_since: float | None = None

    def state(self, now: float, probe_after_s: float) -> BreakerState:
        if self.outstanding_since is None:
            return BreakerState.CLOSED
        if now - self.outstanding_since >= probe_after_s:
            return BreakerState.PROBING
        return BreakerState.OPEN


CLOSED = Breaker()


def probe_after_s_for(timeout_s: float) -> float:
    """How long an open breaker waits for the late reply before probing on a fresh channel."""
    return max(MIN_PROBE_AFTER_S, PROBE_AFTER_DEADLINES * timeout_s)


def decide_lookup(breaker: Breaker, *, now: float, late_reply_arrived: bool,
                  probe_after_s: float) -> tuple[LookupStep, Breaker]:
    """The step for one lookup and the breaker it leaves (before any reply to this lookup).

    `late_reply_arrived`: the reply to the request that is out has come (the caller checked
    without waiting, and drops it: its lookup was answered a miss long ago). Only meaningful
    while a request is out.
    """
    state = breaker.state(now, probe_after_s)
    if state is BreakerState.CLOSED or late_reply_arrived:
        return LookupStep.SEND, CLOSED
    if state is BreakerState.PROBING:
        return LookupStep.PROBE, Breaker(outstanding_since=now)
    return LookupStep.MISS, breaker


def after_reply() -> Breaker:
    """The reply came within the deadline: nothing is out."""
    return CLOSED


def after_timeout(sent_at: float) -> Breaker:
    """No reply within the deadline: the request sent at `sent_at` stays out."""
    return Breaker(outstanding_since=sent_at)
