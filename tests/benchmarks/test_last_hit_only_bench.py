"""Seed 000's benchmark runs end to end, tiny, against the in-memory double and a real master.

Assertions are about accounting — RPCs, keys sent and leased per lookup, equal hits — never
about timing (speed claims live in the committed results).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.store

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "last_hit_only.py"


def test_tiny_run_accounts_for_every_path(tmp_path: Path) -> None:
    out = tmp_path / "report.md"
    run = subprocess.run([sys.executable, str(SCRIPT), "--iterations", "5", "--warmup", "1",
                          "--processes", "1", "--stores", "memory,tcp", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    rows = json.loads(out.with_suffix(".json").read_text())
    assert {(row["store"], row["kv_checkpoints"]) for row in rows} == {
        ("memory", 128), ("memory", 16), ("tcp", 128), ("tcp", 16)}
    for row in rows:
        paths, kv = row["paths"], row["kv_checkpoints"]
        assert paths["upstream"]["hit"] == paths["leaseAll"]["hit"] == paths["lastHitOnly"]["hit"] > 0
        assert paths["upstream"]["keys_sent"] == paths["leaseAll"]["keys_sent"] == 128 + 4 * 128
        assert paths["upstream"]["rpcs"] == paths["leaseAll"]["rpcs"] == 1
        assert paths["leaseAll"]["coordinator_passes"] == paths["upstream"]["coordinator_passes"] > 0
        assert paths["leaseAll"]["keys_leased"] == kv + 4 * 128
        # Last-hit-only: one LastHitOnly candidate of the KV keys and the last checkpoint's
        # four keys, leased only when all are present (every KV block stored: one call). With
        # KV for 16 checkpoints only, that call leases nothing and its per-key answer bounds
        # the checkpoint: a second candidate of the 16 KV keys and that checkpoint's keys.
        # Either way the hit is read off the answers without vLLM's rule.
        assert paths["lastHitOnly"]["rpcs"] == (1 if kv == 128 else 2)
        assert paths["lastHitOnly"]["keys_sent"] == 128 + 4 + (0 if kv == 128 else kv + 4)
        assert paths["lastHitOnly"]["keys_leased"] == kv + 4, "the KV hit and one checkpoint"
        assert paths["lastHitOnly"]["coordinator_passes"] == 0
        # Under the old in-process deadline (a helper thread): the same calls and answer.
        for key in ("hit", "rpcs", "keys_sent", "keys_leased", "coordinator_passes"):
            assert paths["lastHitOnlyHandoff"][key] == paths["lastHitOnly"][key], key
        # The bare calls of the one-round-trip question: last-hit-only's two calls alone, and
        # the padded one-call design, whose one complete-last candidate is exactly the KV
        # prefix the load reads and the selected checkpoint (what last-hit-only leases).
        assert paths["call1"]["keys_sent"] == 128 + 4 and paths["call2"]["keys_sent"] == kv + 4
        assert paths["call1"]["keys_leased"] == (kv + 4 if kv == 128 else 0)
        assert paths["call2"]["keys_leased"] == kv + 4
        assert paths["paddedOneCall"]["keys_sent"] == 128 * (128 + 4)
        assert paths["paddedOneCall"]["keys_leased"] == paths["lastHitOnly"]["keys_leased"]
        assert all(paths[p]["rpcs"] == 1 for p in ("call1", "call2", "paddedOneCall"))
        # Through the scheduler's lookup channel, with either client: the same lookup.
        for path in ("viaUpstreamClient", "viaBoundedClient"):
            for key in ("hit", "rpcs", "keys_sent"):
                assert paths[path][key] == paths["lastHitOnly"][key], (path, key)
        # Selective: a lease-free probe of lease-all's candidates, then a lease of the load set.
        assert paths["selective"]["hit"] == paths["upstream"]["hit"]
        assert paths["selective"]["rpcs"] == 2
        assert paths["selective"]["keys_leased"] == paths["selective"]["hit"] // 64 + 4, \
            "the KV blocks the load reads and the one checkpoint it resumes from"
    report = out.read_text()
    assert report.count("seed ×") == 4 and "| tcp | 16 | lastHitOnly |" in report
    assert report.count("target ≤") == 4
    assert "in-process hand-off" in report and report.count(" µs CPU") == 8
    assert report.count("(the channel: ") == 4
    assert report.count("; without call2 ") == 2 and report.count("one call here already") == 2 and "upstream's own lease-all" in report
    assert "Where last-hit-only's own time goes" in report and "Machine load" in report
