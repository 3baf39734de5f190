"""`moonlease bench serve --engines`: the layout, the counters of a P/D fleet, the report (pure)."""

from __future__ import annotations

import argparse

import pytest

from moonlease_dev.bench.serve_command import add_serve_arguments
from moonlease_dev.bench.serve_plan import (
    EngineLayout, PlannedRequest, RequestResult, combine_role_counters, parse_engines, spread_of,
    summarize_repeats)
from moonlease_dev.bench.serve_report import render_markdown

pytestmark = pytest.mark.unit


def test_engines_parse_as_prefill_colon_decode() -> None:
    assert parse_engines("2:1") == EngineLayout(2, 1, "round_robin")
    assert parse_engines("4:1", "random").label == "4 prefill + 1 decode"


@pytest.mark.parametrize(("text", "message"), [
    ("2", "want PREFILL:DECODE"), ("2:1:1", "want PREFILL:DECODE"), ("a:1", "want PREFILL:DECODE"),
    ("0:1", "at least one prefill and one decode"), ("2:0", "at least one prefill and one decode"),
])
def test_bad_engine_layouts_are_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_engines(text)


def test_an_unknown_router_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="router policy 'nearest'"):
        parse_engines("2:1", "nearest")


def test_the_command_line_takes_engines_and_refuses_bad_ones() -> None:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    assert parser.parse_args([]).engines is None  # one engine serving alone, as before
    assert parser.parse_args(["--engines", "3:2"]).engines == EngineLayout(3, 2)
    with pytest.raises(SystemExit):
        parser.parse_args(["--engines", "3"])


def test_prefill_counters_are_the_store_figures_and_decode_ones_are_kept_apart() -> None:
    prefill = [{"external_hits": 32.0, "external_queries": 100.0, "lookups": 2.0},
               {"external_hits": 16.0, "external_queries": 60.0, "lookups": 1.0}]
    decode = [{"external_hits": 150.0, "external_queries": 160.0, "lookups": 3.0}]
    combined = combine_role_counters(prefill, decode)
    assert combined["external_hits"] == 48.0 and combined["external_queries"] == 160.0
    assert combined["lookups"] == 3.0
    assert combined["decode_external_hits"] == 150.0 and combined["decode_lookups"] == 3.0
    planned = [PlannedRequest(0, 0.0, "s", "new", (5,) * 40, 2, 0, None)]
    results = [RequestResult(0, 0.5, 0.6, 40, 0, 2)]
    pooled, (one,) = summarize_repeats(planned, [results], [1.0], [combined])
    assert one.store_hit_rate == pytest.approx(48 / 160)
    assert one.decode_load_rate == pytest.approx(150 / 160)
    assert pooled.decode_load_rate == one.decode_load_rate
    assert spread_of([vars(one)])["decode_load_rate"] == (one.decode_load_rate, one.decode_load_rate)


def test_a_single_engine_has_no_decode_load_rate() -> None:
    planned = [PlannedRequest(0, 0.0, "s", "new", (5,) * 40, 2, 0, None)]
    pooled, _ = summarize_repeats(planned, [[RequestResult(0, 0.5, 0.6, 40, 0, 2)]], [1.0],
                                  [{"external_hits": 1.0, "external_queries": 2.0}])
    assert pooled.decode_load_rate is None


def _results(engines: dict | None) -> dict:
    summary = {"ttft_p50_s": 0.5, "ttft_p90_s": 0.9, "ttft_p99_s": 1.0, "requests_ok": 1, "requests_failed": 0,
               "wall_s": 1.0, "requests_per_s": 1.0, "prompt_tokens_per_s": 40.0, "store_hit_rate": 0.3,
               "reuse_served_rate": None, "misses_by_age": {}, "reusable_by_age": {},
               "keys_leased_per_lookup": None, "keys_probed_per_lookup": None, "lookups": 1.0,
               "evictions": 0.0, "decode_load_rate": 0.94 if engines else None}
    return {"command": "moonlease bench serve", "environment": {}, "wall_seconds": 60.0,
            "settings": {"concurrency": 4, "repeats": 1, "engines": engines,
                         "pressures": [{"name": "high", "segment_mib": 16, "watermark": 0.25}]},
            "traces": {"w": {"requests": 1, "prompt_tokens": 40, "left_out": 0, "layout": "swa"}},
            "runs": [{"model": "m", "workload": "w", "mode": "leaseAll", "summary": summary,
                      "pressure": {"name": "high", "segment_mib": 16, "watermark": 0.25}}]}


def test_the_report_says_how_requests_were_served_and_shows_decode_loads() -> None:
    routed = render_markdown(_results({"prefill": 2, "decode": 1, "policy": "round_robin"}))
    assert "2 prefill engine(s)" in routed and "vllm-router" in routed
    header = next(line for line in routed.splitlines() if line.startswith("| pressure | mode"))
    row = next(line for line in routed.splitlines() if line.startswith("| high"))
    assert header.endswith("decode loads | hand-off |") and row.endswith("94.0 % | – |")  # a run from before
    assert header.count("|") == row.count("|")
    measured = _results({"prefill": 2, "decode": 1, "policy": "round_robin"})
    measured["runs"][0]["metric_deltas"] = {"decode_handoffs_complete": 150.0, "decode_handoffs_timed_out": 5.0}
    assert next(line for line in render_markdown(measured).splitlines()
                if line.startswith("| high")).endswith("94.0 % | 150 / 5 |")
    alone = render_markdown(_results(None))
    assert "vllm-router" not in alone and "decode loads" not in alone and "hand-off |" not in alone


def test_the_seed_comparison_names_the_engines_that_served() -> None:
    routed = render_markdown(_results({"prefill": 2, "decode": 1, "policy": "round_robin"}))
    assert "2 prefill engines and 1 decode engine behind a router (round-robin)" in routed
    alone = render_markdown(_results(None))
    assert "one engine per arm" in alone and "prefill engines" not in alone
