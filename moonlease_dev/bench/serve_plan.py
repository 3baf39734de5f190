"""`moonlease bench serve`, the pure part: which engines to run, the prompts, the summaries.

A trace from the replay's generator (`moonlease_dev.bench.workload`) becomes real prompts: each
16-token hash block becomes 16 token ids drawn from a generator seeded by that block's hash, so
two prompts share a prefix of tokens exactly when they share a prefix of hashes (what the
trace means). Arrival times are scaled so the whole trace fits in a chosen wall time.

A request's *reusable* tokens are the longest prefix (in whole hash blocks) it shares with any
earlier request of the trace; its *age* is the scaled time since that earlier request arrived.
A request whose cached tokens (reported by the engine) fall short of its reusable tokens by a
block or more *missed*; misses are counted by age.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from moonlease_settings.lease_modes import LEASE_MODE_KEY, LeaseMode
from moonlease_dev.bench.stats import percentile
from moonlease_dev.bench.trace import Trace

TOKEN_RANGE = (4, 1000)  # avoid the tokenizer's special ids (0..3)
AGE_BUCKETS_S = (1.0, 5.0, 20.0, math.inf)  # wall seconds (scaled), upper bounds


@dataclass(frozen=True)
class ServeCase:
    """One engine configuration: a model, the workload preset it serves, a lease mode."""

    model: str  # a TINY_MODELS name
    workload: str  # a WORKLOADS preset
    mode: LeaseMode
    junctions: bool = False
    #: The P/D hand-off (decode waits for the prefill's promised save); off: `+nohandoff`, to
    #: measure upstream's race beside it.
    handoff: bool = True

    @property
    def label(self) -> str:
        return (self.mode.value + ("+junctions" if self.junctions else "")
                + ("" if self.handoff else "+nohandoff"))

    def extra_config(self) -> dict[str, Any]:
        """`kv_connector_extra_config` selecting this case's mode."""
        config: dict[str, Any] = {LEASE_MODE_KEY: self.mode.value,
                                  "mooncake_junction_retention": self.junctions}
        if not self.handoff:
            config["mooncake_handoff_timeout_ms"] = 0
        return config


@dataclass(frozen=True)
class Pressure:
    """Store pressure: the pool's segment and the master's eviction watermark."""

    name: str
    segment_mib: int
    watermark: float


#: Hybrid model (where last-hit-only applies) and sliding-window model (where junction
#: retention applies), each with the modes that matter for it.
DEFAULT_CASES: tuple[ServeCase, ...] = (
    ServeCase("hybrid-serve", "agentic-hybrid", LeaseMode.LEASE_ALL),
    ServeCase("hybrid-serve", "agentic-hybrid", LeaseMode.SELECTIVE),
    ServeCase("hybrid-serve", "agentic-hybrid", LeaseMode.LAST_HIT_ONLY),
    ServeCase("swa-serve", "agentic-swa", LeaseMode.LEASE_ALL),
    ServeCase("swa-serve", "agentic-swa", LeaseMode.LEASE_ALL, junctions=True),
)
#: mooncake_client refuses a segment under 16 MiB, and the default trace stores about 20 MiB
#: (hybrid) and 8 MiB (sliding window): below 16 MiB the pressure comes from the master's
#: eviction watermark, which starts evicting at that share of the segment (0.25: 4 MiB, 0.1:
#: 1.6 MiB), so that the high-pressure cells do evict.
DEFAULT_PRESSURES: tuple[Pressure, ...] = (
    Pressure("low", segment_mib=512, watermark=0.95),
    Pressure("high", segment_mib=16, watermark=0.25),
    Pressure("max", segment_mib=16, watermark=0.1),
)
#: Trace knobs for serving on a CPU: no document-sized prompts, shorter system prompts.
SERVE_KNOBS: dict[str, Any] = {"p_long": 0.0, "system_blocks": 16, "first_blocks": (4, 16),
                               "turn_blocks": (2, 6), "output_blocks": (1, 4),
                               "duration_s": 450.0, "sessions_per_min": 3.0}
#: Per-repeat figures whose range (lowest, highest) the report shows beside the pooled value.
SPREAD_KEYS = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "store_hit_rate", "reuse_served_rate",
               "keys_leased_per_lookup", "decode_load_rate")


def parse_cases(text: str) -> tuple[ServeCase, ...]:
    """`model:workload:mode[+junctions][+nohandoff],...` → cases (a clear error for anything else)."""
    cases = []
    for item in (x for x in text.split(",") if x):
        parts = item.split(":")
        if len(parts) != 3:
            raise ValueError(f"case {item!r}: want MODEL:WORKLOAD:MODE[+junctions][+nohandoff]")
        model, workload, mode = parts
        mode, *pieces = mode.split("+")
        unknown = set(pieces) - {"junctions", "nohandoff"}
        if unknown or len(set(pieces)) != len(pieces):
            raise ValueError(f"case {item!r}: after the mode, only +junctions and +nohandoff (once each)")
        try:
            lease = LeaseMode(mode)
        except ValueError:
            raise ValueError(f"case {item!r}: mode {mode!r} is not one of "
                             f"{', '.join(m.value for m in LeaseMode)}") from None
        cases.append(ServeCase(model, workload, lease, "junctions" in pieces, "nohandoff" not in pieces))
    return tuple(cases)


def parse_pressures(text: str) -> tuple[Pressure, ...]:
    """`name:segmentMiB:watermark,...` → pressures."""
    pressures = []
    for item in (x for x in text.split(",") if x):
        parts = item.split(":")
        if len(parts) != 3:
            raise ValueError(f"pressure {item!r}: want NAME:SEGMENT_MIB:WATERMARK")
        watermark = float(parts[2])
        if not 0 < watermark <= 1:
            raise ValueError(f"pressure {item!r}: watermark must be in (0, 1]")
        pressures.append(Pressure(parts[0], int(parts[1]), watermark))
    return tuple(pressures)


#: vllm-router's load-balancing policies that `--router-policy` and the testbed's router accept.
ROUTER_POLICIES = ("round_robin", "random", "consistent_hash", "cache_aware", "power_of_two")
#: Counters whose prefill-engine sums are the case's store figures behind a router: a prefill
#: engine's lookup is where reuse across requests shows (the decode engine loads what the
#: prefill engine has just saved, nearly always, whatever the lease mode).
_DECODE_PREFIX = "decode_"


@dataclass(frozen=True)
class EngineLayout:
    """Engines per case behind vllm-router: prefill engines (kv_producer: look up, prefill the
    rest, save) and decode engines (kv_consumer: load the prompt from the store, answer)."""

    prefill: int
    decode: int
    policy: str = "round_robin"

    def __post_init__(self) -> None:
        if self.prefill < 1 or self.decode < 1:
            raise ValueError(f"engines {self.prefill}:{self.decode}: want at least one prefill and "
                             "one decode engine (PREFILL:DECODE, e.g. 2:1)")
        if self.policy not in ROUTER_POLICIES:
            raise ValueError(f"router policy {self.policy!r} is not one of {', '.join(ROUTER_POLICIES)}")

    @property
    def label(self) -> str:
        return f"{self.prefill} prefill + {self.decode} decode"


def parse_engines(text: str, policy: str = "round_robin") -> EngineLayout:
    """`PREFILL:DECODE` (e.g. `2:1`) → a layout (a clear error for anything else)."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"engines {text!r}: want PREFILL:DECODE, two whole numbers (e.g. 2:1)")
    return EngineLayout(int(parts[0]), int(parts[1]), policy)


def combine_role_counters(prefill: Sequence[Mapping[str, float]],
                          decode: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """One case's counters from its engines: the prefill engines' sums under the usual names
    (store hit rate, lookups, keys leased: what the lease mode decides), the decode engines'
    sums with a `decode_` prefix (how much of each prompt the decode side loaded)."""
    combined: dict[str, float] = {}
    for counters in prefill:
        for key, value in counters.items():
            combined[key] = combined.get(key, 0.0) + value
    for counters in decode:
        for key, value in counters.items():
            combined[_DECODE_PREFIX + key] = combined.get(_DECODE_PREFIX + key, 0.0) + value
    return combined


@dataclass(frozen=True)
class PlannedRequest:
    """One request to send: when (wall seconds from the start), what, and what it could reuse."""

    index: int
    at_s: float
    session: str
    kind: str
    token_ids: tuple[int, ...]
    max_tokens: int
    reusable_tokens: int
    reuse_age_s: float | None  # None: nothing to reuse


def block_tokens(block_hash: str, count: int) -> list[int]:
    rng = random.Random(block_hash)
    return [rng.randrange(*TOKEN_RANGE) for _ in range(count)]


def plan_requests(trace: Trace, *, wall_s: float, max_prompt_tokens: int,
                  max_output_tokens: int) -> tuple[list[PlannedRequest], int]:
    """The trace as requests, timing scaled to `wall_s`; (requests, how many were too long)."""
    per_block = trace.header.hash_block_tokens
    start = trace.requests[0].arrival_s if trace.requests else 0.0
    scale = wall_s / trace.span_s if trace.span_s > 0 else 1.0
    seen_chain: dict[str, float] = {}
    planned: list[PlannedRequest] = []
    too_long = 0
    for request in trace.requests:
        at = (request.arrival_s - start) * scale
        hashes = request.block_hashes
        if len(hashes) * per_block > max_prompt_tokens:
            too_long += 1
            continue
        # Chained hashes: a block's hash names its whole prefix, so the longest reusable prefix
        # is the last block whose hash an earlier request sent.
        reusable_blocks, age = 0, None
        for i in range(len(hashes) - 1, -1, -1):
            if hashes[i] in seen_chain:
                reusable_blocks, age = i + 1, at - seen_chain[hashes[i]]
                break
        tokens: list[int] = []
        for h in hashes:
            tokens.extend(block_tokens(h, per_block))
        for h in hashes:
            seen_chain[h] = at
        planned.append(PlannedRequest(len(planned), at, request.session, request.kind, tuple(tokens),
                                      max(1, min(request.output_tokens, max_output_tokens)),
                                      reusable_blocks * per_block, age))
    return planned, too_long


@dataclass(frozen=True)
class RequestResult:
    index: int
    ttft_s: float | None  # None: failed
    latency_s: float | None
    prompt_tokens: int
    cached_tokens: int | None
    output_tokens: int
    error: str | None = None


def age_bucket(age_s: float) -> str:
    low = 0.0
    for high in AGE_BUCKETS_S:
        if age_s < high:
            return f"{low:g}-{high:g} s" if math.isfinite(high) else f">= {low:g} s"
        low = high
    return f">= {low:g} s"


@dataclass(frozen=True)
class CaseSummary:
    """What one engine measured under one pressure."""

    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    requests_ok: int
    requests_failed: int
    wall_s: float
    requests_per_s: float
    prompt_tokens_per_s: float
    store_hit_rate: float | None  # external hits / external queries (tokens)
    reuse_served_rate: float | None  # cached / reusable tokens (local + store)
    misses_by_age: dict[str, int] = field(default_factory=dict)
    reusable_by_age: dict[str, int] = field(default_factory=dict)
    keys_leased_per_lookup: float | None = None
    keys_probed_per_lookup: float | None = None
    lookups: float | None = None
    evictions: float | None = None
    #: Behind a P/D router: the decode engines' store hits over their queries (tokens).
    decode_load_rate: float | None = None


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or not den:
        return None
    return num / den


def summarize(planned: Sequence[PlannedRequest], results: Sequence[RequestResult], wall_s: float,
              metric_deltas: Mapping[str, float], *, block_tokens_hint: int = 16) -> CaseSummary:
    """Percentiles, rates and misses by age from one case's requests and metric deltas."""
    by_index = {p.index: p for p in planned}
    ok = [r for r in results if r.ttft_s is not None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    misses: dict[str, int] = {}
    reusable: dict[str, int] = {}
    served = reusable_total = 0
    for result in ok:
        plan = by_index[result.index]
        if plan.reuse_age_s is None or plan.reusable_tokens == 0 or result.cached_tokens is None:
            continue
        bucket = age_bucket(plan.reuse_age_s)
        reusable[bucket] = reusable.get(bucket, 0) + 1
        reachable = plan.reusable_tokens // block_tokens_hint * block_tokens_hint
        reusable_total += plan.reusable_tokens
        served += min(result.cached_tokens, plan.reusable_tokens)
        if reachable and result.cached_tokens + block_tokens_hint <= reachable:
            misses[bucket] = misses.get(bucket, 0) + 1
    lookups = metric_deltas.get("lookups")
    return CaseSummary(
        ttft_p50_s=percentile(ttfts, 50), ttft_p90_s=percentile(ttfts, 90),
        ttft_p99_s=percentile(ttfts, 99), requests_ok=len(ok),
        requests_failed=len(results) - len(ok), wall_s=wall_s,
        requests_per_s=len(ok) / wall_s if wall_s > 0 else 0.0,
        prompt_tokens_per_s=sum(r.prompt_tokens for r in ok) / wall_s if wall_s > 0 else 0.0,
        store_hit_rate=_ratio(metric_deltas.get("external_hits"), metric_deltas.get("external_queries")),
        reuse_served_rate=_ratio(served, reusable_total),
        misses_by_age=dict(sorted(misses.items())), reusable_by_age=dict(sorted(reusable.items())),
        keys_leased_per_lookup=_ratio(metric_deltas.get("keys_leased"), lookups),
        keys_probed_per_lookup=_ratio(metric_deltas.get("keys_probed"), lookups),
        lookups=lookups, evictions=metric_deltas.get("evictions"),
        decode_load_rate=_ratio(metric_deltas.get("decode_external_hits"),
                                metric_deltas.get("decode_external_queries")))


def summarize_repeats(planned: Sequence[PlannedRequest], results: Sequence[Sequence[RequestResult]],
                      walls_s: Sequence[float], deltas: Sequence[Mapping[str, float]], *,
                      block_tokens_hint: int = 16) -> tuple[CaseSummary, list[CaseSummary]]:
    """One cell replayed several times: (pooled summary, one summary per repeat).

    Pooled: percentiles over every repeat's requests, rates over the summed counters, throughput
    over the summed wall time — what one run as long as all of them together would report.
    """
    if not (len(results) == len(walls_s) == len(deltas)) or not results:
        raise ValueError("one result list, wall time and metric delta per repeat, at least one")
    per_repeat = [summarize(planned, r, w, d, block_tokens_hint=block_tokens_hint)
                  for r, w, d in zip(results, walls_s, deltas)]
    summed: dict[str, float] = {}
    for delta in deltas:
        for key, value in delta.items():
            summed[key] = summed.get(key, 0.0) + value
    pooled = summarize(planned, [r for repeat in results for r in repeat], sum(walls_s), summed,
                       block_tokens_hint=block_tokens_hint)
    return pooled, per_repeat


def spread_of(per_repeat: Sequence[Mapping[str, Any]]) -> dict[str, tuple[float, float] | None]:
    """(lowest, highest) of each `SPREAD_KEYS` figure over the repeats; None where unmeasured."""
    spread: dict[str, tuple[float, float] | None] = {}
    for key in SPREAD_KEYS:
        values = [float(s[key]) for s in per_repeat
                  if s.get(key) is not None and not math.isnan(float(s[key]))]
        spread[key] = (min(values), max(values)) if values else None
    return spread


class Separation(str, Enum):
    """How a mode's per-repeat figures sit against lease-all's in the same cell."""

    LOWER = "lower"  # every repeat of the mode below every repeat of lease-all
    HIGHER = "higher"  # every repeat above
    OVERLAP = "overlap"  # the ranges overlap: no difference this run can tell from noise
    SINGLE = "single run"  # one repeat each: no spread to compare against


@dataclass(frozen=True)
class ModeDifference:
    """A mode against lease-all on one workload at one pressure (pooled figures, ranges)."""

    workload: str
    pressure: str
    mode: str
    ttft_p50_delta_s: float
    ttft_p90_delta_s: float
    hit_rate_delta_pts: float | None
    ttft_p90: Separation
    hit_rate: Separation


def _separation(mode: tuple[float, float] | None, base: tuple[float, float] | None,
                repeats: int) -> Separation:
    if repeats < 2 or mode is None or base is None:
        return Separation.SINGLE
    if mode[1] < base[0]:
        return Separation.LOWER
    if mode[0] > base[1]:
        return Separation.HIGHER
    return Separation.OVERLAP


def compare_modes(runs: Sequence[Mapping[str, Any]]) -> list[ModeDifference]:
    """Every non-baseline mode against `leaseAll` in the same workload and pressure.

    `runs` are the report's records (`workload`, `mode`, `pressure.name`, `summary`, and, with
    repeats, `repeats` and `spread`). A mode *separates* from lease-all only when its range over
    the repeats does not overlap lease-all's: the run's own noise is the yardstick.
    """
    base = {(r["workload"], r["pressure"]["name"]): r for r in runs if r["mode"] == LeaseMode.LEASE_ALL.value}
    differences = []
    for run in runs:
        key = (run["workload"], run["pressure"]["name"])
        if run["mode"] == LeaseMode.LEASE_ALL.value or key not in base:
            continue
        ref, s, b = base[key], run["summary"], base[key]["summary"]
        repeats = min(len(run.get("repeats") or [None]), len(ref.get("repeats") or [None]))
        mode_spread, base_spread = run.get("spread") or {}, ref.get("spread") or {}
        hit = None
        if s.get("store_hit_rate") is not None and b.get("store_hit_rate") is not None:
            hit = 100 * (s["store_hit_rate"] - b["store_hit_rate"])
        differences.append(ModeDifference(
            workload=run["workload"], pressure=run["pressure"]["name"], mode=run["mode"],
            ttft_p50_delta_s=s["ttft_p50_s"] - b["ttft_p50_s"],
            ttft_p90_delta_s=s["ttft_p90_s"] - b["ttft_p90_s"], hit_rate_delta_pts=hit,
            ttft_p90=_separation(_pair(mode_spread.get("ttft_p90_s")), _pair(base_spread.get("ttft_p90_s")), repeats),
            hit_rate=_separation(_pair(mode_spread.get("store_hit_rate")),
                                 _pair(base_spread.get("store_hit_rate")), repeats)))
    return differences


def _pair(value: Any) -> tuple[float, float] | None:
    return None if value is None else (float(value[0]), float(value[1]))
