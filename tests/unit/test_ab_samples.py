"""From two snapshots of raw series to one interval sample: deltas, resets, histograms, arms."""

from __future__ import annotations

import math

import pytest

from moonlease_operator.core.ab_samples import (
    EXTERNAL_HITS,
    EXTERNAL_QUERIES,
    PUT_ALLOC_FAILURES,
    TTFT_BUCKET,
    Series,
    Snapshot,
    build_interval,
    canonical_name,
    arm_scrape_endpoints,
    pod_matchers,
)
from moonlease_operator.core.analysis import Arm

pytestmark = pytest.mark.unit


def s(name: str, value: float, **labels: str) -> Series:
    return Series(name, tuple(sorted(labels.items())), value)


def test_counter_deltas_summed_over_pods_with_a_restart_and_a_new_pod() -> None:
    before = (s(EXTERNAL_QUERIES, 100, pod="a"), s(EXTERNAL_QUERIES, 500, pod="b"),
              s(EXTERNAL_HITS, 40, pod="a"))
    after = (s(EXTERNAL_QUERIES, 150, pod="a"),   # +50
             s(EXTERNAL_QUERIES, 30, pod="b"),    # restarted: counts its 30
             s(EXTERNAL_QUERIES, 20, pod="c"),    # new pod: counts its 20
             s(EXTERNAL_HITS, 60, pod="a"))       # +20
    interval = build_interval(Snapshot(1.0, {Arm.CONTROL: before, Arm.TREATMENT: before}),
                              Snapshot(2.0, {Arm.CONTROL: after, Arm.TREATMENT: before}))
    assert not interval.failed and (interval.start, interval.end) == (1.0, 2.0)
    assert interval.control is not None and interval.treatment is not None
    assert interval.control.external_queries == 100
    assert interval.control.external_hits == 20
    assert interval.control.prefix_queries is None  # not exposed: missing, not zero
    assert interval.treatment.external_queries == 0


def test_histogram_buckets_summed_per_bound() -> None:
    def buckets(pod: str, *counts: float) -> list[Series]:
        return [s(TTFT_BUCKET, c, pod=pod, le=le) for le, c in zip(("0.1", "1.0", "+Inf"), counts)]
    before = (*buckets("a", 1, 2, 2), *buckets("b", 0, 0, 0))
    after = (*buckets("a", 3, 5, 6), *buckets("b", 1, 1, 2))
    interval = build_interval(Snapshot(0, {Arm.CONTROL: before, Arm.TREATMENT: before}),
                              Snapshot(1, {Arm.CONTROL: after, Arm.TREATMENT: after}))
    assert interval.control is not None and interval.control.ttft is not None
    assert interval.control.ttft.buckets == ((0.1, 3.0), (1.0, 4.0), (math.inf, 6.0))


def test_an_arm_without_series_is_an_error_not_zeros() -> None:
    series = (s(PUT_ALLOC_FAILURES, 1),)
    interval = build_interval(Snapshot(0, {Arm.CONTROL: series, Arm.TREATMENT: series}),
                              Snapshot(1, {Arm.CONTROL: series, Arm.TREATMENT: ()}))
    assert interval.failed and interval.treatment is None
    assert interval.error == "no series for the treatment arm"


def test_both_spellings_of_vllm_names() -> None:
    assert canonical_name("vllm:external_prefix_cache_hits_total") == EXTERNAL_HITS
    assert canonical_name("vllm_external_prefix_cache_hits_total") == EXTERNAL_HITS
    assert canonical_name("master_put_start_alloc_failures_total") == PUT_ALLOC_FAILURES
    assert canonical_name("vllm_prefix_cache_queries_created") is None


def test_scrape_endpoints_are_the_running_pods_each_arms_workloads_select() -> None:
    def pod(app: str | None, ip: str | None, phase: str = "Running", port: str | None = None) -> dict[str, object]:
        return {"metadata": {"labels": {"app": app} if app else {},
                             "annotations": {"prometheus.io/port": port} if port else {}},
                "status": {"phase": phase, "podIP": ip}}
    pods = [pod("decode-a", "10.0.0.1"), pod("decode-b", "10.0.0.2", port="9100"), pod("decode-b", "10.0.0.3", "Pending"),
            pod(None, "10.0.0.4"), pod("decode-a", None), pod("other", "10.0.0.5"), pod("prefill-b", "10.0.0.6"),
            pod("decode-a", "10.0.0.1")]  # a second pod on the same address: one endpoint
    selectors = {Arm.CONTROL: [{"matchLabels": {"app": "decode-a"}}],
                 Arm.TREATMENT: [{"matchLabels": {"app": "decode-b"}},
                                 {"matchExpressions": [{"key": "app", "operator": "In", "values": ["prefill-b"]}]}]}
    assert arm_scrape_endpoints(pods, selectors, 8000) == {Arm.CONTROL: ["10.0.0.1:8000"],
                                                           Arm.TREATMENT: ["10.0.0.2:9100", "10.0.0.6:8000"]}


def test_pod_matchers_pick_exactly_a_workloads_pods() -> None:
    import re

    matchers = pod_matchers("ns", [("Deployment", "decode"), ("StatefulSet", "prefill.x")])
    assert matchers.startswith('namespace="ns",pod=~"')
    literal = matchers.split('pod=~"')[1].rstrip('"')
    assert literal.count("\\\\.") == 1  # PromQL string escaping: a doubled backslash
    pattern = re.compile(literal.replace("\\\\", "\\"))
    assert pattern.fullmatch("decode-6d9f7c8b5-x2x9z") and pattern.fullmatch("prefill.x-0")
    assert not pattern.fullmatch("decode-b-6d9f7c8b5-x2x9z") and not pattern.fullmatch("prefillxx-0")


def test_failed_put_keys_count_only_the_save_put_operation() -> None:
    from moonlease_operator.core.ab_samples import STORE_FAILED_KEYS

    before = (s(STORE_FAILED_KEYS, 5, operation="save_put", status="failed"),
              s(STORE_FAILED_KEYS, 100, operation="load_get", status="failed"))
    after = (s(STORE_FAILED_KEYS, 12, operation="save_put", status="failed"),
             s(STORE_FAILED_KEYS, 900, operation="load_get", status="failed"),
             s(STORE_FAILED_KEYS, 0, operation="save_exists", status="ok"))
    interval = build_interval(Snapshot(1.0, {Arm.CONTROL: before, Arm.TREATMENT: before}),
                              Snapshot(2.0, {Arm.CONTROL: after, Arm.TREATMENT: before}))
    assert interval.control is not None and interval.control.put_failed_keys == 7
    assert interval.treatment is not None and interval.treatment.put_failed_keys == 0
    assert canonical_name("vllm_mooncake_store_operation_failed_keys_total") == STORE_FAILED_KEYS


def test_source_errors_reach_the_status_short_and_without_control_characters() -> None:
    from moonlease_operator.core.ab_samples import ERROR_MESSAGE_LIMIT, clean_error_message, failed_interval

    body = "HTTP 502: <html>\r\n\x1b[31mBad gateway\x1b[0m\t" + "x" * 500
    cleaned = clean_error_message(body)
    assert len(cleaned) == ERROR_MESSAGE_LIMIT and cleaned.endswith("…")
    assert not any(ord(ch) < 32 or 127 <= ord(ch) < 160 for ch in cleaned)
    assert cleaned.startswith("HTTP 502: <html> [31mBad gateway [0m x")
    interval = failed_interval(1.0, 2.0, "\n\n")
    assert interval.failed and interval.error == "measurement failed"
