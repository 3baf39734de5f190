"""The deadline on blocking store calls: timeouts, no pile-up of abandoned calls, recovery.

The blocking call here is a function waiting on an Event, standing in for a Mooncake client
call held by a frozen master; the real master frozen with SIGSTOP is in
tests/connector/test_lookup_deadline_real_store.py and the engine tests.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest

from moonlease_connector.adapters.store_deadline import BoundedCaller, CallStatus

pytestmark = pytest.mark.unit


def test_an_answer_within_the_deadline_comes_back() -> None:
    caller = BoundedCaller(5.0)
    assert caller.call(lambda: [1, 0]).value == [1, 0]
    raised = caller.call(lambda: 1 / 0)
    assert raised.status is CallStatus.RAISED and isinstance(raised.error, ZeroDivisionError)
    assert caller.call(lambda: "again").ok, "a raising call frees the helper thread"


def test_a_stuck_call_times_out_and_later_calls_are_busy_until_it_returns() -> None:
    caller = BoundedCaller(0.05)
    release = threading.Event()
    started = time.monotonic()
    assert caller.call(release.wait).status is CallStatus.TIMED_OUT
    assert time.monotonic() - started < 30, "the wait is bounded (generous bound: loaded machine)"
    attempted = []
    busy = caller.call(lambda: attempted.append(1))
    assert busy.status is CallStatus.BUSY and attempted == [], "not queued behind the stuck call"
    assert caller.busy
    release.set()
    deadline = time.monotonic() + 30
    while caller.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert caller.call(lambda: "recovered").value == "recovered"


def test_only_one_helper_thread_however_many_calls_time_out() -> None:
    caller = BoundedCaller(0.01)
    release = threading.Event()
    before = threading.active_count()
    for _ in range(20):
        caller.call(release.wait)
    assert threading.active_count() <= before + 1
    release.set()


def test_a_closed_or_dropped_caller_stops_its_thread() -> None:
    caller = BoundedCaller(1.0, name="moonlease-test-dropped")
    caller.call(lambda: None)
    del caller
    gc.collect()
    deadline = time.monotonic() + 30
    while any(t.name == "moonlease-test-dropped" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.name == "moonlease-test-dropped" for t in threading.enumerate())
    closed = BoundedCaller(1.0)
    closed.close()
    assert closed.call(lambda: 1).status is CallStatus.BUSY
