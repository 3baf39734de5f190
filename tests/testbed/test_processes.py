"""`ManagedProcess`: an interrupted start leaves no process behind (real child processes)."""

from __future__ import annotations

import sys

import pytest

from moonlease_dev.testbed.processes import ManagedProcess

pytestmark = pytest.mark.unit


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"  # a zombie is not running
    except FileNotFoundError:
        return False


def test_ctrl_c_while_waiting_for_readiness_stops_the_process(tmp_path):
    calls = {"n": 0, "pid": 0}

    def ready() -> bool:
        calls["n"] += 1
        calls["pid"] = process.pid
        if calls["n"] == 3:
            raise KeyboardInterrupt  # what Ctrl-C does in the waiting loop
        return False

    process = ManagedProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"],
                             ready=ready, log_dir=tmp_path, ready_timeout=30)
    with pytest.raises(KeyboardInterrupt):
        process.start()
    assert process._process is None, "stop() ran and forgot the process"
    assert calls["pid"] and not _alive(calls["pid"]), "the child is gone (stop() waited for it)"
