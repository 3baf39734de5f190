"""When a load gets a deadline, and how its blocks' pins settle. Pure.

A load (`BatchGet` into the request's blocks) that fails is reported to vLLM, which recomputes
the tokens under `kv_load_failure_policy: recompute` and fails the request under `fail`
(vLLM's default). A deadline turns a load stuck on a frozen master into such a failure: worth
it only where vLLM recomputes, a regression where it would fail a request upstream's unbounded
wait would have served. An abandoned call may still write into the blocks it was given when it
returns, so the scheduler pins a load's blocks until every rank reports its calls returned
(`LoadPins`).
"""

from __future__ import annotations

import threading
from collections import Counter

#: vLLM's `KVTransferConfig.kv_load_failure_policy` values.
RECOMPUTE = "recompute"
#: The value a load past its deadline reports for each key (Mooncake's codes are small negatives).
LOAD_DEADLINE_PASSED = -90_001


def load_deadline_s(timeout_ms: int, failure_policy: str) -> float | None:
    """The deadline of one load's store call, or None for upstream's unbounded wait."""
    if timeout_ms <= 0 or failure_policy != RECOMPUTE:
        return None
    return timeout_ms / 1000


def policy_warning(failure_policy: str) -> str | None:
    """What to tell an operator whose engine fails requests on a store fault; None if it recomputes."""
    if failure_policy == RECOMPUTE:
        return None
    return (f"kv_load_failure_policy is {failure_policy!r}: a Mooncake load that fails (a master "
            "frozen or restarted between a lookup hit and its load, an expired lease) fails the "
            "request instead of recomputing its tokens, and loads wait without a deadline "
            "(mooncake_load_timeout_ms is not applied). Set \"kv_load_failure_policy\": "
            "\"recompute\" in --kv-transfer-config.")


class LoadPins:
    """Per-rank tally of loads whose store calls have all returned, by pin id (thread-safe):
    receive threads settle, the step's worker metadata takes them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._settled: Counter[int] = Counter()

    def settle(self, pin: int) -> None:
        with self._lock:
            self._settled[pin] += 1

    def take(self) -> dict[int, int]:
        with self._lock:
            settled, self._settled = dict(self._settled), Counter()
        return settled
