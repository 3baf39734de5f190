"""`moonlease bench serve`'s pure part: trace to requests, reuse and age, summaries, parsing."""

from __future__ import annotations

import math

import pytest

from moonlease.bench.serve_plan import (
    LeaseMode, PlannedRequest, RequestResult, age_bucket, block_tokens, parse_cases, parse_pressures,
    plan_requests, summarize)
from moonlease.bench.trace import Trace, TraceHeader, TraceRequest

pytestmark = pytest.mark.unit


def _trace(requests: list[tuple[float, list[str]]]) -> Trace:
    return Trace(TraceHeader(workload="t", layout="full", hash_block_tokens=4),
                 tuple(TraceRequest(at, f"s{i}", tuple(h), 8) for i, (at, h) in enumerate(requests)))


def test_shared_hash_prefix_is_shared_token_prefix_and_reuse_is_measured():
    trace = _trace([(0.0, ["a", "b"]), (50.0, ["a", "b", "c"]), (100.0, ["a", "x"])])
    planned, too_long = plan_requests(trace, wall_s=10.0, max_prompt_tokens=100, max_output_tokens=3)
    assert too_long == 0
    first, second, third = planned
    assert second.token_ids[:8] == first.token_ids and len(second.token_ids) == 12
    assert third.token_ids[:4] == first.token_ids[:4] and third.token_ids[4:8] != first.token_ids[4:8]
    assert [p.at_s for p in planned] == [0.0, 5.0, 10.0]  # 100 virtual s scaled to 10 wall s
    assert (first.reusable_tokens, first.reuse_age_s) == (0, None)
    assert (second.reusable_tokens, second.reuse_age_s) == (8, 5.0)
    assert (third.reusable_tokens, third.reuse_age_s) == (4, 5.0)  # "a" last sent by the 2nd
    assert second.max_tokens == 3


def test_too_long_prompts_are_left_out_and_counted():
    trace = _trace([(0.0, ["a"]), (1.0, ["a", "b", "c"])])
    planned, too_long = plan_requests(trace, wall_s=1.0, max_prompt_tokens=8, max_output_tokens=8)
    assert [len(p.token_ids) for p in planned] == [4] and too_long == 1


def test_block_tokens_are_deterministic_and_avoid_special_ids():
    assert block_tokens("ab", 16) == block_tokens("ab", 16) != block_tokens("ac", 16)
    assert min(block_tokens("ab", 200)) >= 4


def test_summary_counts_misses_by_age_and_rates():
    planned = [PlannedRequest(0, 0.0, "s", "new", (1,) * 64, 4, 0, None),
               PlannedRequest(1, 1.0, "s", "turn", (1,) * 64, 4, 48, 0.5),
               PlannedRequest(2, 9.0, "s", "turn", (1,) * 64, 4, 48, 8.0)]
    results = [RequestResult(0, 1.0, 1.2, 64, 0, 4), RequestResult(1, 0.2, 0.4, 64, 48, 4),
               RequestResult(2, 0.9, 1.1, 64, 16, 4), RequestResult(3, None, None, 64, None, 0, "boom")]
    summary = summarize(planned, results, 10.0, {"external_hits": 30, "external_queries": 120,
                                                 "lookups": 4, "keys_leased": 10})
    assert summary.requests_ok == 3 and summary.requests_failed == 1
    assert summary.ttft_p50_s == pytest.approx(0.9)
    assert summary.store_hit_rate == pytest.approx(0.25)
    assert summary.reuse_served_rate == pytest.approx((48 + 16) / 96)
    assert summary.misses_by_age == {"5-20 s": 1}
    assert summary.reusable_by_age == {"0-1 s": 1, "5-20 s": 1}
    assert summary.keys_leased_per_lookup == pytest.approx(2.5)
    assert summary.keys_probed_per_lookup is None


def test_age_buckets():
    assert age_bucket(0.2) == "0-1 s" and age_bucket(30.0) == ">= 20 s"
    assert math.isnan(summarize([], [], 1.0, {}).ttft_p90_s)


def test_cases_and_pressures_parse_with_clear_errors():
    (case,) = parse_cases("swa-serve:agentic-swa:leaseAll+junctions")
    assert case.mode is LeaseMode.LEASE_ALL and case.junctions and case.label == "leaseAll+junctions"
    assert case.extra_config() == {"mooncake_selective_lease": False, "mooncake_kda_last_hit_only": False,
                                   "mooncake_junction_retention": True}
    with pytest.raises(ValueError, match="not one of"):
        parse_cases("m:w:everything")
    with pytest.raises(ValueError, match="MODEL:WORKLOAD:MODE"):
        parse_cases("m:leaseAll")
    (pressure,) = parse_pressures("high:24:0.95")
    assert (pressure.segment_mib, pressure.watermark) == (24, 0.95)
    with pytest.raises(ValueError, match="watermark"):
        parse_pressures("x:24:1.5")
