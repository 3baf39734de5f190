"""A deadline on blocking Mooncake client calls, with at most one abandoned call at a time.

I/O adapter. Mooncake's client calls are blocking C++ calls with no deadline of their own: a
frozen master holds the calling thread for as long as it stays frozen. `BoundedCaller` runs each
call on one helper thread and waits at most `timeout_s`; past it the caller gets `TIMED_OUT` and
goes on. The abandoned call keeps the helper thread until it returns; meanwhile every later call
is answered `BUSY` at once, without queueing, so abandoned calls can never pile up.

Used where no one else bounds the wait: the reset's `remove_all` and the worker's close, the
last-hit-only contract probe, and a lookup called in-process with no lookup client in front
(`vllm_lookup.lookup_deadline_for`). Lookups served to the scheduler run inline: its
`BoundedLookupClient` holds their deadline. The hand-off is kept to C-level primitives: a
`SimpleQueue` to the helper and a raw lock per call that the helper releases when the answer is
in (an `Event` costs a `Condition` and a second lock per wait; measured ~5 µs more per call).
"""

from __future__ import annotations

import _thread
import queue
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from moonlease_connector.adapters.exit_guard import native_call


class CallStatus(str, Enum):
    OK = "ok"
    RAISED = "raised"  # the call raised: `error` says what
    TIMED_OUT = "timed_out"  # no answer within the deadline; the call was abandoned
    BUSY = "busy"  # an abandoned call still holds the helper thread: not attempted


@dataclass(frozen=True)
class CallResult:
    status: CallStatus
    value: Any = None
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.status is CallStatus.OK


class _Slot:
    """One call's answer box: `done` is held until the helper has put the result in."""

    __slots__ = ("done", "result")

    def __init__(self) -> None:
        self.done = _thread.allocate_lock()
        self.done.acquire()
        self.result: CallResult | None = None


class _HelperState:
    """What the helper thread shares with its caller (the thread holds no reference to the
    caller itself, so a dropped caller is collected and its thread told to stop)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.busy = False
        self.requests: queue.SimpleQueue[tuple[Callable[[], Any], _Slot] | None] = queue.SimpleQueue()


def _serve(state: _HelperState) -> None:
    while True:
        request = state.requests.get()
        if request is None:
            return
        fn, slot = request
        try:
            with native_call():  # interpreter exit waits for it (`exit_guard`)
                result = CallResult(CallStatus.OK, fn())
        except BaseException as error:  # noqa: BLE001 - handed to the caller, never lost
            result = CallResult(CallStatus.RAISED, error=error)
        del fn, request
        with state.lock:
            state.busy = False
        slot.result = result
        slot.done.release()


class BoundedCaller:
    """Runs blocking calls on one helper thread; waits at most `timeout_s` for each."""

    def __init__(self, timeout_s: float, *, name: str = "moonlease-store-call") -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self._name = name
        self._state = _HelperState()
        self._closed = False
        self._started = False
        # Stop the helper thread when this caller is closed or collected.
        self._finalizer = weakref.finalize(self, self._state.requests.put, None)

    @property
    def busy(self) -> bool:
        """True while a call (possibly abandoned) runs on the helper thread."""
        return self._state.busy

    def call(self, fn: Callable[[], Any], timeout_s: float | None = None) -> CallResult:
        """`fn()` on the helper thread, waited for at most `timeout_s` (default: the caller's)."""
        if sys.is_finalizing():
            # Interpreter shutdown (a `__del__` closing the store): no thread can start now —
            # `Thread.start()` would wait forever — so the call runs here, without a deadline.
            try:
                return CallResult(CallStatus.OK, fn())
            except Exception as error:  # noqa: BLE001 - reported as data, like the helper's
                return CallResult(CallStatus.RAISED, error=error)
        state = self._state
        with state.lock:
            if state.busy or self._closed:
                return CallResult(CallStatus.BUSY)
            state.busy = True
            if not self._started:
                threading.Thread(target=_serve, args=(state,), name=self._name, daemon=True).start()
                self._started = True
        slot = _Slot()
        state.requests.put((fn, slot))
        if slot.done.acquire(True, self.timeout_s if timeout_s is None else timeout_s):
            assert slot.result is not None
            return slot.result
        return CallResult(CallStatus.TIMED_OUT)

    def close(self) -> None:
        """Stop the helper thread once its current call (if any) returns; never waits."""
        with self._state.lock:
            self._closed = True
        self._finalizer()
