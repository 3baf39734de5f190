"""Moonlease retention ``retry`` (issue 21): put again what the store refused for lack of room.

Pure: no vLLM, no Mooncake. The adapters hand in the per-key answers of one batch put; which
keys to put again, and after how long, is decided here.

Why. A Mooncake put that finds no free space answers ``NO_AVAILABLE_HANDLE`` (-200) and stores
nothing for that key; the master only then flags that it must evict, and its eviction thread
(every 10 ms, `eviction_ratio` of the objects per pass, among lease-expired ones) makes room a
few passes later. Upstream's save gives up on those keys (they are written again only if a
later store batch of the same request covers them), so the state the session's next turn
resumes from — the newest blocks of the prompt — is the part that is missing. Measured on the
sliding-window replay at capacity 0.05 (`benchmarks/results/retention_capacity.md`): about
25 batch puts per run were refused in part, about 1,700 keys (4% of the keys put, all of them
a prompt's newest blocks); putting them again once the master had evicted stored every one.

Only ``NO_AVAILABLE_HANDLE`` is retried: other errors (object exists, bad arguments, a dead
master) would answer the same again. Attempts are bounded: a store whose every object is
leased (NOTES §3: puts refused for ~2 s) makes a save wait at most ``attempts * delay_s``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Mooncake's ErrorCode::NO_AVAILABLE_HANDLE: no free space for the object (vLLM's worker
#: names it MOONCAKE_NO_AVAILABLE_HANDLE).
NO_AVAILABLE_HANDLE = -200


@dataclass(frozen=True)
class PutRetryPolicy:
    """How often and after how long refused keys are put again.

    The master's eviction thread runs every 10 ms (Mooncake's ``kEvictionThreadSleepMs``);
    20 ms lets two passes run before the next attempt.
    """

    attempts: int = 3
    delay_s: float = 0.02

    def __post_init__(self) -> None:
        if self.attempts < 0 or self.delay_s < 0:
            raise ValueError("attempts and delay_s must not be negative")


DEFAULT_PUT_RETRY = PutRetryPolicy()

#: What the connector answers upstream's send thread for a key the store refused and retry
#: leaves out (a state no continuation reads): not NO_AVAILABLE_HANDLE, because upstream skips
#: every later store batch of a request after that code ("pressure") until some batch succeeds,
#: and one refused intermediate Mamba state would then drop the rest of the prompt's save
#: (found by tests/connector/test_retention_engine.py). Outside Mooncake's error codes; a key
#: answered so is still a failed put to upstream (not recorded as saved).
LEFT_OUT = -9200


def answers_for_upstream(answers: Sequence[int], retryable: Sequence[bool] | None) -> list[int]:
    """After the retries: refused keys retry left out are answered `LEFT_OUT` instead."""
    return [LEFT_OUT if answer == NO_AVAILABLE_HANDLE and retryable is not None and not retryable[i]
            else answer for i, answer in enumerate(answers)]


def plan_put_retry(answers: Sequence[int], attempts_made: int,
                   policy: PutRetryPolicy = DEFAULT_PUT_RETRY,
                   retryable: Sequence[bool] | None = None) -> tuple[int, ...]:
    """Indices of the keys to put again: those refused for lack of space, while attempts remain.

    `answers` are one batch put's per-key answers (>= 0 stored, < 0 an error code);
    `attempts_made` counts the retries already made for this batch (0 after the first put);
    `retryable[i]` False leaves key i out (the save plan's `retried`: what no continuation
    reads is not worth room); None retries every refused key.
    """
    if attempts_made >= policy.attempts:
        return ()
    return tuple(i for i, answer in enumerate(answers)
                 if answer == NO_AVAILABLE_HANDLE and (retryable is None or retryable[i]))
