"""Keep the interpreter from finalizing while one of our threads is inside a Mooncake call.

I/O adapter (threads, interpreter exit). Mooncake's client is a pybind11 module that releases
the GIL for the length of each call. When a call returns while CPython 3.11 is finalizing, the
thread's `PyEval_RestoreThread` ends it with `pthread_exit`; the forced unwind meets pybind11's
`noexcept` GIL guard and `std::terminate` aborts the whole process ("terminate called without
an active exception", SIGABRT) — after a clean shutdown, with nothing lost but the exit
status and a core file. It happens to a call we abandoned on a frozen master (a lookup past its
deadline, a bounded `remove_all` or close) when the master answers just as the engine exits:
reproduced 15 times in 16 with the master resumed 0 to 0.8 s after the exit began.

So threads that may be abandoned in a store call enter `native_call()` around it, and close
registers transfer threads it left stuck (`wait_at_exit_for`); an `atexit` hook — atexit runs
before finalization starts — waits for both, at most `EXIT_WAIT_S`. A master that stays frozen
past that is left behind, as before: the process exits while the call is still out, which is
safe; only an answer landing in the last moments of finalization can still abort (CPython 3.14
hangs such threads instead of unwinding them).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Iterator

logger = logging.getLogger("vllm.moonlease.connector.exit_guard")

#: The longest interpreter exit waits for abandoned store calls to come back.
EXIT_WAIT_S = 5.0
POLL_S = 0.01

_lock = threading.Lock()
_calls_out = 0
_stuck_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


@contextlib.contextmanager
def native_call() -> Iterator[None]:
    """Mark this thread as inside a Mooncake call that its caller may stop waiting for."""
    global _calls_out
    with _lock:
        _calls_out += 1
    try:
        yield
    finally:
        with _lock:
            _calls_out -= 1


def calls_out() -> int:
    """How many threads are inside a `native_call()` now."""
    return _calls_out


def wait_at_exit_for(thread: threading.Thread) -> None:
    """Have interpreter exit wait (bounded) for `thread`, left inside a store call at close."""
    _stuck_threads.add(thread)


def wait_for_calls(timeout_s: float) -> bool:
    """Wait until no marked call is out and no registered thread is alive; False past `timeout_s`.

    Sleeps in short steps (releasing the GIL) so the returning threads can run."""
    deadline = time.monotonic() + timeout_s
    while _calls_out > 0 or any(thread.is_alive() for thread in list(_stuck_threads)):
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def _wait_at_exit() -> None:
    if wait_for_calls(0.0):
        return  # nothing out: exit as before
    started = time.monotonic()
    if wait_for_calls(EXIT_WAIT_S):
        logger.info("waited %.2f s at exit for abandoned Mooncake calls to return",
                    time.monotonic() - started)
    else:
        logger.warning("%d abandoned Mooncake call(s) still out after %.0f s at exit (a master not "
                       "answering); exiting without them", _calls_out, EXIT_WAIT_S)


atexit.register(_wait_at_exit)
