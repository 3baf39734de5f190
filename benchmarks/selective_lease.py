#!/usr/bin/env python
"""Benchmark of selective lease (seed 002) against upstream's lease-all lookup.

What it measures
----------------
1. Lookup microbenchmark. `MoonleaseStoreWorker.lookup` (vLLM's real coordinator, built without
   an engine by `moonlease/bench/workers.build_lookup`) for three layouts from that module's
   `LAYOUTS` — full attention; full attention + a 40-token sliding window; full attention +
   align-mode Mamba with a checkpoint every 64 tokens (4 hash blocks) on 2 rank namespaces —
   all with 16-token hash blocks, prompts of 16/64/256/512 blocks whose every key is in the
   store. Per lookup mode (default = lease every existing candidate with one `batch_is_exist`;
   selective = `batch_probe_key(..., "none")` then `batch_is_exist` on the hit's load set):
   keys leased, store RPCs, keys sent over the wire, and the latency p50/p95 of
   `worker.lookup(...)`. Two transports: "in-memory" (a dict-backed store: our own Python
   overhead only) and "TCP" (a real Mooncake 0.3.14 `mooncake_master` + store pool process +
   in-process client on loopback). Default and selective run interleaved in the same process
   (ABBA order, after a warm-up), in several fresh processes run one after another; the report
   gives the median of the per-process p50/p95 and their range.
2. Store-pressure run. A real master with a small pool, a lowered eviction watermark and a short
   lease TTL (so that the eviction order — oldest lease timeout first — is the lookups' recency,
   compressed in time). A deterministic agentic workload replays against a fresh master per
   mode: sessions whose prompts share system prompts and grow turn by turn, sessions that end,
   resume or branch from an earlier turn; every request looks up its prompt through the mode's
   worker, then saves like upstream's worker does (`batch_is_exist` on what it would store —
   every full-attention block from 0, the loaded window/new blocks for other groups, as vLLM's
   retention masks select them, dense or sparse — then `put_batch` of the missing keys). At the end, lease-free probes show which keys survived:
   "load-set" keys (what a final round of lookups — every session resumed, and every session
   branched at an earlier turn — would read) versus "passed-over" keys (stored keys no final
   lookup reads: blocks outside a sliding window, checkpoints before the resumed one). The final
   round then runs for real and reports its hit tokens, next to the master's eviction counters.
   The seed's mechanism: under lease-all, passed-over keys look hot because every lookup renews
   them; under selective they age out first.

How to reproduce
----------------
    make setup                                              # once: venv, Mooncake, CPU stub
    .venv/bin/python benchmarks/selective_lease.py          # full run (~6 min on 2 cores)
    .venv/bin/python benchmarks/selective_lease.py --quick  # CI-sized (about a minute)

The report goes to `--out` (default benchmarks/results/selective_lease.md) with the raw numbers
beside it (same name, `.json`); logs of child processes and servers go to
benchmarks/results/tmp/ (git-ignored).

Knobs
-----
--quick               small, fast settings (fewer processes/iterations, one pressure run)
--processes N         fresh microbenchmark processes (each measures every layout, size, transport)
--iterations N        timed lookups per mode per configuration per process (after warm-up)
--warmup N            untimed lookups per mode before timing
--sizes 16,64,...     prompt sizes in hash blocks
--layouts a,b         layout names from moonlease/bench/workers.LAYOUTS
--transports a,b      memory, tcp
--pressure-layouts    layouts for the pressure run (full+swa, full+mamba)
--retentions a,b      store retention for the pressure run: dense, sparse
--pressure-levels     name=fits pairs, e.g. low=0.8,high=0.35: the share of the trace's stored
                      bytes that fits below the watermark (sets the segment, at least 16 MiB)
--turns N             requests replayed per pressure run
--seed N              workload and hash seed
--skip-micro / --skip-pressure
--log-dir, --keep-logs  where server/child logs go; they are deleted after a successful run
--render JSON         rewrite the markdown from an earlier run's raw JSON (no measuring)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# Measure the tree this file lives in (`moonlease`, `moonlease_connector`), ahead
# of whatever checkout the virtualenv's editable install points at.
SOURCE_PATHS = [str(REPO), str(REPO / "connector")]
for _path in reversed(SOURCE_PATHS):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from moonlease.bench.saves import (  # noqa: E402  (after the source paths above)
    ChunkKeys,
    ValueSizes,
    apply_save,
    build_prompt_chunks,
    build_save_keys,
)
from moonlease.bench.stores import CountingStore, DictStore, MooncakeBed, fetch_presence  # noqa: E402
from moonlease.bench.environment import fetch_environment  # noqa: E402
from moonlease.bench.stats import percentile  # noqa: E402

DEFAULT_OUT = REPO / "benchmarks" / "results" / "selective_lease.md"
LOG_ROOT = REPO / "benchmarks" / "results" / "tmp"
MODES = ("default", "selective")
TRANSPORTS = ("memory", "tcp")
HASH_BLOCK_TOKENS = 16  # moonlease/bench/workers.HASH_BLOCK
MIN_SEGMENT_MIB = 16  # mooncake_client refuses a smaller global segment


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
class PressureLevel:
    """How much of the trace's stored bytes fit below the eviction watermark."""

    name: str
    fits: float  # (segment × watermark) / bytes the trace stores; the segment is at least 16 MiB

    def segment_mib(self, stored_bytes: int, watermark: float) -> int:
        return max(MIN_SEGMENT_MIB, math.ceil(stored_bytes * self.fits / watermark / (1 << 20)))


#: How many sliding-window tails and Mamba states a prompt stores (vLLM's
#: `prefix_cache_retention_interval`): "dense" (None) keeps one at every block boundary, what a
#: per-boundary-state deployment like seed 002's does; "sparse" (0, vLLM's default) keeps only
#: the one at the prompt's replay boundary. Full attention stores every block either way.
RETENTIONS: dict[str, int | None] = {"dense": None, "sparse": 0}


@dataclass(frozen=True)
class PressureSettings:
    layouts: tuple[str, ...] = ("full+swa", "full+mamba")
    retentions: tuple[str, ...] = ("dense", "sparse")
    levels: tuple[PressureLevel, ...] = (PressureLevel("low", 0.8), PressureLevel("high", 0.35))
    turns: int = 1500
    active_sessions: int = 12  # sessions in flight at once
    agents: int = 4  # distinct system prompts shared by sessions
    system_blocks: int = 48  # hash blocks per system prompt
    first_blocks: tuple[int, int] = (16, 48)  # a new session's own first message
    turn_blocks: tuple[int, int] = (4, 16)  # previous answer + next user message
    p_end: float = 0.12  # a session ends after a turn
    p_resume: float = 0.35  # its slot resumes an ended session ...
    p_branch: float = 0.15  # ... or branches one at an earlier turn (else: a new session)
    attention_value_bytes: int = 2048  # one 16-token block of one attention group
    recurrent_value_bytes: int = 8192  # one Mamba checkpoint of one rank namespace
    watermark: float = 0.8
    eviction_ratio: float = 0.05
    lease_ttl_ms: int = 50
    samples: int = 6  # survival snapshots during the run


@dataclass(frozen=True)
class RunSettings:
    micro: MicroSettings
    pressure: PressureSettings
    seed: int = 2
    quick: bool = False
    skip_micro: bool = False
    skip_pressure: bool = False


QUICK = RunSettings(
    micro=MicroSettings(processes=2, iterations=20, warmup=3, segment_mib=32),
    pressure=PressureSettings(layouts=("full+swa",), retentions=("dense",),
                              levels=(PressureLevel("high", 0.5),),
                              turns=300, attention_value_bytes=4096, samples=4),
    quick=True,
)
FULL = RunSettings(micro=MicroSettings(), pressure=PressureSettings())


# ------------------------------------------------------------------------------ small tools

def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def layout_by_name(name: str) -> Any:
    from moonlease.bench.workers import layout_by_name as find

    try:
        return find(name)
    except ValueError as error:
        raise SystemExit(str(error)) from None


def emit_progress(count: int) -> None:
    """Child → parent progress line (the parent turns it into a tqdm update)."""
    print(f"@progress {count}", file=sys.stderr, flush=True)


def build_mode_worker(layout: Any, store: Any, mode: str, retention_interval: int | None = None) -> Any:
    """Our lookup object in `mode`: "default" (lease all) or "selective"."""
    from moonlease.bench.workers import build_lookup
    from moonlease_connector.config import LeaseMode

    lease_mode = LeaseMode.SELECTIVE if mode == "selective" else LeaseMode.LEASE_ALL
    return build_lookup(layout, store, lease_mode, retention_interval=retention_interval)


def candidate_keys(worker: Any, num_tokens: int, hashes: Sequence[bytes]) -> tuple[str, ...]:
    from moonlease_connector.core.lookup import build_candidates

    length = worker.coord.align_lookup_length(num_tokens)
    return build_candidates(worker.groups, worker.lookup_chunk_hashes(worker.groups, length, hashes)).keys


# ------------------------------------------------------------------ microbenchmark (child)

def run_micro_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One fresh process: every layout × size, default and selective interleaved, per transport."""
    from moonlease import devenv

    devenv.preload()
    from moonlease.bench.workers import keys_the_load_reads

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
                candidates = candidate_keys(build_mode_worker(layout, DictStore(), "default"),
                                            num_tokens, hashes)
                reference = build_mode_worker(layout, DictStore(candidates), "default")
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
    """Default and selective lookups of one prompt, interleaved ABBA; accounting per lookup."""
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
    paired = [s - d for d, s in zip(samples["default"]["ns"], samples["selective"]["ns"], strict=True)]
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


# ------------------------------------------------------------------- pressure: the workload

@dataclass(frozen=True)
class Request:
    kind: str  # new | turn | resume | branch (a session's first request after a fork)
    session: int
    hashes: tuple[bytes, ...]
    ideal_hit: int = 0  # hit tokens if nothing had ever been evicted

    @property
    def num_tokens(self) -> int:
        return len(self.hashes) * HASH_BLOCK_TOKENS


@dataclass
class Session:
    context: list[bytes]  # the last prompt (what the store holds for this session)
    boundaries: list[int] = field(default_factory=list)  # earlier prompts' lengths, in blocks


@dataclass(frozen=True)
class Workload:
    requests: tuple[Request, ...]
    final_resume: tuple[Request, ...]
    final_branch: tuple[Request, ...]
    sessions: int


def build_workload(settings: PressureSettings, seed: int) -> Workload:
    """A deterministic agentic trace (pure): the same for every mode.

    Each slot of `active_sessions` runs one session; a picked session sends its context plus a
    few new blocks (its last answer and the next message); afterwards it may end, and its slot
    then resumes an ended session, branches one at an earlier turn, or starts a new session on
    one of the shared system prompts. Prompts are block-aligned, so a full hit recomputes the
    last block (upstream's rule).
    """
    rng = random.Random(seed)

    def fresh(count: int) -> list[bytes]:
        return [rng.randbytes(32) for _ in range(count)]

    system_prompts = [fresh(settings.system_blocks) for _ in range(settings.agents)]
    sessions: list[Session] = []
    ended: list[int] = []

    def start(kind: str) -> tuple[int, str]:
        if kind == "resume" and ended:
            return ended.pop(rng.randrange(len(ended))), "resume"
        if kind == "branch":
            forkable = [i for i, s in enumerate(sessions) if len(s.boundaries) >= 2]
            if forkable:
                parent = sessions[rng.choice(forkable)]
                cut = rng.choice(parent.boundaries[:-1])
                sessions.append(Session(parent.context[:cut], [cut]))
                return len(sessions) - 1, "branch"
        sessions.append(Session(list(rng.choice(system_prompts))))
        return len(sessions) - 1, "new"

    def next_prompt(session: Session, first: bool) -> list[bytes]:
        span = settings.first_blocks if first else settings.turn_blocks
        return session.context + fresh(rng.randint(*span))

    slots = [start("new") for _ in range(settings.active_sessions)]
    requests: list[Request] = []
    for _ in range(settings.turns):
        slot = rng.randrange(len(slots))
        index, kind = slots[slot]
        session = sessions[index]
        prompt = next_prompt(session, first=kind == "new")
        requests.append(Request(kind, index, tuple(prompt)))
        session.context = prompt
        session.boundaries.append(len(prompt))
        slots[slot] = (index, "turn")
        if rng.random() < settings.p_end:
            ended.append(index)
            draw = rng.random()
            if draw < settings.p_resume:
                slots[slot] = start("resume")
            elif draw < settings.p_resume + settings.p_branch:
                slots[slot] = start("branch")
            else:
                slots[slot] = start("new")
    touched = sorted({r.session for r in requests})
    final_resume = tuple(Request("resume", i, tuple(next_prompt(sessions[i], first=False)))
                         for i in touched)
    final_branch = []
    for i in touched:
        earlier = sessions[i].boundaries[:-1]
        if earlier:
            cut = rng.choice(earlier)
            final_branch.append(Request("branch", i, tuple(sessions[i].context[:cut] + fresh(
                rng.randint(*settings.turn_blocks)))))
    return Workload(tuple(requests), final_resume, tuple(final_branch), len(touched))


@dataclass
class PreparedWorkload:
    """The workload with every prompt's keys, ideal hits and the final round's load sets."""

    layout: str
    retention: str
    workload: Workload
    chunks: list[list[ChunkKeys]]
    universe: list[str]  # every key any prompt stores, in first-stored order
    key_bytes: dict[str, int]
    resume_load: set[str]
    branch_load: set[str]
    ideal_resume: list[int]
    ideal_branch: list[int]


def prepare_workload(layout_name: str, retention: str, settings: PressureSettings,
                     seed: int) -> PreparedWorkload:
    """Ideal hits against a store that never evicts (a set of every key ever saved)."""
    from moonlease.bench.workers import keys_the_load_reads

    layout = layout_by_name(layout_name)
    workload = build_workload(settings, seed)
    shadow = DictStore()
    worker = build_mode_worker(layout, shadow, "default", RETENTIONS[retention])
    universe: list[str] = []
    key_bytes: dict[str, int] = {}
    chunks_per_request: list[list[ChunkKeys]] = []
    requests = []
    for request in workload.requests:
        ideal = worker.lookup(request.num_tokens, list(request.hashes)).hit_length
        chunks = build_prompt_chunks(worker, request.hashes, HASH_BLOCK_TOKENS)
        chunks_per_request.append(chunks)
        for chunk in chunks:
            size = settings.recurrent_value_bytes if chunk.recurrent else settings.attention_value_bytes
            for key in chunk.keys:
                if key not in shadow.keys:
                    shadow.keys.add(key)
                    universe.append(key)
                    key_bytes[key] = size
        requests.append(Request(request.kind, request.session, request.hashes, ideal))

    def load_sets(final: Sequence[Request]) -> tuple[set[str], list[int]]:
        reads: set[str] = set()
        hits = []
        for request in final:
            result = worker.lookup(request.num_tokens, list(request.hashes))
            hits.append(result.hit_length)
            reads |= keys_the_load_reads(worker, list(request.hashes), result)
        return reads, hits

    resume_load, ideal_resume = load_sets(workload.final_resume)
    branch_load, ideal_branch = load_sets(workload.final_branch)
    workload = Workload(tuple(requests), workload.final_resume, workload.final_branch, workload.sessions)
    return PreparedWorkload(layout_name, retention, workload, chunks_per_request, universe, key_bytes,
                            resume_load, branch_load, ideal_resume, ideal_branch)


# -------------------------------------------------------------------- pressure: the replay

def run_pressure_mode(prepared: PreparedWorkload, mode: str, segment_mib: int,
                      settings: PressureSettings, log_dir: Path, progress: Any) -> dict[str, Any]:
    """Replay the workload against a fresh master; survival and hits for one lease mode."""
    layout = layout_by_name(prepared.layout)
    bed = MooncakeBed(segment_mib=segment_mib, lease_ttl_ms=settings.lease_ttl_ms,
                      watermark=settings.watermark, eviction_ratio=settings.eviction_ratio,
                      log_dir=log_dir)
    sizes = ValueSizes(settings.attention_value_bytes, settings.recurrent_value_bytes)
    try:
        counting = CountingStore(bed.client)
        worker = build_mode_worker(layout, counting, mode, RETENTIONS[prepared.retention])
        requests = prepared.workload.requests
        sample_at = {math.ceil(len(requests) * k / settings.samples) for k in range(1, settings.samples + 1)}
        stored_so_far = 0
        seen: set[str] = set()
        snapshots = []
        hit_tokens = ideal_tokens = prompt_tokens = short_hits = 0
        keys_leased = lookup_rpcs = save_failures = 0
        for number, (request, chunks) in enumerate(zip(requests, prepared.chunks, strict=True), 1):
            counting.reset()
            result = worker.lookup(request.num_tokens, list(request.hashes))
            outcome = dataclasses.asdict(result.outcome)
            keys_leased += outcome["keys_leased"]
            lookup_rpcs += counting.rpcs
            hit = result.hit_length
            hit_tokens += hit
            ideal_tokens += request.ideal_hit
            prompt_tokens += request.num_tokens
            short_hits += hit < request.ideal_hit
            save_failures += apply_save(bed.client, build_save_keys(worker, request.hashes, hit, chunks),
                                        sizes).put_failures
            for chunk in chunks:
                for key in chunk.keys:
                    if key not in seen:
                        seen.add(key)
                        stored_so_far += 1
            if number in sample_at:
                snapshots.append({"request": number, "known_keys": stored_so_far,
                                  "present": fetch_presence(bed.client, prepared.universe[:stored_so_far]),
                                  "used_ratio": used_ratio(bed.metrics())})
            progress.update(1)
        time.sleep(0.1)  # let a pending eviction pass finish before the survival census
        present = fetch_presence(bed.client, prepared.universe)
        final = {}
        for name, final_requests, ideal in (
                ("resume", prepared.workload.final_resume, prepared.ideal_resume),
                ("branch", prepared.workload.final_branch, prepared.ideal_branch)):
            hits = []
            for request in final_requests:
                hits.append(worker.lookup(request.num_tokens, list(request.hashes)).hit_length)
            final[name] = {"requests": len(hits), "hit_tokens": sum(hits), "ideal_tokens": sum(ideal),
                           "full_hits": sum(1 for h, i in zip(hits, ideal) if h >= i),
                           "misses": sum(1 for h, i in zip(hits, ideal) if h == 0 and i > 0)}
        metrics = bed.metrics()
    finally:
        bed.close()
    return {
        "mode": mode,
        "churn": {"requests": len(requests), "prompt_tokens": prompt_tokens, "hit_tokens": hit_tokens,
                  "ideal_tokens": ideal_tokens, "short_hits": short_hits,
                  "keys_leased_per_lookup": keys_leased / len(requests),
                  "rpcs_per_lookup": lookup_rpcs / len(requests), "save_failures": save_failures},
        "survival": build_survival(prepared, present),
        "timeline": [{**{k: v for k, v in s.items() if k != "present"},
                      **build_survival(prepared, s["present"], limit=s["known_keys"])}
                     for s in snapshots],
        "final": final,
        "master": {name: metrics.get(name, 0.0) for name in (
            "master_evicted_key_count", "master_put_start_alloc_failures_total",
            "master_successful_evictions_total", "master_attempted_evictions_total",
            "master_key_count", "master_allocated_bytes", "master_total_capacity_bytes")},
    }


def used_ratio(metrics: dict[str, float]) -> float:
    capacity = metrics.get("master_total_capacity_bytes", 0.0)
    return metrics.get("master_allocated_bytes", 0.0) / capacity if capacity else 0.0


def build_survival(prepared: PreparedWorkload, present: bytes, limit: int | None = None) -> dict[str, Any]:
    """Fractions of each key class still present (over the first `limit` stored keys)."""
    keys = prepared.universe if limit is None else prepared.universe[:limit]
    counts = {name: [0, 0] for name in ("resume_load", "branch_load", "passed_over")}
    for key, flag in zip(keys, present):
        if key in prepared.resume_load:
            name = "resume_load"
        elif key in prepared.branch_load:
            name = "branch_load"
        else:
            name = "passed_over"
        counts[name][0] += 1
        counts[name][1] += flag
    return {name: {"keys": total, "present": alive, "fraction": alive / total if total else None}
            for name, (total, alive) in counts.items()}


def run_pressure(settings: RunSettings, log_dir: Path) -> list[dict[str, Any]]:
    from tqdm import tqdm

    from moonlease import devenv

    devenv.preload()
    pressure = settings.pressure
    runs = []
    scenarios = [(layout, retention) for layout in pressure.layouts for retention in pressure.retentions]
    total = len(scenarios) * len(pressure.levels) * len(MODES) * pressure.turns
    with tqdm(total=total, desc="pressure runs", unit="req", file=sys.stderr) as progress:
        for layout_name, retention in scenarios:
            prepared = prepare_workload(layout_name, retention, pressure, settings.seed)
            gc.collect()
            gc.freeze()  # vLLM's heap and the prepared trace live to the end: keep GC passes short
            footprint = sum(prepared.key_bytes.values())
            for level in pressure.levels:
                segment_mib = level.segment_mib(footprint, pressure.watermark)
                level_runs = []
                for mode in MODES:
                    progress.set_postfix_str(f"{layout_name} {retention} {level.name} {mode}")
                    run_dir = log_dir / f"pressure-{layout_name}-{retention}-{level.name}-{mode}".replace("+", "_")
                    level_runs.append(run_pressure_mode(prepared, mode, segment_mib, pressure, run_dir,
                                                        progress))
                capacity = segment_mib << 20
                runs.append({
                    "layout": layout_name, "retention": retention, "level": level.name,
                    "segment_mib": segment_mib,
                    "watermark": pressure.watermark, "stored_bytes": footprint,
                    "pressure": footprint / (capacity * pressure.watermark),
                    "keys": {"universe": len(prepared.universe),
                             "resume_load": len(prepared.resume_load),
                             "branch_load": len(prepared.branch_load - prepared.resume_load)},
                    "sessions": prepared.workload.sessions,
                    "kinds": {kind: sum(1 for r in prepared.workload.requests if r.kind == kind)
                              for kind in ("new", "turn", "resume", "branch")},
                    "modes": {run["mode"]: run for run in level_runs},
                })
    return runs


# ------------------------------------------------------------------------------- the report

def _us(value: dict[str, float]) -> str:
    return f"{value['median']:.0f} ({value['min']:.0f}–{value['max']:.0f})"


def _count(value: Any) -> str:
    if isinstance(value, dict):
        return f"{value['min']:g}–{value['max']:g}"
    return f"{value:g}"


def _scenario(run: dict[str, Any]) -> str:
    return f"{run['layout']}, {run.get('retention', 'dense')}"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def render_report(results: dict[str, Any]) -> str:
    env = results["environment"]
    settings = results["settings"]
    lines = [
        "# Selective lease (seed 002): lookup cost and store survival",
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
        f"| wall time | {results['wall_seconds']:.0f} s (microbenchmark "
        f"{results.get('micro_seconds', 0):.0f} s, pressure runs {results.get('pressure_seconds', 0):.0f} s) |",
        "",
    ]
    lines += render_headline(results)
    if results.get("micro"):
        lines += render_micro(results["micro"], settings["micro"])
    if results.get("pressure"):
        lines += render_pressure(results["pressure"], settings["pressure"])
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
            d, s = row["modes"]["default"], row["modes"]["selective"]
            lines.append(f"- `{row['layout']}`, {largest} blocks: default leases {_count(d['keys_leased'])} "
                         f"keys in {_count(d['rpcs'])} RPC, selective {_count(s['keys_leased'])} in "
                         f"{_count(s['rpcs'])} RPCs (sending {_count(s['keys_sent'])} keys).")
        for transport in TRANSPORTS:
            picked = [r for r in rows if r["transport"] == transport and r["blocks"] == largest]
            if picked:
                deltas = ", ".join(
                    f"`{r['layout']}` {r['paired_delta_us']['median']:+.0f} µs "
                    f"({r['modes']['default']['p50_us']['median']:.0f} → "
                    f"{r['modes']['selective']['p50_us']['median']:.0f} µs p50)"
                    for r in picked)
                lines.append(f"- Extra latency of selective at {largest} blocks ({transport}, paired Δ): "
                             f"{deltas}.")
    for run in results.get("pressure") or []:
        d, s = run["modes"]["default"], run["modes"]["selective"]
        ratio = _final_ratio  # (mode, "resume" | "branch") → hit tokens / ideal
        lines.append(
            f"- Pressure `{run['layout']}` {run.get('retention', 'dense')} retention, {run['level']} (stored ×{run['pressure']:.1f} of the watermark): "
            f"resume load set alive {_pct(d['survival']['resume_load']['fraction'])} → "
            f"{_pct(s['survival']['resume_load']['fraction'])}, passed over alive "
            f"{_pct(d['survival']['passed_over']['fraction'])} → {_pct(s['survival']['passed_over']['fraction'])}; "
            f"final-round hit tokens (of ideal) resume {_pct(ratio(d, 'resume'))} → {_pct(ratio(s, 'resume'))}, "
            f"branch {_pct(ratio(d, 'branch'))} → {_pct(ratio(s, 'branch'))} (default → selective).")
    lines.append("")
    return lines


def _final_ratio(mode: dict[str, Any], name: str) -> float | None:
    final = mode["final"][name]
    return final["hit_tokens"] / final["ideal_tokens"] if final["ideal_tokens"] else None


METHOD_NOTES = [
    "## Method notes and limits",
    "",
    "- No vLLM engine runs here: lookups go through `MoonleaseStoreWorker.lookup` built around "
    "vLLM's real coordinator (`moonlease/bench/workers.build_lookup`); the pressure run's "
    "saves imitate upstream's worker (first save of a request checks every full-attention block "
    "from token 0, which leases them; the sliding-window group only holds the loaded window and "
    "new blocks; Mamba states are put only as new boundary states). Eviction, leases and "
    "the counters are the real Mooncake 0.3.14 master's.",
    "- Which sliding-window tails and Mamba states a prompt stores comes from vLLM's own "
    "retention masks (dense: every boundary; sparse: the replay boundary only); shared-prefix "
    "junctions are not stored (upstream's store mask does not pass them). Decode KV is not "
    "saved (`save_decode_cache` off, upstream's default). Value sizes are stand-ins: eviction "
    "is by object count ratio among lease-expired objects, oldest lease timeout first.",
    "- The lease TTL is shortened so the run fits in minutes; the order of eviction — which is "
    "what lease mode changes — depends on the order of leases, not on their absolute times. "
    "The master evicts per metadata shard (1024 shards), so with tens of objects per shard the "
    "order is only approximately LRU, in both modes alike.",
    "- Latencies come from a shared 2-core machine (see the load average above): they compare "
    "the two modes measured side by side in the same processes, not absolute capacity. The "
    "in-memory column isolates our own Python cost; the TCP column adds real loopback RPCs.",
    "",
]


def render_micro(rows: list[dict[str, Any]], micro: dict[str, Any]) -> list[str]:
    lines = [
        "## 1. Lookup microbenchmark",
        "",
        f"Layouts from `moonlease/bench/workers.LAYOUTS` (16-token hash blocks): `full` (one "
        "full-attention group), `full+swa` (full attention + a 40-token sliding window), "
        "`full+mamba` (full attention + align-mode Mamba, a checkpoint every 64 tokens on 2 rank "
        "namespaces). Every key of the prompt is in the store; the prompt is block-aligned and "
        "upstream recomputes its last token, so the hit stops one block short (`full+mamba`: at "
        "the last 64-token checkpoint before that). "
        f"{micro['processes']} fresh processes, run one after another, each measuring both transports; in each, "
        f"{micro['warmup']} warm-up then {micro['iterations']} timed lookups per mode, default and "
        "selective interleaved (ABBA).",
        "",
        "### Accounting per lookup (identical on both transports and in every process)",
        "",
        "`candidates`: keys the lookup asks about; `load set`: keys loading the hit reads "
        "(`keys_the_load_reads`, an independent reading of upstream's receive path); `leased`: "
        "keys `batch_is_exist` found (and so leased); `RPCs`: store calls per lookup; `keys sent`: "
        "keys carried by those calls.",
        "",
        "| layout | blocks | candidates | load set | leased: default | leased: selective | RPCs: default | RPCs: selective | keys sent: default | keys sent: selective | hit tokens (both) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    accounting: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        accounting.setdefault((row["layout"], row["blocks"]), []).append(row)
    for (layout, blocks), same in accounting.items():
        first = same[0]
        d, s = first["modes"]["default"], first["modes"]["selective"]
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
            "default) over lookups run back to back, then median (range) over processes — the "
            "estimate least disturbed by other load on the machine.",
            "",
            "| layout | blocks | default p50 | selective p50 | default p95 | selective p95 | paired Δ | p50 ratio |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for row in selected:
            d, s = row["modes"]["default"], row["modes"]["selective"]
            ratio = s["p50_us"]["median"] / d["p50_us"]["median"]
            delta = row["paired_delta_us"]
            lines.append(f"| {row['layout']} | {row['blocks']} | {_us(d['p50_us'])} | {_us(s['p50_us'])} | "
                         f"{_us(d['p95_us'])} | {_us(s['p95_us'])} | "
                         f"{delta['median']:+.0f} ({delta['min']:+.0f}…{delta['max']:+.0f}) | ×{ratio:.2f} |")
    lines.append("")
    return lines


def render_pressure(runs: list[dict[str, Any]], pressure: dict[str, Any]) -> list[str]:
    lines = [
        "## 2. Store pressure: what survives eviction",
        "",
        f"A real master per run (fresh for each mode), `eviction_high_watermark_ratio="
        f"{pressure['watermark']}`, `eviction_ratio={pressure['eviction_ratio']}`, "
        f"`default_kv_lease_ttl={pressure['lease_ttl_ms']}` ms (short, so eviction order — oldest "
        "lease timeout first — is the recency of the last lease, compressed in time). The same "
        f"deterministic trace replays in both modes: {pressure['turns']} requests from "
        f"{pressure['active_sessions']} concurrent session slots over {pressure['agents']} shared "
        f"system prompts of {pressure['system_blocks']} blocks; after a turn a session ends with "
        f"p={pressure['p_end']}, and its slot resumes an ended session (p={pressure['p_resume']}), "
        f"branches one at an earlier turn (p={pressure['p_branch']}) or starts a new one. Each "
        "request looks up its prompt with the mode's worker, then saves as upstream's worker does "
        "(`batch_is_exist` on every full-attention block from 0, the loaded window and new blocks; "
        "`put_batch` of what is missing). Values: "
        f"{pressure['attention_value_bytes']} B per attention block and group, "
        f"{pressure['recurrent_value_bytes']} B per Mamba checkpoint and rank namespace.",
        "",
        "Retention (vLLM's `prefix_cache_retention_interval`, read by the store masks): **dense** "
        "stores a sliding-window tail / Mamba state at every block boundary (what a deployment "
        "storing per-boundary states, like seed 002's, holds); **sparse** (vLLM's default, 0) "
        "stores only the one at each prompt's replay boundary, so the only keys lookups pass over "
        "are earlier turns' tails and states. Lookups ask about every boundary in both.",
        "",
        "Key classes, fixed by the trace: **resume load set** = keys read when every session "
        "resumes at its last prompt; **branch load set** = further keys read when every session "
        "branches at a random earlier turn (the window tail / checkpoint at that turn); "
        "**passed over** = every other stored key (sliding-window blocks and Mamba checkpoints no "
        "final lookup reads). Survival is a lease-free census (`batch_probe_key(keys, \"none\")`) "
        "after the trace.",
        "",
        "| layout, retention | pressure | mode | resume load set alive | branch load set alive | passed over alive | trace hit tokens / prompt tokens | trace hit / ideal | final resume hit / ideal | final branch hit / ideal | keys leased / lookup | evicted keys | put alloc failures |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in runs:
        label = f"{run['level']}: {run['segment_mib']} MiB, stored ×{run['pressure']:.1f} of watermark"
        for mode in MODES:
            m = run["modes"][mode]
            churn, survival, master = m["churn"], m["survival"], m["master"]
            lines.append(
                f"| {_scenario(run)} | {label} | {mode} | {_pct(survival['resume_load']['fraction'])} | "
                f"{_pct(survival['branch_load']['fraction'])} | {_pct(survival['passed_over']['fraction'])} | "
                f"{_pct(churn['hit_tokens'] / churn['prompt_tokens'])} | "
                f"{_pct(churn['hit_tokens'] / churn['ideal_tokens'] if churn['ideal_tokens'] else None)} | "
                f"{_pct(_final_ratio(m, 'resume'))} | {_pct(_final_ratio(m, 'branch'))} | "
                f"{churn['keys_leased_per_lookup']:.0f} | {master['master_evicted_key_count']:.0f} | "
                f"{master['master_put_start_alloc_failures_total']:.0f} |")
    lines += ["", "Per run: the trace and the key classes.", "",
              "| layout, retention | pressure | sessions | requests (new/turn/resume/branch) | stored keys | resume load set | branch load set | passed over | stored bytes |",
              "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for run in runs:
        keys = run["keys"]
        passed = keys["universe"] - keys["resume_load"] - keys["branch_load"]
        kinds = "/".join(str(run["kinds"][k]) for k in ("new", "turn", "resume", "branch"))
        lines.append(f"| {_scenario(run)} | {run['level']} | {run['sessions']} | {kinds} | {keys['universe']} | "
                     f"{keys['resume_load']} | {keys['branch_load']} | {passed} | "
                     f"{run['stored_bytes'] / (1 << 20):.1f} MiB |")
    lines += ["", "### The mechanism over time", "",
              "Share of each class still present among the keys stored so far, sampled during "
              "the trace (lease-free census); default / selective side by side.", "",
              "| layout, retention | pressure | after request | store used | resume load set: default | resume load set: selective | passed over: default | passed over: selective |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for run in runs:
        default, selective = (run["modes"][mode]["timeline"] for mode in MODES)
        for d, s in zip(default, selective, strict=True):
            lines.append(f"| {_scenario(run)} | {run['level']} | {d['request']} | "
                         f"{_pct(d['used_ratio'])} / {_pct(s['used_ratio'])} | "
                         f"{_pct(d['resume_load']['fraction'])} | {_pct(s['resume_load']['fraction'])} | "
                         f"{_pct(d['passed_over']['fraction'])} | {_pct(s['passed_over']['fraction'])} |")
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
    parser.add_argument("--pressure-layouts", type=lambda s: tuple(s.split(",")))
    parser.add_argument("--retentions", type=lambda s: tuple(s.split(",")))
    parser.add_argument("--pressure-levels", type=lambda s: tuple(
        PressureLevel(name, float(fits)) for name, fits in (item.split("=") for item in s.split(","))))
    parser.add_argument("--turns", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--skip-micro", action="store_true")
    parser.add_argument("--skip-pressure", action="store_true")
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
    pressure = {k: v for k, v in {"layouts": args.pressure_layouts, "levels": args.pressure_levels,
                                  "turns": args.turns, "retentions": args.retentions}.items()
                if v is not None}
    for retention in pressure.get("retentions", ()):
        if retention not in RETENTIONS:
            raise SystemExit(f"unknown retention {retention!r}; use {', '.join(RETENTIONS)}")
    for transport in micro.get("transports", ()):
        if transport not in TRANSPORTS:
            raise SystemExit(f"unknown transport {transport!r}; use {', '.join(TRANSPORTS)}")
    return RunSettings(
        micro=MicroSettings(**{**asdict(base.micro), **micro}),
        pressure=PressureSettings(**{**{k: getattr(base.pressure, k) for k in asdict(base.pressure)},
                                     **pressure}),
        seed=args.seed if args.seed is not None else base.seed, quick=base.quick,
        skip_micro=args.skip_micro, skip_pressure=args.skip_pressure)


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
        "settings": {"quick": settings.quick, "seed": settings.seed, "micro": asdict(settings.micro),
                     "pressure": asdict(settings.pressure)},
        "environment": fetch_environment(REPO),
    }
    load_before = os.getloadavg()
    if not settings.skip_micro:
        phase = time.monotonic()
        micro = settings.micro
        per_process = len(micro.layouts) * len(micro.sizes) * len(micro.transports) * 2 * (
            micro.warmup + micro.iterations)
        with tqdm(total=per_process * micro.processes, desc="lookup microbenchmark", unit="lookup",
                  file=sys.stderr) as progress:
            processes = run_micro(settings, log_dir, progress)
        results["micro_processes"] = processes
        results["micro"] = summarize_micro(processes)
        results["micro_seconds"] = time.monotonic() - phase
    if not settings.skip_pressure:
        phase = time.monotonic()
        results["pressure"] = run_pressure(settings, log_dir)
        results["pressure_seconds"] = time.monotonic() - phase
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
