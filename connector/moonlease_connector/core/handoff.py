"""Prefill/decode through the store: the decode engine waits, bounded, for the prefill's save.

Pure: no vLLM, no Mooncake.

Why. A P/D router (vllm-router, production-stack's orchestrated mode) sends a request to a
prefill engine with ``max_tokens: 1`` and ``kv_transfer_params.do_remote_decode``, then the
original request to a decode engine with whatever ``kv_transfer_params`` the prefill's response
carried. vLLM answers the prefill request as soon as its token is sampled, while the
connector's save of the prompt's KV runs after that on the worker's sending thread (upstream's
saves are asynchronous and do not hold the response). A decode engine that looks the prompt up
within those milliseconds finds part of it or nothing and recomputes the prompt — the known
race of store-based P/D (github.com/LMCache/LMCache/issues/1350), which a loaded host makes likely.

The hand-off. The prefill engine's connector says in its response how many prompt tokens its
saves cover (`handoff_params`); the decode engine's scheduler, reading that promise from its
request (`promised_tokens`), looks the prompt up again, at most every `POLL_INTERVAL_S`, until
the store covers what it can load of them (`expected_hit`) or `mooncake_handoff_timeout_ms`
passes, and then loads what is there (`decide_handoff`). A request without the promise (no
router, a prefill engine without Moonlease) is looked up once, as upstream's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any

#: The key of the prefill's promise in ``kv_transfer_params``.
SAVED_TOKENS_PARAM = "moonlease_saved_tokens"
#: A waiting request is looked up again at most this often (vLLM asks every scheduler step).
POLL_INTERVAL_S = 0.01


def handoff_params(kv_transfer_params: Mapping[str, Any] | None,
                   prompt_tokens: int) -> dict[str, Any] | None:
    """What a saving engine adds to a finished request's response: the promise, only when a
    router asked for remote decode (``do_remote_decode``), so other responses stay upstream's."""
    if not kv_transfer_params or not kv_transfer_params.get("do_remote_decode"):
        return None
    return {SAVED_TOKENS_PARAM: max(0, int(prompt_tokens))}


def promised_tokens(kv_transfer_params: Mapping[str, Any] | None) -> int | None:
    """The prompt tokens a prefill engine saved for this request, or None (no promise, or a
    value that is not a non-negative integer: a request is never held on a malformed one)."""
    if not kv_transfer_params:
        return None
    value = kv_transfer_params.get(SAVED_TOKENS_PARAM)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def expected_hit(promised: int, request_tokens: int, align: Callable[[int], int]) -> int:
    """The hit a lookup reports once the promised save has landed: the promised prefix, short of
    the request's last token (vLLM computes it itself), aligned by the store's own rule (`align`:
    upstream's `MooncakeStoreCoordinator.align_lookup_length`)."""
    return align(max(0, min(promised, request_tokens - 1)))


class HandoffOutcome(str, Enum):
    """How a wait ended (the label of `vllm:moonlease_handoff_waits_total`)."""

    COMPLETE = "complete"  # the store held everything promised
    TIMED_OUT = "timed_out"  # the deadline passed first: loads what is there, recomputes the rest


def decide_handoff(*, covered_tokens: int, expected_tokens: int, waited_s: float,
                   timeout_s: float) -> HandoffOutcome | None:
    """Load once the store (with what vLLM holds locally) covers the expected hit, or once
    `timeout_s` since the first lookup has passed (the outcome says which); None: wait."""
    if covered_tokens >= expected_tokens:
        return HandoffOutcome.COMPLETE
    if waited_s >= timeout_s:
        return HandoffOutcome.TIMED_OUT
    return None
