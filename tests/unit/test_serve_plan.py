"""`moonlease bench serve`'s pure part: trace to requests, reuse and age, summaries, parsing."""

from __future__ import annotations

import math

import pytest

from moonlease_settings.config import MoonleaseConnectorConfig
from moonlease_dev.bench.serve_plan import (
    LeaseMode, PlannedRequest, RequestResult, ServeCase, Separation, age_bucket, block_tokens, compare_modes,
    parse_cases, parse_pressures, plan_requests, spread_of, summarize, summarize_repeats)
from moonlease_dev.bench.trace import Trace, TraceHeader, TraceRequest

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
    assert case.extra_config() == {"mooncake_lease_mode": "leaseAll", "mooncake_junction_retention": True}
    assert MoonleaseConnectorConfig.from_sources(case.extra_config()).lease_mode is case.mode
    (off,) = parse_cases("swa-serve:agentic-swa:leaseAll+nohandoff+junctions")
    assert off.junctions and not off.handoff and off.label == "leaseAll+junctions+nohandoff"
    assert parse_cases(off.label.join(["m:w:", ""]))[0] == ServeCase("m", "w", LeaseMode.LEASE_ALL, True, False)
    assert MoonleaseConnectorConfig.from_sources(off.extra_config()).mooncake_handoff_timeout_ms == 0
    for bad in ("m:w:leaseAll+pin", "m:w:leaseAll+junctions+junctions"):
        with pytest.raises(ValueError, match="only"):
            parse_cases(bad)
    with pytest.raises(ValueError, match="not one of"):
        parse_cases("m:w:everything")
    with pytest.raises(ValueError, match="MODEL:WORKLOAD:MODE"):
        parse_cases("m:leaseAll")
    (pressure,) = parse_pressures("high:24:0.95")
    assert (pressure.segment_mib, pressure.watermark) == (24, 0.95)
    with pytest.raises(ValueError, match="watermark"):
        parse_pressures("x:24:1.5")


def test_repeats_pool_requests_and_counters_and_keep_each_summary():
    planned = [PlannedRequest(0, 0.0, "s", "new", (1,) * 64, 4, 0, None),
               PlannedRequest(1, 1.0, "s", "turn", (1,) * 64, 4, 48, 0.5)]
    first = [RequestResult(0, 1.0, 1.1, 64, 0, 4), RequestResult(1, 0.2, 0.3, 64, 48, 4)]
    second = [RequestResult(0, 3.0, 3.1, 64, 0, 4), RequestResult(1, 0.4, 0.5, 64, 0, 4)]
    pooled, (one, two) = summarize_repeats(
        planned, [first, second], [10.0, 30.0],
        [{"external_hits": 48, "external_queries": 128}, {"external_hits": 0, "external_queries": 128}])
    assert (one.store_hit_rate, two.store_hit_rate) == (pytest.approx(48 / 128), 0.0)
    assert pooled.store_hit_rate == pytest.approx(48 / 256)  # summed counters, not a mean of rates
    assert pooled.requests_ok == 4 and pooled.requests_per_s == pytest.approx(4 / 40)
    assert pooled.ttft_p50_s == pytest.approx(0.7)  # median of 0.2, 0.4, 1.0, 3.0
    assert pooled.misses_by_age == {"0-1 s": 1} and pooled.reusable_by_age == {"0-1 s": 2}
    spread = spread_of([vars(one), vars(two)])
    assert spread["store_hit_rate"] == (0.0, pytest.approx(48 / 128))
    assert spread["ttft_p90_s"] == (pytest.approx(0.92), pytest.approx(2.74))
    assert spread["keys_leased_per_lookup"] is None  # not measured in either repeat
    with pytest.raises(ValueError, match="per repeat"):
        summarize_repeats(planned, [first], [1.0, 2.0], [{}])


def _record(mode: str, p90: float, p90_range: tuple[float, float], hit: float,
            hit_range: tuple[float, float], repeats: int = 2, pressure: str = "high") -> dict:
    return {"workload": "w", "mode": mode, "pressure": {"name": pressure},
            "summary": {"ttft_p50_s": p90 / 2, "ttft_p90_s": p90, "store_hit_rate": hit},
            "repeats": [{}] * repeats, "spread": {"ttft_p90_s": list(p90_range), "store_hit_rate": list(hit_range)}}


def test_modes_are_compared_with_lease_all_in_the_same_cell_against_the_runs_own_spread():
    runs = [_record("leaseAll", 1.0, (0.9, 1.1), 0.30, (0.28, 0.32)),
            _record("selective", 0.6, (0.5, 0.7), 0.31, (0.29, 0.33)),
            _record("lastHitOnly", 1.3, (1.2, 1.4), 0.40, (0.39, 0.41)),
            _record("selective", 0.5, (0.5, 0.5), 0.9, (0.9, 0.9), pressure="low")]  # no baseline there
    selective, last_hit = compare_modes(runs)
    assert (selective.mode, selective.pressure) == ("selective", "high")
    assert selective.ttft_p90_delta_s == pytest.approx(-0.4) and selective.ttft_p50_delta_s == pytest.approx(-0.2)
    assert selective.ttft_p90 is Separation.LOWER and selective.hit_rate is Separation.OVERLAP
    assert selective.hit_rate_delta_pts == pytest.approx(1.0)
    assert last_hit.ttft_p90 is Separation.HIGHER and last_hit.hit_rate is Separation.HIGHER
    single = compare_modes([_record("leaseAll", 1.0, (1.0, 1.0), 0.3, (0.3, 0.3), repeats=1),
                            _record("selective", 0.1, (0.1, 0.1), 0.9, (0.9, 0.9), repeats=1)])
    assert single[0].ttft_p90 is Separation.SINGLE  # one run each: nothing to call separated


def test_the_engine_prefix_cache_stays_on_only_where_the_model_needs_it():
    from moonlease_dev.bench.serve_run import engine_prefix_cache

    assert engine_prefix_cache("swa-serve", requested=False) is False
    assert engine_prefix_cache("swa-serve", requested=True) is True
    # vLLM's align mode for Mamba runs only with prefix caching on.
    assert engine_prefix_cache("hybrid-serve", requested=False) is True
