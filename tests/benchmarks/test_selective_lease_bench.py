"""The selective-lease lookup benchmark runs end to end (`--quick`) and its report adds up.

One real run against a real Mooncake master (so: the `store` tier). The assertions are about
accounting and behaviour — which keys each mode leases, how many RPCs it makes — never about
timing. What survives eviction under each mode is `moonlease bench replay`'s
(tests/benchmarks/test_replay_bench.py).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.store

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "selective_lease.py"
LAYOUTS = ("full", "full+swa", "full+mamba")
SIZES = (16, 64, 256, 512)
HASH_BLOCK = 16


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    folder = tmp_path_factory.mktemp("selective-lease-bench")
    out = folder / "report.md"
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out),
                          "--log-dir", str(folder)],
                         cwd=REPO, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return out.read_text(), json.loads(out.with_suffix(".json").read_text())


def rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    return results["micro"]


def test_every_configuration_is_measured_in_each_fresh_process(quick_run):
    _, results = quick_run
    processes = results["micro_processes"]
    assert len(processes) == results["settings"]["micro"]["processes"] >= 2
    assert len({p["pid"] for p in processes}) == len(processes), "each run is a fresh process"
    measured = {(r["layout"], r["blocks"], r["transport"]) for r in rows(results)}
    assert measured == {(layout, b, t) for layout in LAYOUTS for b in SIZES for t in ("memory", "tcp")}
    for row in rows(results):
        assert row["processes"] == len(processes)
        for mode in ("leaseAll", "selective"):
            for name in ("p50_us", "p95_us"):
                latency = row["modes"][mode][name]
                assert len(latency["per_process"]) == len(processes)
                assert all(math.isfinite(v) and v > 0 for v in latency["per_process"])
                assert latency["min"] <= latency["median"] <= latency["max"]
        assert len(row["paired_delta_us"]["per_process"]) == len(processes)


def test_lease_all_leases_every_candidate_in_one_rpc(quick_run):
    _, results = quick_run
    for row in rows(results):
        lease_all = row["modes"]["leaseAll"]
        assert lease_all["rpcs"] == 1
        assert lease_all["keys_leased"] == lease_all["keys_sent"] == lease_all["keys_probed"] == row["candidates"]


def test_selective_probes_everything_then_leases_exactly_the_load_set(quick_run):
    _, results = quick_run
    for row in rows(results):
        lease_all, selective = row["modes"]["leaseAll"], row["modes"]["selective"]
        assert selective["rpcs"] == 2 and selective["rounds"] == 1
        assert selective["keys_leased"] == row["load_keys"] > 0
        assert selective["keys_sent"] == row["candidates"] + row["load_keys"]
        assert selective["hit_tokens"] == lease_all["hit_tokens"] > 0, "same hit in both modes"


def test_full_attention_leases_all_but_the_recomputed_last_block(quick_run):
    _, results = quick_run
    for row in rows(results):
        if row["layout"] != "full":
            continue
        lease_all, selective = row["modes"]["leaseAll"], row["modes"]["selective"]
        assert row["candidates"] == row["blocks"]
        assert lease_all["hit_tokens"] == (row["blocks"] - 1) * HASH_BLOCK
        assert selective["keys_leased"] == lease_all["keys_leased"] - 1


def test_sliding_window_and_mamba_lease_far_fewer_keys(quick_run):
    _, results = quick_run
    for row in rows(results):
        if row["layout"] == "full":
            continue
        lease_all, selective = row["modes"]["leaseAll"], row["modes"]["selective"]
        # Full attention reads every block of the hit; the other group only its tail.
        hit_blocks = lease_all["hit_tokens"] // HASH_BLOCK
        assert hit_blocks < selective["keys_leased"] < lease_all["keys_leased"]
        if row["blocks"] >= 64:
            assert selective["keys_leased"] < 0.7 * lease_all["keys_leased"]


def test_accounting_is_the_same_in_memory_and_over_tcp(quick_run):
    _, results = quick_run
    by_transport: dict[str, dict[tuple[str, int], Any]] = {}
    for row in rows(results):
        accounting = {mode: {k: row["modes"][mode][k] for k in ("keys_leased", "rpcs", "keys_sent", "hit_tokens")}
                      for mode in ("leaseAll", "selective")}
        by_transport.setdefault(row["transport"], {})[(row["layout"], row["blocks"])] = accounting
    assert by_transport["memory"] == by_transport["tcp"]


def test_markdown_report_shows_the_measured_numbers(quick_run):
    markdown, results = quick_run
    assert "pressure" not in results, "the store-pressure half is moonlease bench replay's"
    for heading in ("## Headline", "## 1. Lookup microbenchmark", "### Accounting per lookup",
                    "in-memory store", "TCP to a real Mooncake 0.3.14 master",
                    "--quick"):
        assert heading in markdown
    for row in rows(results):
        if row["transport"] != "memory":
            continue
        lease_all, selective = row["modes"]["leaseAll"], row["modes"]["selective"]
        line = (f"| {row['layout']} | {row['blocks']} | {row['candidates']} | {row['load_keys']} | "
                f"{lease_all['keys_leased']} | {selective['keys_leased']} | 1 | 2 |")
        assert line in markdown
