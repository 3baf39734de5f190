"""`moonlease bench serve` end to end, tiny: one real `vllm serve` with our connector, a real
master and store pool, a short agentic trace over the OpenAI API.

The assertions are about what the command measures and writes — never about timing or which
mode wins (speed claims live in the committed results).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[2]


def test_serve_bench_runs_a_case_and_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "results" / "serve.md"
    run = subprocess.run(
        [sys.executable, "-m", "moonlease_dev", "bench", "serve",
         "--cases", "swa-serve:agentic-swa:leaseAll", "--pressures", "tiny:16:0.9",
         "--duration-s", "120", "--wall-s", "8", "--calibrate-tokens", "256", "--repeats", "2",
         "--out", str(out), "--log-dir", str(tmp_path / "logs")],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    results = json.loads(out.with_suffix(".json").read_text())
    (record,) = results["runs"]
    summary = record["summary"]
    trace = results["traces"]["agentic-swa"]
    assert trace["requests"] > 0
    # Two replays, each from an empty store (the run checks the master's key count), pooled.
    assert len(record["repeats"]) == 2
    assert summary["requests_ok"] + summary["requests_failed"] == 2 * trace["requests"]
    assert summary["requests_failed"] == 0, record["errors"]
    assert all(r["requests_ok"] == trace["requests"] for r in record["repeats"])
    low, high = record["spread"]["ttft_p90_s"]
    assert low <= high and {low, high} == {r["ttft_p90_s"] for r in record["repeats"]}
    # The engine kept no prefix cache of its own (the default): reuse came from the store.
    assert record["engine_prefix_cache"] is False
    assert len(record["load_average"]) == 2  # the shared machine's load around the cell
    assert record["metric_deltas"]["local_hits"] == 0
    assert record["metric_deltas"]["external_hits"] > 0
    assert 0 < summary["ttft_p50_s"] <= summary["ttft_p90_s"] <= summary["ttft_p99_s"]
    # The connector really looked the prompts up in the store (its own metrics, via /metrics).
    assert record["metric_deltas"]["lookups"] > 0
    assert record["metric_deltas"]["external_queries"] > 0
    calibration = record["calibration"]
    assert calibration["prompt_tokens"] == 256 and calibration["cold_ttft_s"] > 0
    assert calibration["tokens_from_store"] > 0 and calibration["load_over_prefill"] is not None
    markdown = out.read_text()
    for part in ("## Prefill vs load on this machine", "## Results", "## Modes against leaseAll",
                 "## Against seed 002",
                 "## How to reproduce", "serve_ttft.png", "serve_hit_rate.png"):
        assert part in markdown
    for name in ("serve_ttft.png", "serve_hit_rate.png"):
        assert (out.parent / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list((tmp_path / "logs").glob("serve-*")), "logs go after a good run"
    assert "interrupted" not in run.stderr
