"""`core.handoff`: the prefill's promise and the decode side's wait for it (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moonlease_connector.core.handoff import (
    SAVED_TOKENS_PARAM,
    HandoffOutcome,
    decide_handoff,
    expected_hit,
    handoff_params,
    promised_tokens,
)

pytestmark = pytest.mark.unit


def test_the_promise_is_made_only_when_a_router_asks_for_remote_decode():
    assert handoff_params({"do_remote_decode": True, "remote_engine_id": None}, 100) == {SAVED_TOKENS_PARAM: 100}
    assert handoff_params(None, 100) is None
    assert handoff_params({}, 100) is None
    assert handoff_params({"do_remote_decode": False}, 100) is None


def test_a_promise_reads_back_and_garbage_is_no_promise():
    assert promised_tokens(handoff_params({"do_remote_decode": True}, 64)) == 64
    assert promised_tokens({SAVED_TOKENS_PARAM: 0}) == 0
    for value in (-1, "64", True, 64.0, None, [64]):
        assert promised_tokens({SAVED_TOKENS_PARAM: value}) is None
    assert promised_tokens(None) is None
    assert promised_tokens({"do_remote_prefill": True}) is None


def aligned_to(alignment: int):
    return lambda length: length // alignment * alignment


@pytest.mark.parametrize(("promised", "request_tokens", "alignment", "expected"), [
    (100, 100, 16, 96),   # whole blocks of the prompt
    (64, 64, 16, 48),     # block-aligned prompt: vLLM computes the last token, one block lower
    (64, 100, 16, 64),    # a longer decode request: only what was promised
    (100, 64, 16, 48),    # a promise longer than this request: what this request can load
    (10, 100, 16, 0),     # less than a block: nothing to wait for
    (200, 200, 64, 192),  # hybrid: the scheduler block (lcm) alignment
    (0, 0, 16, 0),
])
def test_the_expected_hit_is_what_a_lookup_reports_once_the_save_landed(promised, request_tokens,
                                                                        alignment, expected):
    assert expected_hit(promised, request_tokens, aligned_to(alignment)) == expected


def test_the_alignment_is_the_store_coordinators_own_rule():
    calls = []
    assert expected_hit(100, 100, lambda n: calls.append(n) or 80) == 80
    assert calls == [99]  # the usable prefix is handed to the rule, which alone aligns it


def test_load_when_covered_wait_until_the_deadline_then_load_anyway():
    assert decide_handoff(covered_tokens=96, expected_tokens=96, waited_s=0.0, timeout_s=1.0) \
        is HandoffOutcome.COMPLETE
    assert decide_handoff(covered_tokens=32, expected_tokens=96, waited_s=0.5, timeout_s=1.0) is None
    assert decide_handoff(covered_tokens=32, expected_tokens=96, waited_s=1.0, timeout_s=1.0) \
        is HandoffOutcome.TIMED_OUT


@given(covered=st.integers(0, 10_000), expected=st.integers(0, 10_000),
       waited=st.floats(0, 10, allow_nan=False), timeout=st.floats(0.001, 10, allow_nan=False))
def test_a_wait_never_outlives_its_deadline_nor_holds_a_covered_request(covered, expected, waited, timeout):
    outcome = decide_handoff(covered_tokens=covered, expected_tokens=expected, waited_s=waited,
                             timeout_s=timeout)
    if outcome is None:
        assert covered < expected and waited < timeout
    else:
        assert outcome is (HandoffOutcome.COMPLETE if covered >= expected else HandoffOutcome.TIMED_OUT)
