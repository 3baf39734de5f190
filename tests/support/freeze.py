"""Freeze a server process with SIGSTOP, for tests of what a hung server does to its clients."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path


def _all_threads_stopped(pid: int) -> bool:
    tasks = Path(f"/proc/{pid}/task")
    states = []
    for task in tasks.iterdir():
        with contextlib.suppress(OSError):
            # /proc/PID/task/TID/stat: "tid (comm) state ..."; comm may hold spaces or parens.
            states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
    return bool(states) and all(state in ("T", "t") for state in states)


@contextlib.contextmanager
def frozen(pid: int, timeout_s: float = 30.0) -> Iterator[None]:
    """SIGSTOP `pid` and wait until every one of its threads has stopped (a thread busy on a
    CPU stops only when it next enters the kernel, and could still answer a request sent
    right after the signal); SIGCONT on the way out, whatever happened."""
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + timeout_s
        while not _all_threads_stopped(pid):
            if time.monotonic() > deadline:
                raise TimeoutError(f"process {pid} did not stop within {timeout_s:.0f} s")
            time.sleep(0.01)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
