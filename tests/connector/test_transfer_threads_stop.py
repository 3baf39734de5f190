"""The worker's send and receive threads stop when it closes.

Upstream's `KVTransferThread.run` loops forever (a `None` request is skipped, every `Exception`
caught), so a closed worker kept them — and through their bound callbacks itself — alive for the
life of the process. `stop_transfer_threads` ends upstream's classes and ours alike after what
they hold. Real thread classes with a store that records calls; no servers: unit tier.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
    KVCacheStoreRecvingThread,
    KVCacheStoreSendingThread,
)

from moonlease_connector.adapters.vllm_load import DeadlineRecvingThread
from moonlease_connector.adapters.vllm_save import JunctionSendingThread
from moonlease_connector.adapters.vllm_threads import stop_transfer_threads
from moonlease_connector.core.load_deadline import LoadPins

pytestmark = pytest.mark.unit


class SlowRequest:
    """A request its thread's handler takes for a while (it fails on the first real field)."""

    def __init__(self, handled: threading.Event, hold_s: float) -> None:
        self.handled, self.hold_s = handled, hold_s

    def __getattr__(self, name: str) -> Any:
        time.sleep(self.hold_s)
        self.handled.set()
        raise AttributeError(name)  # not a real request: upstream's loop logs it and goes on


def send_args() -> tuple[Any, ...]:
    # store, coord, token_databases, block_size, tp_rank, group_put_steps, kv_role, ready_event
    return (object(), object(), [], 16, 0, [1], "kv_both", threading.Event())


def recv_args() -> tuple[Any, ...]:
    # store, coord, token_databases, block_size, tp_rank, ready_event
    return (object(), object(), [], 16, 0, threading.Event())


def started(*threads: threading.Thread) -> list[threading.Thread]:
    for thread in threads:
        thread.start()
    return list(threads)


def test_upstreams_and_our_transfer_threads_stop_after_what_they_hold():
    shared: queue.Queue[Any] = queue.Queue()  # upstream's receive threads share one queue
    threads = started(
        KVCacheStoreSendingThread(*send_args()),
        JunctionSendingThread(*send_args(), on_junction_tails_saved=lambda n: None),
        KVCacheStoreRecvingThread(*recv_args(), request_queue=shared),
        KVCacheStoreRecvingThread(*recv_args(), request_queue=shared),
        DeadlineRecvingThread(*recv_args(), load_timeout_s=1.0, pins=LoadPins()),
    )
    handled = threading.Event()
    threads[0].request_queue.put(SlowRequest(handled, hold_s=0.3))
    # Upstream's own loop skips None and swallows errors: without the stop they run on.
    threads[1].request_queue.put(None)
    time.sleep(0.1)
    assert all(t.is_alive() for t in threads)

    assert stop_transfer_threads([*threads, None], timeout_s=20) == []
    assert handled.is_set(), "the request queued before the stop was handled first"
    assert not any(t.is_alive() for t in threads)
    # The stop leaves nothing unfinished on a queue (a later join never hangs); the one left on
    # the first is upstream's own: a request that fails before its handler's `try` is never
    # marked done.
    assert [t.request_queue.unfinished_tasks for t in threads] == [1, 0, 0, 0, 0]
    assert stop_transfer_threads(threads, timeout_s=1) == []  # idempotent: nothing alive to stop


def test_a_thread_stuck_in_a_call_is_reported_and_stops_once_it_returns():
    thread = started(KVCacheStoreSendingThread(*send_args()))[0]
    handled = threading.Event()
    thread.request_queue.put(SlowRequest(handled, hold_s=1.5))
    time.sleep(0.1)
    assert stop_transfer_threads([thread], timeout_s=0.2) == [thread]
    thread.join(20)
    assert handled.is_set() and not thread.is_alive()
