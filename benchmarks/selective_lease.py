#!/usr/bin/env python
"""Benchmark of selective lease (seed 002) against upstream's lease-all lookup.

What it measures
----------------
Lookup microbenchmark: `MoonleaseStoreWorker.lookup` (vLLM's real coordinator, built without
   an engine by `moonlease_dev/bench/workers.build_lookup`) for three layouts from that module's
   `LAYOUTS` — full attention; full attention + a 40-token sliding window; full attention +
   align-mode Mamba with a checkpoint every 64 tokens (4 hash blocks) on 2 rank namespaces —
   all with 16-token hash blocks, prompts of 16/64/256/512 blocks whose every key is in the
   store. Per lookup mode (leaseAll = lease every existing candidate with one `batch_is_exist`;
   selective = `batch_probe_key(..., "none")` then `batch_is_exist` on the hit's load set):
   keys leased, store RPCs, keys sent over the wire, and the latency p50/p95 of
   `worker.lookup(...)`. Two transports: "in-memory" (a dict-backed store: our own Python
   overhead only) and "TCP" (a real Mooncake 0.3.14 `mooncake_master` + store pool process +
   in-process client on loopback). leaseAll and selective run interleaved in the same process
   (ABBA order, after a warm-up), in several fresh processes run one after another; the report
   gives the median of the per-process p50/p95 and their range.

The store-pressure comparison this script used to run (an agentic trace against a small real
store, which keys survive eviction) is `moonlease bench replay` now — one replay
implementation for every lease mode (`--modes leaseAll,selective`), whose report gives the
same survival split (loaded versus passed-over keys alive at the end) beside hit rates and
Belady; see benchmarks/README.md.

How to reproduce
----------------
    make setup                                              # once: venv, Mooncake, CPU stub
    .venv/bin/python benchmarks/selective_lease.py          # full run (~3 min on 2 cores)
    .venv/bin/python benchmarks/selective_lease.py --quick  # CI-sized (about a minute)

The report goes to `--out` (default benchmarks/results/selective_lease.md) with the raw numbers
beside it (same name, `.json`); logs of child processes and servers go to
benchmarks/results/tmp/ (git-ignored).

Knobs
-----
--quick               small, fast settings (fewer processes and iterations)
--processes N         fresh microbenchmark processes (each measures every layout, size, transport)
--iterations N        timed lookups per mode per configuration per process (after warm-up)
--warmup N            untimed lookups per mode before timing
--sizes 16,64,...     prompt sizes in hash blocks
--layouts a,b         layout names from moonlease_dev/bench/workers.LAYOUTS
--transports a,b      memory, tcp
--seed N              hash seed
--log-dir, --keep-logs  where server/child logs go; they are deleted after a successful run
--render JSON         rewrite the markdown from an earlier run's raw JSON (no measuring)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# Measure the tree this file lives in (`moonlease`, `moonlease_connector`), ahead
# of whatever checkout the virtualenv's editable install points at.
SOURCE_PATHS = [str(REPO), str(REPO / "connector"), str(REPO / "settings")]
for _path in reversed(SOURCE_PATHS):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from moonlease_dev.bench.stores import CountingStore, DictStore, MooncakeBed  # noqa: E402  (after the source paths above)
from moonlease_dev.bench.environment import fetch_environment  # noqa: E402
from moonlease_dev.bench.stats import percentile  # noqa: E402

DEFAULT_OUT = REPO / "benchmarks" / "results" / "selective_lease.md"
LOG_ROOT = REPO / "benchmarks" / "results" / "tmp"
MODES = ("leaseAll", "selective")  # the lease modes, named as `moonlease bench` names them
TRANSPORTS = ("memory", "tcp")
HASH_BLOCK_TOKENS = 16  # moonlease_dev/bench/workers.HASH_BLOCK


# --------------------------------------------------------------------------------- settings

@dataclass(frozen=True)
class MicroSettings:
    layouts: tuple[str, ...] = ("full", "full+swa", "full+mamba")
    sizes: tuple[int, ...] = (16, 64, 256, 512)
    transports: tuple[str, ...] = TRANSPORTS
    processes: int = 3
    iterations: int = 300
    warmup: int = 30
    value_bytes: int = 256  # microbenchmark keys are only asked about, never read
    segment_mib: int = 64
    lease_ttl_ms: int = 5000


@dataclass(frozen=True)
class RunSettings:
    micro: MicroSettings
    seed: int = 2
    quick: bool = False


QUICK = RunSettings(micro=MicroSettings(processes=2, iterations=20, warmup=3, segment_mib=32), quick=True)
FULL = RunSettings(micro=MicroSettings())


# ------------------------------------------------------------------------------ small tools

def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def layout_by_name(name: str) -> Any:
    from moonlease_dev.bench.workers import layout_by_name as find

    try:
        return find(name)
    except ValueError as error:
        raise SystemExit(str(error)) from None


def emit_progress(count: int) -> None:
    """Child → parent progress line (the parent turns it into a tqdm update)."""
    print(f"@progress {count}", file=sys.stderr, flush=True)


def build_mode_worker(layout: Any, store: Any, mode: str, retention_interval: int | None = None) -> Any:
    """Our lookup object in `mode`: "leaseAll" or "selective"."""
    from moonlease_dev.bench.workers import build_lookup
    from moonlease_settings.config import LeaseMode

    return build_lookup(layout, store, LeaseMode(mode), retention_interval=retention_interval)


def candidate_keys(worker: Any, num_tokens: int, hashes: Sequence[bytes]) -> tuple[str, ...]:
    from moonlease_connector.core.lookup import build_candidates

    length = worker.coord.align_lookup_length(num_tokens)
    return build_candidates(worker.groups, worker.lookup_chunk_hashes(worker.groups, length, hashes)).keys


# ------------------------------------------------------------------ microbenchmark (child)

def run_micro_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One fresh process: every layout × size, leaseAll and selective interleaved, per transport."""
    from moonlease_dev import devenv

    devenv.preload()
    from moonlease_dev.bench.workers import keys_the_load_reads

    # vLLM and torch leave a large heap: move it out of the collector's way once, so that the
    # per-configuration collection below is cheap and GC pauses during timing are short.
    gc.collect()
    gc.freeze()
    micro = MicroSettings(**{k: tuple(v) if isinstance(v, list) else v
                             for k, v in spec["micro"].items()})
    log_dir = Path(spec["log_dir"])
    rng = random.Random(spec["seed"])
    bed = None
    if "tcp" in micro.transports:
        bed = MooncakeBed(segment_mib=micro.segment_mib, lease_ttl_ms=micro.lease_ttl_ms,
                          log_dir=log_dir)
    value = b"\0" * micro.value_bytes
    results: list[dict[str, Any]] = []
    try:
        for layout_name in micro.layouts:
            layout = layout_by_name(layout_name)
            for blocks in micro.sizes:
                hashes = [rng.randbytes(32) for _ in range(blocks)]
                num_tokens = blocks * HASH_BLOCK_TOKENS
                candidates = candidate_keys(build_mode_worker(layout, DictStore(), "leaseAll"),
                                            num_tokens, hashes)
                reference = build_mode_worker(layout, DictStore(candidates), "leaseAll")
                load_keys = keys_the_load_reads(reference, hashes, reference.lookup(num_tokens, hashes))
                if bed is not None:
                    for start in range(0, len(candidates), 1024):
                        chunk = list(candidates[start:start + 1024])
                        code = bed.client.put_batch(chunk, [value] * len(chunk))
                        if code != 0:
                            raise RuntimeError(f"put_batch of {len(chunk)} keys returned {code}")
                for transport in micro.transports:
                    inner = DictStore(candidates) if transport == "memory" else bed.client  # type: ignore[union-attr]
                    results.append(measure_configuration(
                        layout_name, blocks, transport, inner, layout, hashes, num_tokens,
                        len(candidates), len(load_keys), micro))
    finally:
        if bed is not None:
            bed.close()
    return {"index": spec["index"], "pid": os.getpid(), "configs": results}


def measure_configuration(layout_name: str, blocks: int, transport: str, inner: Any, layout: Any,
                          hashes: list[bytes], num_tokens: int, candidates: int, load_keys: int,
                          micro: MicroSettings) -> dict[str, Any]:
    """leaseAll and selective lookups of one prompt, interleaved ABBA; accounting per lookup."""
    counting = CountingStore(inner)
    workers = {mode: build_mode_worker(layout, counting, mode) for mode in MODES}
    samples: dict[str, dict[str, list[float]]] = {
        mode: {"ns": [], "keys_leased": [], "keys_probed": [], "rpcs": [], "keys_sent": [],
               "hit_tokens": [], "rounds": []} for mode in MODES}
    gc.collect()
    total = micro.warmup + micro.iterations
    for iteration in range(total):
        order = MODES if iteration % 2 == 0 else MODES[::-1]
        for mode in order:
            worker = workers[mode]
            counting.reset()
            started = time.perf_counter_ns()
            result = worker.lookup(num_tokens, hashes)
            elapsed = time.perf_counter_ns() - started
            outcome = dataclasses.asdict(result.outcome)
            if iteration < micro.warmup:
                continue
            record = samples[mode]
            record["ns"].append(elapsed)
            record["keys_leased"].append(outcome["keys_leased"])
            record["keys_probed"].append(outcome["keys_probed"])
            record["rounds"].append(outcome["rounds"])
            record["rpcs"].append(counting.rpcs)
            record["keys_sent"].append(counting.keys_sent)
            record["hit_tokens"].append(result.hit_length)
        if (iteration + 1) % 10 == 0:
            emit_progress(20)
    if total % 10:
        emit_progress(2 * (total % 10))
    # Both modes run back to back in every iteration, so their difference is paired: slow
    # phases of a shared machine hit both sides of a pair alike.
    paired = [s - d for d, s in zip(samples["leaseAll"]["ns"], samples["selective"]["ns"], strict=True)]
    per_mode = {}
    for mode, record in samples.items():
        per_mode[mode] = {
            "p50_us": percentile(record["ns"], 50) / 1e3,
            "p95_us": percentile(record["ns"], 95) / 1e3,
            "mean_us": sum(record["ns"]) / len(record["ns"]) / 1e3,
            **{name: _constant_or_range(record[name]) for name in
               ("keys_leased", "keys_probed", "rpcs", "keys_sent", "hit_tokens", "rounds")},
        }
    return {"layout": layout_name, "blocks": blocks, "transport": transport,
            "candidates": candidates, "load_keys": load_keys, "modes": per_mode,
            "paired_delta_us": percentile(paired, 50) / 1e3}


def _constant_or_range(values: Sequence[float]) -> dict[str, float]:
    """Accounting should be identical on every lookup; keep min/max to show if it was not."""
    return {"min": min(values), "max": max(values), "mean": sum(values) / len(values)}


# ----------------------------------------------------------------- microbenchmark (parent)

def run_micro(settings: RunSettings, log_dir: Path, progress: Any) -> list[dict[str, Any]]:
    """Fresh processes one after another (parallel runs would share 2 cores and skew latency)."""
    micro = settings.micro
    processes = []
    for index in range(micro.processes):
        child_dir = log_dir / f"micro-{index}"
        child_dir.mkdir(parents=True, exist_ok=True)
        spec = {"index": index, "seed": settings.seed * 1000 + index, "log_dir": str(child_dir),
                "micro": asdict(micro)}
        processes.append(run_child(spec, child_dir, progress))
    return processes


def run_child(spec: dict[str, Any], log_dir: Path, progress: Any) -> dict[str, Any]:
    spec_path = log_dir / "spec.json"
    result_path = log_dir / "result.json"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING", GLOG_minloglevel="1",
               PYTHONPATH=os.pathsep.join([*SOURCE_PATHS, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    log_path = log_dir / "child.log"
    with log_path.open("w") as log:
        process = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child",
                                    str(spec_path), "--child-result", str(result_path)],
                                   stdout=log, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
        assert process.stderr is not None
        for line in process.stderr:
            if line.startswith("@progress "):
                progress.update(int(line.split()[1]))
            else:
                log.write(line)
        code = process.wait()
    if code != 0 or not result_path.exists():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"benchmark child {spec['index']} exited with {code}; log {log_path}:\n{tail}")
    return json.loads(result_path.read_text())


def summarize_micro(processes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration and mode: accounting (checked equal across processes) and the median
    and range of the per-process p50/p95."""
    grouped: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for process in processes:
        for config in process["configs"]:
            grouped.setdefault((config["layout"], config["blocks"], config["transport"]), []).append(config)
    rows = []
    for (layout, blocks, transport), configs in grouped.items():
        row: dict[str, Any] = {"layout": layout, "blocks": blocks, "transport": transport,
                               "processes": len(configs), "candidates": configs[0]["candidates"],
                               "load_keys": configs[0]["load_keys"], "modes": {}}
        for mode in MODES:
            entries = [c["modes"][mode] for c in configs]
            summary: dict[str, Any] = {}
            for name in ("keys_leased", "keys_probed", "rpcs", "keys_sent", "hit_tokens", "rounds"):
                low = min(e[name]["min"] for e in entries)
                high = max(e[name]["max"] for e in entries)
                summary[name] = low if low == high else {"min": low, "max": high}
            for name in ("p50_us", "p95_us"):
                values = [e[name] for e in entries]
                summary[name] = {"median": median(values), "min": min(values), "max": max(values),
                                 "per_process": values}
            row["modes"][mode] = summary
        deltas = [c["paired_delta_us"] for c in configs]
        row["paired_delta_us"] = {"median": median(deltas), "min": min(deltas), "max": max(deltas),
                                  "per_process": deltas}
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------- the report

def _us(value: dict[str, float]) -> str:
    return f"{value['median']:.0f} ({value['min']:.0f}–{value['max']:.0f})"


def _count(value: Any) -> str:
    if isinstance(value, dict):
        return f"{value['min']:g}–{value['max']:g}"
    return f"{value:g}"


def render_report(results: dict[str, Any]) -> str:
    env = results["environment"]
    settings = results["settings"]
    lines = [
        "# Selective lease (seed 002): lookup cost",
        "",
        f"Generated by `benchmarks/selective_lease.py` on {env['date']}"
        + (" in **--quick** mode (CI-sized: numbers are indicative only)." if settings["quick"] else "."),
        "Every number below comes from that run; nothing is hand-edited.",
        "",
        "Reproduce: `make setup`, then `.venv/bin/python benchmarks/selective_lease.py"
        + (" --quick" if settings["quick"] else "") + "` (command used: `" + results["command"] + "`).",
        "",
        "| | |", "| --- | --- |",
        *[f"| {name} | {env[name]} |" for name in
          ("machine", "os", "python", "vllm", "mooncake", "torch", "commit", "load_average")],
        f"| wall time | {results['wall_seconds']:.0f} s |",
        "",
    ]
    lines += render_headline(results)
    if results.get("micro"):
        lines += render_micro(results["micro"], settings["micro"])
    lines += METHOD_NOTES
    return "\n".join(lines) + "\n"


def render_headline(results: dict[str, Any]) -> list[str]:
    """A few sentences computed from the tables below (nothing here is typed in by hand)."""
    lines = ["## Headline", ""]
    rows = results.get("micro") or []
    if rows:
        largest = max(r["blocks"] for r in rows)
        for row in rows:
            if row["blocks"] != largest or row["transport"] != "memory":
                continue
            d, s = row["modes"]["leaseAll"], row["modes"]["selective"]
            lines.append(f"- `{row['layout']}`, {largest} blocks: leaseAll leases {_count(d['keys_leased'])} "
                         f"keys in {_count(d['rpcs'])} RPC, selective {_count(s['keys_leased'])} in "
                         f"{_count(s['rpcs'])} RPCs (sending {_count(s['keys_sent'])} keys).")
        for transport in TRANSPORTS:
            picked = [r for r in rows if r["transport"] == transport and r["blocks"] == largest]
            if picked:
                deltas = ", ".join(
                    f"`{r['layout']}` {r['paired_delta_us']['median']:+.0f} µs "
                    f"({r['modes']['leaseAll']['p50_us']['median']:.0f} → "
                    f"{r['modes']['selective']['p50_us']['median']:.0f} µs p50)"
                    for r in picked)
                lines.append(f"- Extra latency of selective at {largest} blocks ({transport}, paired Δ): "
                             f"{deltas}.")
    lines.append("")
    return lines


METHOD_NOTES = [
    "## Method notes and limits",
    "",
    "- No vLLM engine runs here: lookups go through `MoonleaseStoreWorker.lookup` built around "
    "vLLM's real coordinator (`moonlease_dev/bench/workers.build_lookup`).",
    "- What the leases do under store pressure (which keys survive eviction, hit rates against "
    "Belady) is measured by `moonlease bench replay` (`benchmarks/results/replay.md`), the one "
    "replay of every lease mode.",
    "- Latencies come from a shared 2-core machine (see the load average above): they compare "
    "the two modes measured side by side in the same processes, not absolute capacity. The "
    "in-memory column isolates our own Python cost; the TCP column adds real loopback RPCs.",
    "",
]


def render_micro(rows: list[dict[str, Any]], micro: dict[str, Any]) -> list[str]:
    lines = [
        "## 1. Lookup microbenchmark",
        "",
        f"Layouts from `moonlease_dev/bench/workers.LAYOUTS` (16-token hash blocks): `full` (one "
        "full-attention group), `full+swa` (full attention + a 40-token sliding window), "
        "`full+mamba` (full attention + align-mode Mamba, a checkpoint every 64 tokens on 2 rank "
        "namespaces). Every key of the prompt is in the store; the prompt is block-aligned and "
        "upstream recomputes its last token, so the hit stops one block short (`full+mamba`: at "
        "the last 64-token checkpoint before that). "
        f"{micro['processes']} fresh processes, run one after another, each measuring both transports; in each, "
        f"{micro['warmup']} warm-up then {micro['iterations']} timed lookups per mode, leaseAll and "
        "selective interleaved (ABBA).",
        "",
        "### Accounting per lookup (identical on both transports and in every process)",
        "",
        "`candidates`: keys the lookup asks about; `load set`: keys loading the hit reads "
        "(`keys_the_load_reads`, an independent reading of upstream's receive path); `leased`: "
        "keys `batch_is_exist` found (and so leased); `RPCs`: store calls per lookup; `keys sent`: "
        "keys carried by those calls.",
        "",
        "| layout | blocks | candidates | load set | leased: leaseAll | leased: selective | RPCs: leaseAll | RPCs: selective | keys sent: leaseAll | keys sent: selective | hit tokens (both) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    accounting: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        accounting.setdefault((row["layout"], row["blocks"]), []).append(row)
    for (layout, blocks), same in accounting.items():
        first = same[0]
        d, s = first["modes"]["leaseAll"], first["modes"]["selective"]
        consistent = all(r["modes"][m][k] == first["modes"][m][k] for r in same for m in MODES
                         for k in ("keys_leased", "rpcs", "keys_sent", "hit_tokens"))
        hits = _count(d["hit_tokens"]) if d["hit_tokens"] == s["hit_tokens"] else \
            f"{_count(d['hit_tokens'])} / {_count(s['hit_tokens'])}"
        lines.append(f"| {layout} | {blocks} | {first['candidates']} | {first['load_keys']} | "
                     f"{_count(d['keys_leased'])} | {_count(s['keys_leased'])} | {_count(d['rpcs'])} | "
                     f"{_count(s['rpcs'])} | {_count(d['keys_sent'])} | {_count(s['keys_sent'])} | "
                     f"{hits}{'' if consistent else ' (differs by transport!)'} |")
    for transport, title in (("memory", "in-memory store (our own overhead)"),
                             ("tcp", "TCP to a real Mooncake 0.3.14 master on loopback")):
        selected = [r for r in rows if r["transport"] == transport]
        if not selected:
            continue
        lines += [
            "",
            f"### Latency of `worker.lookup(...)`, {title}",
            "",
            "Microseconds: median over processes of the per-process p50 / p95, with the range "
            "across processes in brackets. `paired Δ`: per process, the median of (selective − "
            "leaseAll) over lookups run back to back, then median (range) over processes — the "
            "estimate least disturbed by other load on the machine.",
            "",
            "| layout | blocks | leaseAll p50 | selective p50 | leaseAll p95 | selective p95 | paired Δ | p50 ratio |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for row in selected:
            d, s = row["modes"]["leaseAll"], row["modes"]["selective"]
            ratio = s["p50_us"]["median"] / d["p50_us"]["median"]
            delta = row["paired_delta_us"]
            lines.append(f"| {row['layout']} | {row['blocks']} | {_us(d['p50_us'])} | {_us(s['p50_us'])} | "
                         f"{_us(d['p95_us'])} | {_us(s['p95_us'])} | "
                         f"{delta['median']:+.0f} ({delta['min']:+.0f}…{delta['max']:+.0f}) | ×{ratio:.2f} |")
    lines.append("")
    return lines


# -------------------------------------------------------------------------------- the entry

def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI-sized run (< 1 min)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown report path")
    parser.add_argument("--processes", type=int)
    parser.add_argument("--iterations", type=int)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--sizes", type=lambda s: tuple(int(x) for x in s.split(",")))
    parser.add_argument("--layouts", type=lambda s: tuple(s.split(",")))
    parser.add_argument("--transports", type=lambda s: tuple(s.split(",")))
    parser.add_argument("--seed", type=int)
    parser.add_argument("--log-dir", type=Path, help="where run logs go (default benchmarks/results/tmp)")
    parser.add_argument("--keep-logs", action="store_true", help="keep server and child logs")
    parser.add_argument("--render", type=Path, metavar="JSON",
                        help="only rewrite the markdown report from an earlier run's raw JSON")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--child-result", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def build_settings(args: argparse.Namespace) -> RunSettings:
    base = QUICK if args.quick else FULL
    micro = {k: v for k, v in {"processes": args.processes, "iterations": args.iterations,
                               "warmup": args.warmup, "sizes": args.sizes, "layouts": args.layouts,
                               "transports": args.transports}.items() if v is not None}
    for transport in micro.get("transports", ()):
        if transport not in TRANSPORTS:
            raise SystemExit(f"unknown transport {transport!r}; use {', '.join(TRANSPORTS)}")
    return RunSettings(micro=MicroSettings(**{**asdict(base.micro), **micro}),
                       seed=args.seed if args.seed is not None else base.seed, quick=base.quick)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.child is not None:
        result = run_micro_child(json.loads(args.child.read_text()))
        args.child_result.write_text(json.dumps(result))
        return 0

    if args.render is not None:
        out = args.out if args.out.is_absolute() else Path.cwd() / args.out
        out.write_text(render_report(json.loads(args.render.read_text())))
        print(f"report: {out}", file=sys.stderr)
        return 0

    from tqdm import tqdm

    # Quiet the in-process Mooncake client's glog INFO lines (they would break the progress bar);
    # must be set before the library loads. Warnings and errors still reach stderr.
    os.environ.setdefault("GLOG_minloglevel", "1")
    settings = build_settings(args)
    started = time.monotonic()
    LOG_ROOT.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="selective-lease-", dir=args.log_dir or LOG_ROOT))
    print(f"logs: {log_dir} (kept only if the run fails or with --keep-logs)", file=sys.stderr)
    results: dict[str, Any] = {
        "command": " ".join(["benchmarks/selective_lease.py", *(sys.argv[1:] if argv is None else argv)]),
        "settings": {"quick": settings.quick, "seed": settings.seed, "micro": asdict(settings.micro)},
        "environment": fetch_environment(REPO),
    }
    load_before = os.getloadavg()
    micro = settings.micro
    per_process = len(micro.layouts) * len(micro.sizes) * len(micro.transports) * 2 * (
        micro.warmup + micro.iterations)
    with tqdm(total=per_process * micro.processes, desc="lookup microbenchmark", unit="lookup",
              file=sys.stderr) as progress:
        processes = run_micro(settings, log_dir, progress)
    results["micro_processes"] = processes
    results["micro"] = summarize_micro(processes)
    results["wall_seconds"] = time.monotonic() - started
    results["environment"]["load_average"] = (
        f"{load_before[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end (1-minute; the machine "
        "is shared, so other work can inflate latencies)")
    out = args.out if args.out.is_absolute() else Path.cwd() / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    out.write_text(render_report(results))
    print(f"report: {out}\nraw: {out.with_suffix('.json')}", file=sys.stderr)
    if not args.keep_logs:
        shutil.rmtree(log_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
