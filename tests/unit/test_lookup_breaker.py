"""The lookup client's breaker (`core.lookup_breaker`): every state × whether the late reply came.

Pure: readings of the clock are passed in. The client against real parts (a real worker lookup
server over a frozen real master, no worker at all) is tests/connector/test_lookup_client_real_store.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moonlease_connector.core.lookup_breaker import (
    CLOSED,
    MIN_PROBE_AFTER_S,
    PROBE_AFTER_DEADLINES,
    Breaker,
    BreakerState,
    LookupStep,
    after_reply,
    after_timeout,
    decide_lookup,
    probe_after_s_for,
)

pytestmark = pytest.mark.unit
PROBE_AFTER = 5.0


@pytest.mark.parametrize(("breaker", "now", "state"), [
    (CLOSED, 100.0, BreakerState.CLOSED),
    (Breaker(outstanding_since=99.0), 100.0, BreakerState.OPEN),
    (Breaker(outstanding_since=100.0 - PROBE_AFTER + 0.001), 100.0, BreakerState.OPEN),
    (Breaker(outstanding_since=100.0 - PROBE_AFTER), 100.0, BreakerState.PROBING),
    (Breaker(outstanding_since=10.0), 100.0, BreakerState.PROBING),
])
def test_state_follows_how_long_a_request_has_been_out(breaker, now, state) -> None:
    assert breaker.state(now, PROBE_AFTER) is state


# Every state, with and without the late reply: the whole decision table.
@pytest.mark.parametrize(("since", "late", "step", "after"), [
    # closed: nothing out, send (a "late reply" cannot exist; ignored)
    (None, False, LookupStep.SEND, CLOSED),
    (None, True, LookupStep.SEND, CLOSED),
    # open: miss at once, the request stays out; unless its reply came: closed, send
    (98.0, False, LookupStep.MISS, Breaker(outstanding_since=98.0)),
    (98.0, True, LookupStep.SEND, CLOSED),
    # probing: probe on a fresh channel (the probe is now what is out); a reply wins
    (90.0, False, LookupStep.PROBE, Breaker(outstanding_since=100.0)),
    (90.0, True, LookupStep.SEND, CLOSED),
])
def test_decision_table(since, late, step, after) -> None:
    assert decide_lookup(Breaker(outstanding_since=since), now=100.0, late_reply_arrived=late,
                         probe_after_s=PROBE_AFTER) == (step, after)


def test_a_reply_in_time_closes_and_a_timeout_leaves_the_request_out() -> None:
    assert after_reply() == CLOSED
    assert after_timeout(42.0) == Breaker(outstanding_since=42.0)


def test_probe_interval_is_some_deadlines_but_never_below_a_second() -> None:
    assert probe_after_s_for(1.0) == PROBE_AFTER_DEADLINES * 1.0
    assert probe_after_s_for(0.01) == MIN_PROBE_AFTER_S
    assert probe_after_s_for(60.0) == PROBE_AFTER_DEADLINES * 60.0


@given(st.lists(st.tuples(st.floats(0, 3), st.booleans(), st.booleans()), max_size=40))
def test_a_stuck_worker_costs_one_deadline_then_only_probes(events) -> None:
    """Simulate a client: each event is (time passing, whether the late reply came, whether the
    worker answers a request in time). At most one request is ever out; a lookup waits for
    the worker only when nothing is out; a probe happens only after `PROBE_AFTER` of silence,
    and never two within `PROBE_AFTER`."""
    now, breaker, last_probe = 0.0, CLOSED, None
    for elapsed, late, answers in events:
        now += elapsed
        had_out = breaker.outstanding_since is not None
        step, breaker = decide_lookup(breaker, now=now, late_reply_arrived=late and had_out,
                                      probe_after_s=PROBE_AFTER)
        if step is LookupStep.SEND:
            assert breaker == CLOSED
            breaker = after_reply() if answers else after_timeout(now)
        elif step is LookupStep.PROBE:
            assert had_out and not late
            assert last_probe is None or now - last_probe >= PROBE_AFTER
            last_probe = now
            assert breaker == Breaker(outstanding_since=now)
        else:
            assert step is LookupStep.MISS and had_out and not late
            assert breaker.state(now, PROBE_AFTER) is BreakerState.OPEN
