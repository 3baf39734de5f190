#!/usr/bin/env python
"""Where the store's capacity goes on the sliding-window trace (issue 21), and why requests miss.

What it measures
----------------
`moonlease bench replay`'s own replay (`moonlease_dev.bench.replay.replay_requests`: the
connector's lookup, upstream's save, a fresh real Mooncake 0.3.14 master and store pool per
mode) of the `agentic-swa` trace at one capacity, with two lease-free observers
(`batch_probe_key(..., "none")`: they renew nothing, so eviction is as without them):
- **composition**: every 20th request, which of the keys stored so far are still in the
  store, by what they are — a full-attention block or a sliding-window block; read again by
  a later request's ideal load (the never-evicting replay) or never; a block of a prefix four
  or more sessions share (the system prompts); a window block never read again whose session
  has since sent a longer prompt over it (a *superseded tail*). Reported as the mean number
  of objects per sample and their share;
- **misses**: before each request whose ideal load finds keys missing, the first missing key
  in prompt order, and whether keys after it are still there (a *hole*: the prefix broke in
  the middle while later blocks survived — what a least-recently-used eviction of prompts
  touched together would not do) or nothing after it is (the conversation is gone);
- **put failures**: keys whose put the store refused for lack of space (NO_AVAILABLE_HANDLE).

How to reproduce
----------------
    make setup
    .venv/bin/python benchmarks/retention_capacity.py            # ~3 min on 2 cores
    .venv/bin/python benchmarks/retention_capacity.py --modes leaseAll --capacity 0.15

Writes benchmarks/results/retention_capacity.md (and .json beside it).
"""

from __future__ import annotations

import argparse
import bisect
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "connector", ROOT / "operator", ROOT / "settings"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from moonlease_dev import devenv  # noqa: E402

SHARED_SESSIONS = 4  # a block in this many sessions' prompts counts as a shared prefix


class RecordingStore:
    """Forwards to the real client; remembers every key a save put (the observers' universe)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.written: set[str] = set()

    def put_batch(self, keys: list[str], values: list[bytes], config: Any = None) -> int:
        self.written.update(keys)
        return self.inner.put_batch(keys, values, config) if config is not None \
            else self.inner.put_batch(keys, values)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def key_parts(key: str) -> tuple[int, str]:
    """(group id, block hash hex) of a replay key."""
    return int(key.split("@group:")[1].split("@")[0]), key.rsplit("@", 1)[1]


class Classifier:
    """What a stored key is, from the trace and the ideal replay (pure)."""

    def __init__(self, trace: Any, ideal_reads: Sequence[Sequence[str]]) -> None:
        self.trace = trace
        self.reads_at: dict[str, list[int]] = defaultdict(list)
        for step, reads in enumerate(ideal_reads):
            for key in reads:
                self.reads_at[key].append(step)
        self.sessions: dict[str, set[str]] = defaultdict(set)
        self.owner: dict[str, str] = {}
        self.session_steps: dict[str, list[int]] = defaultdict(list)
        for step, request in enumerate(trace.requests):
            self.session_steps[request.session].append(step)
            for block in request.block_hashes:
                self.sessions[block].add(request.session)
                self.owner.setdefault(block, request.session)

    def read_again(self, key: str, step: int) -> bool:
        steps = self.reads_at.get(key, [])
        return bisect.bisect_left(steps, step) < len(steps)

    def superseded(self, block: str, step: int) -> bool:
        """A later prompt of the block's session, sent before `step`, extends past it."""
        for earlier in self.session_steps[self.owner[block]]:
            if earlier >= step:
                break
            hashes = self.trace.requests[earlier].block_hashes
            if block in hashes and hashes[-1] != block:
                return True
        return False

    def kind(self, key: str, step: int) -> str:
        group, block = key_parts(key)
        name = "full-attention block" if group == 0 else "sliding-window block"
        if self.read_again(key, step):
            shared = len(self.sessions[block]) >= SHARED_SESSIONS
            return f"{name}, read again" + (" (shared prefix)" if shared else "")
        if group != 0 and self.superseded(block, step):
            return f"{name}, never read again: superseded tail"
        return f"{name}, never read again"


def classify_miss(request: Any, want: Sequence[str], present: bytes) -> str | None:
    """The first missing key of the ideal load, in prompt order, and what is left after it."""
    hashes = list(request.block_hashes)
    # Prompt order; at one block, the full-attention key before the window key.
    order = sorted(range(len(want)), key=lambda i: (hashes.index(key_parts(want[i])[1]), key_parts(want[i])[0]))
    missing = [position for position, i in enumerate(order) if not present[i]]
    if not missing:
        return None
    first = order[missing[0]]
    after = any(present[i] for i in order[missing[0] + 1:])
    group = "full-attention" if key_parts(want[first])[0] == 0 else "sliding-window"
    return f"first missing key {group}; " + ("later keys still stored (a hole)" if after
                                             else "nothing after it stored")


def run_mode(trace: Any, mode_name: str, capacity: float, wall_s: float) -> dict[str, Any]:
    from moonlease_dev.bench.replay import (
        MODES,
        Pacer,
        ReplaySettings,
        build_ideal_replay,
        build_mode_result,
        build_replay_eviction,
        replay_requests,
        segment_mib_for,
    )
    from moonlease_dev.bench.stores import MooncakeBed, fetch_presence
    from moonlease_connector.adapters.mooncake_store import build_soft_pin_config

    settings = ReplaySettings(wall_s_per_run=wall_s)
    mode = MODES[mode_name]
    base = build_ideal_replay(trace, junction_retention=False, sizes=settings.sizes)
    ideal = build_ideal_replay(trace, junction_retention=mode.junction_retention, sizes=settings.sizes)
    classifier = Classifier(trace, ideal.reads)
    segment = segment_mib_for(base.stored_bytes, capacity, settings.watermark)
    scale = wall_s / trace.span_s
    bed = MooncakeBed(segment_mib=segment, lease_ttl_ms=max(1, round(settings.lease_ttl_s * 1000 * scale)),
                      watermark=settings.watermark, eviction_ratio=settings.eviction_ratio,
                      log_dir=Path(tempfile.mkdtemp(prefix="retention-capacity-")),
                      soft_pin_ttl_ms=max(1, round(settings.soft_pin_ttl_s * 1000 * scale)))
    store = RecordingStore(bed.client)
    composition: Counter[str] = Counter()
    misses: Counter[str] = Counter()
    samples = 0

    def observe(step: int) -> None:
        nonlocal samples
        want = ideal.reads[step]
        if want:
            verdict = classify_miss(trace.requests[step], want, fetch_presence(bed.client, list(want)))
            if verdict is not None:
                misses[verdict] += 1
        if step % 20 == 10 and store.written:
            keys = sorted(store.written)
            present = fetch_presence(bed.client, keys)
            composition.update(classifier.kind(key, step) for key, here in zip(keys, present) if here)
            samples += 1

    # Retention `evict` as the replay runs it (removals through the real client, unobserved).
    eviction = build_replay_eviction(bed, settings.watermark) if mode.retention.evict else None
    try:
        run = replay_requests(trace, store, mode, ideal, settings.sizes, pacer=Pacer(scale),
                              pin_config=build_soft_pin_config() if mode.retention.pin else None,
                              eviction=eviction, before_request=observe)
        metrics = bed.metrics()
    finally:
        bed.close()
    result = build_mode_result(run)
    total = sum(composition.values()) or 1
    return {
        "mode": mode_name, "capacity": capacity, "segment_mib": segment,
        "hit_rate": result["hit_rate"], "keys_put": result["keys_put"],
        "put_failures": result["put_failures"], "put_failed_keys": result["put_failed_keys"],
        "keys_retried": result["keys_retried"],
        "keys_removed": eviction.removed_keys if eviction is not None else 0,
        "evicted_keys": metrics.get("master_evicted_key_count", 0.0),
        "composition": {kind: {"objects": count / max(samples, 1), "share": count / total}
                        for kind, count in composition.most_common()},
        "misses": dict(misses.most_common()),
    }


def render(results: dict[str, Any]) -> str:
    lines = [
        "# Where the store's capacity goes: `agentic-swa` under pressure",
        "",
        f"Generated by `{results['command']}` on {results['date']} ({results['wall_s']:.0f} s wall, "
        "shared 2-core machine). Every number below comes from that run; nothing is hand-edited. "
        "Method: see the docstring of `benchmarks/retention_capacity.py` (the replay of "
        "`moonlease bench replay`, with lease-free observers).",
        "",
    ]
    for mode in results["modes"]:
        lines += [
            f"## {mode['mode']} at capacity {mode['capacity']:g} ({mode['segment_mib']} MiB segment)",
            "",
            f"Hit rate {100 * mode['hit_rate']:.1f}%; keys put {mode['keys_put']:,}; batch puts refused "
            f"(in part) {mode['put_failures']} ({mode['put_failed_keys']:,} keys not stored"
            + (f", {mode['keys_retried']:,} stored by retry" if mode["keys_retried"] else "")
            + f"); evicted keys {mode['evicted_keys']:,.0f}"
            + (f"; keys the connector removed (retention evict) {mode['keys_removed']:,}"
               if mode.get("keys_removed") else "") + ".",
            "",
            "| store holds (mean of samples every 20 requests) | objects | share |",
            "| --- | ---: | ---: |",
            *[f"| {kind} | {value['objects']:.0f} | {100 * value['share']:.1f}% |"
              for kind, value in mode["composition"].items()],
            "",
            "| requests whose ideal load found keys missing | requests |",
            "| --- | ---: |",
            *[f"| {kind} | {count} |" for kind, count in mode["misses"].items()],
            "",
        ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default="leaseAll,leaseAll+junctions,leaseAll+junctions+pin,"
                                           "leaseAll+junctions+retry")
    parser.add_argument("--capacity", type=float, default=0.05)
    parser.add_argument("--wall-s-per-run", type=float, default=15.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/retention_capacity.md")
    args = parser.parse_args(argv)
    devenv.preload()
    from moonlease_dev.bench.script_results import run_record, save_results
    from moonlease_dev.bench.workload import build_named_trace

    trace = build_named_trace("agentic-swa", seed=args.seed)
    started = time.monotonic()
    modes = [run_mode(trace, name, args.capacity, args.wall_s_per_run) for name in args.modes.split(",")]
    arguments = argv if argv is not None else sys.argv[1:]
    results = {**run_record("benchmarks/retention_capacity.py", arguments, started), "modes": modes}
    print(save_results(args.out, results, render))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
