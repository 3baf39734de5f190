"""Interpreter exit waits, bounded, for threads inside an abandonable Mooncake call.

Each case runs a child interpreter: a daemon thread stands in for a store call (`native_call()`
around a sleep, or a thread registered as stuck) and the main thread exits at once. A daemon
thread still running at finalization is ended when it next takes the GIL, so the marker it
prints after its "call" appears only if exit waited for it. (The real failure — a pybind11 call
returning during finalization aborts the process — is `test_lookup_teardown_real_store.py`'s
second case, on a real master.)
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from moonlease_dev import devenv

pytestmark = pytest.mark.unit

PRELUDE = """
import sys, threading, time
from moonlease_connector.adapters import exit_guard
exit_guard.EXIT_WAIT_S = float(sys.argv[1])
"""


def _run(body: str, exit_wait_s: float) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    child = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(body), str(exit_wait_s)],
        env={"PYTHONPATH": devenv.source_pythonpath(), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=60)
    return child, time.monotonic() - started


def test_exit_waits_for_a_call_that_returns():
    child, _ = _run("""
        def call():
            with exit_guard.native_call():
                time.sleep(0.5)
            print("the call returned", flush=True)
        threading.Thread(target=call, daemon=True).start()
        while exit_guard.calls_out() == 0:
            time.sleep(0.001)
        print("main exits", flush=True)
    """, exit_wait_s=30)
    assert child.returncode == 0, child.stderr
    assert child.stdout.splitlines() == ["main exits", "the call returned"]


def test_a_call_that_never_returns_holds_exit_only_for_the_bound():
    child, elapsed_s = _run("""
        def call():
            with exit_guard.native_call():
                time.sleep(3600)
        threading.Thread(target=call, daemon=True).start()
        while exit_guard.calls_out() == 0:
            time.sleep(0.001)
    """, exit_wait_s=0.5)
    assert child.returncode == 0, child.stderr
    assert 0.5 <= elapsed_s < 20
    assert "abandoned Mooncake call(s) still out after" in child.stderr


def test_exit_waits_for_a_thread_left_stuck_at_close():
    child, _ = _run("""
        def transfer_thread():
            time.sleep(0.5)  # a store call that outlived close
            print("the thread stopped", flush=True)
        thread = threading.Thread(target=transfer_thread, daemon=True)
        thread.start()
        exit_guard.wait_at_exit_for(thread)
    """, exit_wait_s=30)
    assert child.returncode == 0, child.stderr
    assert child.stdout.splitlines() == ["the thread stopped"]


def test_nothing_out_costs_exit_nothing():
    child, _ = _run("""
        start = time.monotonic()
        exit_guard._wait_at_exit()
        print(f"{time.monotonic() - start:.3f}")
        assert exit_guard.wait_for_calls(0.0)
    """, exit_wait_s=30)
    assert child.returncode == 0, child.stderr
    assert float(child.stdout) < 0.05


def test_a_call_that_raises_is_no_longer_counted():
    from moonlease_connector.adapters import exit_guard

    before = exit_guard.calls_out()
    with pytest.raises(RuntimeError), exit_guard.native_call():
        assert exit_guard.calls_out() == before + 1
        raise RuntimeError("the store call failed")
    assert exit_guard.calls_out() == before
