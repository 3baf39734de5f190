"""Stopping upstream's KV transfer threads (I/O: threads).

Upstream's send and receive threads (`KVTransferThread.run`) loop forever on their request
queue — a `None` request is logged and skipped, every `Exception` is caught — and nothing ever
stops them: a closed worker kept its threads (and, through their bound callbacks, itself) alive
for the life of the process. `stop_transfer_threads` puts one `_StopRequest` per live thread on
its queue: the first attribute the thread's handler reads from it marks the queue item done and
raises `SystemExit`, which passes upstream's `except Exception` and ends `run` quietly (threading
ignores `SystemExit`). It works on upstream's classes and ours alike, without replacing their
loop; a thread stuck in a store call stops once that call returns.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterable
from typing import Any


class _StopRequest:
    """A request whose handling ends the thread that takes it."""

    def __init__(self, request_queue: queue.Queue[Any]) -> None:
        object.__setattr__(self, "_queue", request_queue)

    def __getattr__(self, name: str) -> Any:
        # Only attributes this object lacks land here: the handler reading its request.
        self._queue.task_done()
        raise SystemExit


def stop_transfer_threads(threads: Iterable[Any], timeout_s: float) -> list[Any]:
    """Ask every live thread to stop after the requests queued before this call; wait up to
    `timeout_s` in all. Returns the threads still alive (stuck in a store call)."""
    live = [t for t in threads if t is not None and t.is_alive()]
    for thread in live:
        thread.request_queue.put(_StopRequest(thread.request_queue))
    deadline = time.monotonic() + timeout_s
    for thread in live:
        thread.join(max(0.0, deadline - time.monotonic()))
    return [t for t in live if t.is_alive()]
