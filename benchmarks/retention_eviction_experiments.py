#!/usr/bin/env python
"""Single-cell experiments for the sliding-window gap (issue 21): one replay run, one change.

Each experiment is one run of `moonlease bench replay`'s own replay (`replay_requests`, a fresh
real Mooncake 0.3.14 master and store pool, the connector's lookup and upstream's save) of one
workload at one capacity, in one mode, with one of:
- ``--eviction-ratio R``: the master's `eviction_ratio` (same segment, so capacity is defined
  as in every other run: the share of the trace's stored bytes below the 0.8 watermark);
- ``--slack S`` (modes with retention ``evict``): the share of the store's capacity a put that
  needs room frees beyond what it needs (`core.store_room.bytes_to_free`).

It appends one JSON row to benchmarks/results/retention_evict_experiments.jsonl (the ablation
in benchmarks/results/retention_evict.md reads them). Hit rates are one run each: compare
rows of one session, and confirm a kept change with `moonlease bench replay --repeats 3`.

    .venv/bin/python benchmarks/retention_eviction_experiments.py --mode leaseAll+junctions+evict
    .venv/bin/python benchmarks/retention_eviction_experiments.py --mode leaseAll+junctions+retry --eviction-ratio 0.01
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "connector", ROOT / "operator", ROOT / "settings"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from moonlease_dev import devenv  # noqa: E402


def run(trace: Any, mode_name: str, capacity: float, wall_s: float, *, eviction_ratio: float,
        slack: float) -> dict[str, Any]:
    from moonlease_dev.bench.replay import (
        MODES, Pacer, ReplaySettings, build_ideal_replay, build_mode_result, build_replay_eviction,
        replay_requests, segment_mib_for)
    from moonlease_dev.bench.stores import MooncakeBed
    from moonlease_connector.adapters.mooncake_store import build_soft_pin_config

    settings = ReplaySettings(wall_s_per_run=wall_s)
    mode = MODES[mode_name]
    base = build_ideal_replay(trace, junction_retention=False, sizes=settings.sizes)
    ideal = build_ideal_replay(trace, junction_retention=mode.junction_retention, sizes=settings.sizes)
    segment = segment_mib_for(base.stored_bytes, capacity, settings.watermark)
    scale = wall_s / trace.span_s
    bed = MooncakeBed(segment_mib=segment, lease_ttl_ms=max(1, round(settings.lease_ttl_s * 1000 * scale)),
                      watermark=settings.watermark, eviction_ratio=eviction_ratio,
                      log_dir=Path(tempfile.mkdtemp(prefix="retention-evict-")),
                      soft_pin_ttl_ms=max(1, round(settings.soft_pin_ttl_s * 1000 * scale)))
    eviction = None
    if mode.retention.evict:
        eviction = build_replay_eviction(bed, settings.watermark)
        eviction.slack = slack
    started = time.monotonic()
    try:
        result = replay_requests(trace, bed.client, mode, ideal, settings.sizes, pacer=Pacer(scale),
                                 pin_config=build_soft_pin_config() if mode.retention.pin else None,
                                 eviction=eviction)
        metrics = bed.metrics()
    finally:
        bed.close()
    summary = build_mode_result(result)
    return {"mode": mode_name, "capacity": capacity, "eviction_ratio": eviction_ratio,
            "slack": slack if eviction is not None else None, "hit_rate": summary["hit_rate"],
            "put_failures": summary["put_failures"], "put_failed_keys": summary["put_failed_keys"],
            "keys_retried": summary["keys_retried"],
            "master_evicted": metrics.get("master_evicted_key_count", 0.0),
            "connector_removed": eviction.removed_keys if eviction else 0,
            "remove_refused_leased": eviction.refused_keys if eviction else 0,
            "wall_s": time.monotonic() - started, "late_s": summary["stretch_s"]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", default="leaseAll+junctions+evict")
    parser.add_argument("--workload", default="agentic-swa")
    parser.add_argument("--capacity", type=float, default=0.05)
    parser.add_argument("--wall-s-per-run", type=float, default=15.0)
    parser.add_argument("--eviction-ratio", type=float, default=0.05)
    parser.add_argument("--slack", type=float, default=0.0)
    parser.add_argument("--log", type=Path, default=ROOT / "benchmarks/results/retention_evict_experiments.jsonl")
    args = parser.parse_args(argv)
    devenv.preload()
    from moonlease_dev.bench.workload import build_named_trace

    trace = build_named_trace(args.workload, seed=1)
    row = run(trace, args.mode, args.capacity, args.wall_s_per_run, eviction_ratio=args.eviction_ratio,
              slack=args.slack)
    row["workload"] = args.workload
    row["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    row["command"] = "python benchmarks/retention_eviction_experiments.py " + " ".join(argv or sys.argv[1:])
    with args.log.open("a") as log:
        log.write(json.dumps(row) + "\n")
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
