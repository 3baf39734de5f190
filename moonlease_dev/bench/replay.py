"""`moonlease bench replay`: a trace through our real lookup/lease/save code and a real store.

I/O module. For each lease mode it starts a fresh real `mooncake_master` and store pool whose
segment is small enough to force eviction, builds `MoonleaseStoreWorker` in that mode around
vLLM's real coordinator (no engine, no model: `moonlease_dev.bench.workers`), and replays the
trace: each request looks its prompt up (the connector's planning and store adapter, leases
and all), then saves as upstream's worker does (`moonlease_dev.bench.saves`). At the end a
lease-free probe records which stored keys survived, loaded versus passed over
(`accounting.summarize_survival`: seed 002's mechanism). Offline, with the
same code against never-evicting and clairvoyant in-memory stores, it computes each
request's ideal hit (for misses by age, `moonlease_dev.bench.accounting`) and Belady's hit rate
at the same capacity (`moonlease_dev.bench.belady`).

Virtual time: trace arrivals are virtual seconds; the replay runs them `time_scale` times
faster (`wall_s_per_run / trace span`), sleeping until each request's scaled arrival, and the
master's `default_kv_lease_ttl` is the production TTL (`lease_ttl_s`, Mooncake's default
10 s) times the same scale. So the share of keys under lease when eviction runs — the thing
lease modes change — is the production one, and eviction order (oldest lease timeout first)
follows the trace's time. A request processed late (the machine is slower than the scaled
arrivals) starts at once and shifts the rest of the schedule (`Pacer`); the report gives the
lateness.

Fleets (`--engines`, `moonlease_dev.bench.fleet`): several connectors — each with its own lookup
object, save path and retention state (pin's shared-prefix tracker, evict's recency order) —
share the one master and store pool (and the one in-process client: leases are the master's,
per key, whoever asked). A router sends each request to a prefill engine, which looks up and
saves, then to a decode engine, which looks the prompt up and loads what was saved (its
lookup leases like any other; decode stores nothing, `save_decode_cache` off). The ideal and
Belady are the fleet's: one store, so the same lookups and saves in the same order, with the
decode engines' reads added to Belady's future right after each save.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moonlease_dev.bench.accounting import (
    LookupCosts,
    RequestAccount,
    state_age,
    summarize_hits,
    summarize_survival,
)
from moonlease_dev.bench.belady import BeladyStore, build_read_index
from moonlease_dev.bench.fleet import SINGLE_ENGINE, FleetSpec, Router, parse_fleet
from moonlease_dev.bench.recency import RecencyStore
from moonlease_dev.bench.saves import (
    ValueSizes,
    apply_save,
    build_prompt_chunks,
    build_save_keys,
    build_save_retention,
)
from moonlease_dev.bench.stores import CountingStore, DictStore, MooncakeBed, fetch_presence
from moonlease_dev.bench.trace import Trace
from moonlease_dev.testbed.fleet_order import FleetOrderProcess
from moonlease_dev.bench.workers import (
    Layout,
    build_lookup,
    keys_the_load_reads,
    keys_the_load_reads_in_order,
    layout_by_name,
)
from moonlease_settings.config import LeaseMode, MoonleaseConnectorConfig
from moonlease_connector.core.put_retry import DEFAULT_PUT_RETRY
from moonlease_settings.retention import RetentionSettings
from moonlease_connector.core.shared_prefix import SharedPrefixTracker
from moonlease_connector.core.lookup_protocol import parse_wire_entries

MIN_SEGMENT_MIB = 16  # mooncake_client refuses a smaller global segment
RETENTION_INTERVAL = {"dense": None, "sparse": 0}


@dataclass(frozen=True)
class ModeSpec:
    """A lease mode as a user turns it on (connector settings)."""

    name: str
    lease_mode: LeaseMode
    junction_retention: bool = False
    retention: RetentionSettings = RetentionSettings()
    # `evict` on the fleet's order: each engine's connector reports to, and takes victims from,
    # a real fleet order service (`mooncake_fleet_order_url`) instead of ordering its own keys.
    fleet_evict: bool = False

    def settings(self) -> MoonleaseConnectorConfig:
        """The connector settings a user turns this mode on with."""
        return MoonleaseConnectorConfig.for_mode(self.lease_mode, junction_retention=self.junction_retention,
                                                 retention=self.retention)

    def applies_to(self, layout: Layout, retention: str) -> bool:
        kinds = {type(spec).__name__ for spec in layout.specs}
        if self.settings().strategy.needs_hybrid_model and kinds != {"FullAttentionSpec", "MambaSpec"}:
            return False  # start-up refuses it for anything but full attention + align Mamba
        if self.retention.skip and retention == "sparse":
            return False  # sparse retention writes (almost) nothing outside the resume set
        if self.junction_retention:
            # Junctions keep sliding-window tails; dense retention stores them all anyway.
            return "SlidingWindowSpec" in kinds and retention == "sparse"
        return True


MODES: dict[str, ModeSpec] = {spec.name: spec for spec in (
    ModeSpec("leaseAll", LeaseMode.LEASE_ALL),
    ModeSpec("selective", LeaseMode.SELECTIVE),
    ModeSpec("lastHitOnly", LeaseMode.LAST_HIT_ONLY),
    ModeSpec("leaseAll+junctions", LeaseMode.LEASE_ALL, junction_retention=True),
    ModeSpec("selective+junctions", LeaseMode.SELECTIVE, junction_retention=True),
    # Moonlease retention (issue 21) and its ablation: each piece alone, together, and `skip`
    # beside the seed lease modes it combines with.
    ModeSpec("leaseAll+pin", LeaseMode.LEASE_ALL, retention=RetentionSettings(pin=True)),
    ModeSpec("leaseAll+skip", LeaseMode.LEASE_ALL, retention=RetentionSettings(skip=True)),
    ModeSpec("leaseAll+pin+skip", LeaseMode.LEASE_ALL, retention=RetentionSettings(pin=True, skip=True)),
    ModeSpec("selective+skip", LeaseMode.SELECTIVE, retention=RetentionSettings(skip=True)),
    ModeSpec("lastHitOnly+skip", LeaseMode.LAST_HIT_ONLY, retention=RetentionSettings(skip=True)),
    ModeSpec("leaseAll+junctions+pin", LeaseMode.LEASE_ALL, junction_retention=True,
             retention=RetentionSettings(pin=True)),
    # `retry` (put again what the store refused for lack of space) and its ablation.
    ModeSpec("leaseAll+retry", LeaseMode.LEASE_ALL, retention=RetentionSettings(retry=True)),
    ModeSpec("leaseAll+junctions+retry", LeaseMode.LEASE_ALL, junction_retention=True,
             retention=RetentionSettings(retry=True)),
    ModeSpec("leaseAll+junctions+pin+retry", LeaseMode.LEASE_ALL, junction_retention=True,
             retention=RetentionSettings(pin=True, retry=True)),
    ModeSpec("leaseAll+skip+retry", LeaseMode.LEASE_ALL, retention=RetentionSettings(skip=True, retry=True)),
    ModeSpec("leaseAll+pin+skip+retry", LeaseMode.LEASE_ALL,
             retention=RetentionSettings(pin=True, skip=True, retry=True)),
    # The recommended retention beside the seed lease modes: does leasing less on lookups add
    # to what retention keeps?
    ModeSpec("selective+pin+skip", LeaseMode.SELECTIVE, retention=RetentionSettings(pin=True, skip=True)),
    ModeSpec("lastHitOnly+pin+skip", LeaseMode.LAST_HIT_ONLY, retention=RetentionSettings(pin=True, skip=True)),
    ModeSpec("selective+junctions+pin+retry", LeaseMode.SELECTIVE, junction_retention=True,
             retention=RetentionSettings(pin=True, retry=True)),
    # `evict` (the connector removes its least recently used keys before the master's
    # near-random first pass must) and its ablation.
    ModeSpec("leaseAll+evict", LeaseMode.LEASE_ALL, retention=RetentionSettings(evict=True)),
    ModeSpec("leaseAll+junctions+evict", LeaseMode.LEASE_ALL, junction_retention=True,
             retention=RetentionSettings(evict=True)),
    ModeSpec("leaseAll+junctions+retry+evict", LeaseMode.LEASE_ALL, junction_retention=True,
             retention=RetentionSettings(retry=True, evict=True)),
    ModeSpec("leaseAll+skip+evict", LeaseMode.LEASE_ALL, retention=RetentionSettings(skip=True, evict=True)),
    ModeSpec("leaseAll+junctions+pin+evict", LeaseMode.LEASE_ALL, junction_retention=True,
             retention=RetentionSettings(pin=True, evict=True)),
    ModeSpec("leaseAll+junctions+pin+retry+evict", LeaseMode.LEASE_ALL, junction_retention=True,
             retention=RetentionSettings(pin=True, retry=True, evict=True)),
    # `evict` with the order shared by the fleet: the fleet order service (one per store) that
    # every engine reports its saves and loads to and asks for victims.
    ModeSpec("leaseAll+evict@fleet", LeaseMode.LEASE_ALL, retention=RetentionSettings(evict=True),
             fleet_evict=True),
    ModeSpec("leaseAll+skip+evict@fleet", LeaseMode.LEASE_ALL,
             retention=RetentionSettings(skip=True, evict=True), fleet_evict=True),
    ModeSpec("leaseAll+junctions+evict@fleet", LeaseMode.LEASE_ALL, junction_retention=True,
             retention=RetentionSettings(evict=True), fleet_evict=True),
    ModeSpec("leaseAll+junctions+pin+retry+evict@fleet", LeaseMode.LEASE_ALL, junction_retention=True,
             retention=RetentionSettings(pin=True, retry=True, evict=True), fleet_evict=True),
    ModeSpec("selective+pin+skip+evict@fleet", LeaseMode.SELECTIVE,
             retention=RetentionSettings(pin=True, skip=True, evict=True), fleet_evict=True),
)}


@dataclass(frozen=True)
class ReplaySettings:
    capacities: tuple[float, ...] = (0.05, 0.15, 0.4)  # share of the trace's stored bytes that fits
    # Those that apply to each trace's layout run (evict on the fleet order only by name).
    modes: tuple[str, ...] = tuple(name for name, spec in MODES.items() if not spec.fleet_evict)
    watermark: float = 0.8  # eviction_high_watermark_ratio
    eviction_ratio: float = 0.05
    lease_ttl_s: float = 10.0  # production default_kv_lease_ttl, scaled like the trace
    soft_pin_ttl_s: float = 1800.0  # production default_kv_soft_pin_ttl (Mooncake's), scaled alike
    wall_s_per_run: float = 25.0  # wall seconds one mode's replay of a trace takes
    repeats: int = 1  # fresh runs per mode and capacity (the report shows their spread)
    sizes: ValueSizes = ValueSizes(attention=16384, recurrent=65536)
    engines: str = "4p1d"  # the fleet (moonlease_dev.bench.fleet.parse_fleet): 4 prefill + 1 decode
    routing: str = "session"  # session | random | round-robin (moonlease_dev.bench.fleet.ROUTINGS)
    routing_seed: int = 0  # the random router's seed

    @property
    def fleet(self) -> FleetSpec:
        return parse_fleet(self.engines)


@dataclass
class IdealReplay:
    """The trace against a store that never evicts (one per junction-retention setting)."""

    hits: list[int]
    ages: list[float | None]
    reads: list[list[str]]  # keys each ideal load reads (Belady's future)
    key_sizes: dict[str, int] = field(default_factory=dict)
    decode_hits: list[int] = field(default_factory=list)  # a decode engine's hit after the save
    decode_reads: list[list[str]] = field(default_factory=list)  # keys its load reads

    @property
    def stored_bytes(self) -> int:
        return sum(self.key_sizes.values())

    def loaded_keys(self) -> set[str]:
        """Keys some lookup of the trace reads (the rest of the stored keys are only passed over)."""
        return {key for reads in self.reads for key in reads}


class Pacer:
    """Sleeps until each request's scaled arrival; the clock and sleep are injectable.

    A request that starts late (the machine was slower than the scaled arrivals) shifts the
    schedule of every later request by its lateness, instead of letting them run back to back
    to catch up: a catch-up burst would put many requests inside one scaled lease TTL and so
    hold more keys under lease than production would. Lateness is recorded per request, in
    virtual seconds (it does not accumulate), and in total wall seconds (`stretch_s`).
    """

    def __init__(self, scale: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.scale = scale
        self._clock = clock
        self._sleep = sleep
        self._origin: tuple[float, float] | None = None  # (virtual, wall) of an on-time request
        self.lags_s: list[float] = []  # virtual seconds each request started late
        self.stretch_s = 0.0  # wall seconds the schedule was shifted in all

    def wait(self, virtual_s: float) -> None:
        now = self._clock()
        if self._origin is None:
            self._origin = (virtual_s, now)
        due = self._origin[1] + (virtual_s - self._origin[0]) * self.scale
        if due > now:
            self._sleep(due - now)
            self.lags_s.append(0.0)
            return
        self.lags_s.append((now - due) / self.scale if self.scale else 0.0)
        self.stretch_s += now - due
        self._origin = (virtual_s, now)


def _retention_interval(trace: Trace) -> int | None:
    return RETENTION_INTERVAL[trace.header.retention]


def _junctions(result: Any) -> tuple[int, ...]:
    entries = ((b.group_id, b.num_tokens) for b in result.tail_key_boundaries)
    return parse_wire_entries(result.hit_length, entries).junctions


def _reference_lookup(layout: Layout, store: DictStore, trace: Trace, junction_retention: bool) -> Any:
    """Our lease-all lookup over an in-memory store, for the ideal and Belady.

    Inline (`served_by_client`), as the scheduler's served lookups run: the same lookup code
    without the helper thread and deadline an in-process lookup of a real store runs under,
    which an in-memory dict does not need (and which, on a loaded machine, could turn a slow
    answer into a miss of the reference).
    """
    return build_lookup(layout, store, LeaseMode.LEASE_ALL, junction_retention=junction_retention,
                        retention_interval=_retention_interval(trace), served_by_client=True)


def build_ideal_replay(trace: Trace, *, junction_retention: bool, sizes: ValueSizes,
                       decode: bool = False) -> IdealReplay:
    """Every request against a never-evicting in-memory store, through the same code.

    `decode`: after each save, also what a decode engine's lookup of the prompt finds and reads.
    """
    layout = layout_by_name(trace.header.layout)
    store = DictStore()
    lookup = _reference_lookup(layout, store, trace, junction_retention)
    block = trace.header.hash_block_tokens
    ideal = IdealReplay([], [], [])
    last_use: dict[str, float] = {}
    for request in trace.requests:
        hashes = request.hashes()
        result = lookup.lookup(request.prompt_tokens(block), hashes)
        hit = result.hit_length
        reads = sorted(keys_the_load_reads(lookup, hashes, result))
        ideal.hits.append(hit)
        ideal.ages.append(state_age(reads, last_use, request.arrival_s) if hit > 0 else None)
        ideal.reads.append(reads)
        chunks = build_prompt_chunks(lookup, hashes, block, _junctions(result))
        # Whole chunks at once (C-level dict updates): a key's size is its chunk's kind, the
        # same every time it is saved.
        for chunk in build_save_keys(lookup, hashes, hit, chunks):
            ideal.key_sizes.update(dict.fromkeys(chunk.keys, sizes.of(chunk)))
            last_use.update(dict.fromkeys(chunk.keys, request.arrival_s))
            store.keys.update(chunk.keys)
        last_use.update(dict.fromkeys(reads, request.arrival_s))
        if decode:
            after = lookup.lookup(request.prompt_tokens(block), hashes)
            ideal.decode_hits.append(after.hit_length)
            ideal.decode_reads.append(sorted(keys_the_load_reads(lookup, hashes, after)))
    return ideal


@dataclass
class BeladyHits:
    """Per request, the prefill hit (and the decode engine's, for a fleet with decode) under MIN."""

    prefill: list[int] = field(default_factory=list)
    decode: list[int] = field(default_factory=list)


def build_belady_replay(trace: Trace, ideal: IdealReplay, capacity_bytes: int, *,
                        junction_retention: bool) -> BeladyHits:
    """Per request, the hit under Belady's MIN at `capacity_bytes` (same lookup and saves).

    With decode reads in `ideal` (a fleet with decode engines), MIN's future holds them too:
    request i's prefill lookup is event 2i, its decode load event 2i+1, right after the save.
    """
    layout = layout_by_name(trace.header.layout)
    decode = bool(ideal.decode_reads)
    events = [reads for pair in zip(ideal.reads, ideal.decode_reads) for reads in pair] if decode \
        else ideal.reads
    stride = 2 if decode else 1
    belady = BeladyStore(capacity_bytes, build_read_index(events), ideal.key_sizes)
    view = DictStore()
    view.keys = belady.present  # lookups see exactly what MIN kept
    lookup = _reference_lookup(layout, view, trace, junction_retention)
    block = trace.header.hash_block_tokens
    hits = BeladyHits()
    for step, request in enumerate(trace.requests):
        hashes = request.hashes()
        result = lookup.lookup(request.prompt_tokens(block), hashes)
        hits.prefill.append(result.hit_length)
        event = step * stride
        belady.touch(ideal.reads[step], event)
        chunks = build_prompt_chunks(lookup, hashes, block, _junctions(result))
        belady.admit([key for chunk in build_save_keys(lookup, hashes, result.hit_length, chunks)
                      for key in chunk.keys], event)
        if decode:
            hits.decode.append(lookup.lookup(request.prompt_tokens(block), hashes).hit_length)
            belady.touch(ideal.decode_reads[step], event + 1)
    return hits


def build_recency_replay(trace: Trace, ideal: IdealReplay, capacity_bytes: int, *, junction_retention: bool,
                         keep_shared: bool = False, free_share: float = 0.0) -> list[int]:
    """Per request, the prefill hit with a `RecencyStore` (same lookup and saves as the replay).

    One order for the fleet: each request's load (what its hit read), its save and, with decode
    reads in `ideal`, a decode engine's load of the saved prompt right after touch it. The shared
    prefix is one tracker's estimate over every prompt (the fleet's view).
    """
    store = RecencyStore(capacity_bytes, ideal.key_sizes, keep_shared=keep_shared, free_share=free_share)
    view = DictStore()
    view.keys = store.present  # lookups see exactly what the store kept
    lookup = _reference_lookup(layout_by_name(trace.header.layout), view, trace, junction_retention)
    tracker = SharedPrefixTracker()
    block = trace.header.hash_block_tokens
    decode = bool(ideal.decode_reads)
    hits: list[int] = []
    for request in trace.requests:
        hashes = request.hashes()
        tokens = request.prompt_tokens(block)
        result = lookup.lookup(tokens, hashes)
        hits.append(result.hit_length)
        store.touch(keys_the_load_reads_in_order(lookup, hashes, result))
        shared_blocks = tracker.observe_and_share(hashes)
        shared = {key for group in lookup.groups for chunk_hash in hashes[:shared_blocks]
                  for key in group.keys_for(bytes(chunk_hash))}
        chunks = build_prompt_chunks(lookup, hashes, block, _junctions(result))
        store.admit([key for chunk in build_save_keys(lookup, hashes, result.hit_length, chunks)
                     for key in chunk.keys], shared)
        if decode:
            store.touch(keys_the_load_reads_in_order(lookup, hashes, lookup.lookup(tokens, hashes)))
    return hits


@dataclass
class ModeRun:
    """What one mode's replay measured (before summarizing)."""

    accounts: list[RequestAccount]
    costs: LookupCosts
    keys_put: int = 0
    keys_pinned: int = 0
    keys_skipped: int = 0
    keys_retried: int = 0
    keys_removed: int = 0
    put_failures: int = 0
    put_failed_keys: int = 0
    lags_s: list[float] = field(default_factory=list)
    stretch_s: float = 0.0
    fleet: FleetSpec = SINGLE_ENGINE
    routing: str = "session"
    decode_accounts: list[RequestAccount] = field(default_factory=list)
    # Per prefill engine: [requests, hit tokens, prompt tokens].
    engine_counts: list[list[int]] = field(default_factory=list)
    removal_refused: int = 0  # keys evict asked the master to remove that it kept (leased)


@dataclass
class _Engine:
    """One connector of the fleet: its lookup over the shared store, its retention state."""

    lookup: Any
    counting: CountingStore
    shared_prefixes: SharedPrefixTracker | None = None
    eviction: Any = None


def _build_engine(layout: Layout, store: Any, mode: ModeSpec, trace: Trace, eviction: Any) -> _Engine:
    counting = CountingStore(store)
    lookup = build_lookup(layout, counting, mode.settings(), retention_interval=_retention_interval(trace))
    # The connector's per-prefix reuse estimate (retention `pin`, and `evict`, which leaves the
    # shared prefix alone): one per engine.
    tracker = SharedPrefixTracker() if mode.retention.pin or mode.retention.evict else None
    return _Engine(lookup, counting, tracker, eviction)


def replay_requests(trace: Trace, store: Any, mode: ModeSpec, ideal: IdealReplay, sizes: ValueSizes, *,
                    pacer: Pacer | None = None, pin_config: Any = None, eviction: Any = None,
                    new_eviction: Callable[[], Any] | None = None,
                    fleet: FleetSpec = SINGLE_ENGINE, routing: str = "session", routing_seed: int = 0,
                    before_request: Callable[[int], None] | None = None,
                    after_request: Callable[[int], None] | None = None,
                    clock: Callable[[], float] = time.perf_counter) -> ModeRun:
    """Replay every request: lookup in `mode` (counted), then upstream's save, on `store`.

    With a `fleet`, each request goes to a prefill engine (`routing`) that looks up and saves,
    then, if there are decode engines, to a decode engine that looks the prompt up (its hit
    against the ideal decode hit in `ideal`, which must then hold decode hits). Retention
    ``evict``: `eviction` for a single engine, or `new_eviction` building one per prefill engine
    (on the fleet's order, for a `fleet_evict` mode, each one a client of the same service).
    Decode engines report nothing, as the connector's (a consumer runs no save thread).
    """
    if fleet.decode and len(ideal.decode_hits) != len(trace.requests):
        raise ValueError("a fleet with decode engines needs the ideal replay's decode hits (decode=True)")
    layout = layout_by_name(trace.header.layout)
    prefill = [_build_engine(layout, store, mode, trace,
                             new_eviction() if new_eviction is not None else eviction)
               for _ in range(fleet.prefill)]
    decode = [_build_engine(layout, store, mode, trace, None) for _ in range(fleet.decode)]
    routers = (Router(routing, fleet.prefill, routing_seed), Router(routing, max(1, fleet.decode), routing_seed + 1))
    block = trace.header.hash_block_tokens
    run = ModeRun([], LookupCosts(), fleet=fleet, routing=routing,
                  engine_counts=[[0, 0, 0] for _ in prefill])
    for step, request in enumerate(trace.requests):
        if pacer is not None:
            pacer.wait(request.arrival_s)
        if before_request is not None:
            before_request(step)
        hashes = request.hashes()
        prompt_tokens = request.prompt_tokens(block)
        chosen = routers[0].pick(request.session)
        engine = prefill[chosen]
        lookup = engine.lookup
        engine.counting.reset()
        started = clock()
        result = lookup.lookup(prompt_tokens, hashes)
        elapsed = clock() - started
        run.costs.add(keys_leased=result.outcome.keys_leased, rpcs=engine.counting.rpcs,
                      latency_us=elapsed * 1e6)
        run.accounts.append(RequestAccount(prompt_tokens, ideal.hits[step], result.hit_length,
                                           ideal.ages[step]))
        counts = run.engine_counts[chosen]
        counts[0] += 1
        counts[1] += result.hit_length
        counts[2] += prompt_tokens
        # Evict learns what a hit loads (the save skips it).
        if engine.eviction is not None and result.hit_length:
            engine.eviction.saw_load(keys_the_load_reads_in_order(lookup, hashes, result))
        junctions = _junctions(result)
        chunks = build_save_keys(lookup, hashes, result.hit_length,
                                 build_prompt_chunks(lookup, hashes, block, junctions))
        shared = engine.shared_prefixes.observe_and_share(hashes) if engine.shared_prefixes is not None else 0
        plan = build_save_retention(lookup, hashes, block, chunks, mode.retention, junctions, shared)
        saved = apply_save(store, chunks, sizes, plan, pin_config,
                           retry=DEFAULT_PUT_RETRY if mode.retention.retry else None,
                           eviction=engine.eviction)
        run.keys_put += saved.keys_put
        run.keys_pinned += saved.keys_pinned
        run.keys_skipped += saved.keys_skipped
        run.keys_retried += saved.keys_retried
        run.put_failures += saved.put_failures
        run.put_failed_keys += saved.keys_failed
        if decode:
            reader = decode[routers[1].pick(request.session)].lookup
            loaded = reader.lookup(prompt_tokens, hashes)
            run.decode_accounts.append(RequestAccount(prompt_tokens, ideal.decode_hits[step],
                                                      loaded.hit_length, None))
        if after_request is not None:
            after_request(step)
    evictions = {id(e.eviction): e.eviction for e in prefill if e.eviction is not None}.values()
    for eviction in evictions:  # a fleet order's clients: what they queued is sent, then they stop
        eviction.order.close()
    run.keys_removed = sum(e.removed_keys for e in evictions)
    run.removal_refused = sum(e.refused_keys for e in evictions)
    if pacer is not None:
        run.lags_s, run.stretch_s = pacer.lags_s, pacer.stretch_s
    return run


def build_fleet_result(run: ModeRun) -> dict[str, Any]:
    """The fleet's own figures: engines, routing, per-engine hit rates, the decode engines' hits."""
    record: dict[str, Any] = {
        "engines": run.fleet.label, "routing": run.routing,
        "engine_hit_rates": [hits / tokens if tokens else 0.0 for _, hits, tokens in run.engine_counts],
        "engine_requests": [requests for requests, _, _ in run.engine_counts],
        "removal_refused": run.removal_refused,
    }
    if run.decode_accounts:
        prompt = sum(a.prompt_tokens for a in run.decode_accounts)
        record.update(decode_hit_rate=sum(a.hit for a in run.decode_accounts) / prompt,
                      decode_ideal_rate=sum(a.ideal_hit for a in run.decode_accounts) / prompt)
    return record


def build_mode_result(run: ModeRun) -> dict[str, Any]:
    """The JSON record of one mode's run (what the report reads)."""
    summary = summarize_hits(run.accounts)
    lags = run.lags_s or [0.0]
    return {
        "hit_rate": summary.hit_rate, "ideal_rate": summary.ideal_rate,
        "hit_tokens": summary.hit_tokens, "prompt_tokens": summary.prompt_tokens,
        "ideal_tokens": summary.ideal_tokens, "requests": summary.requests,
        "missed_tokens_by_age": summary.missed_by_age, "missed_points_by_age": summary.missed_points(),
        "above_ideal": summary.above_ideal,
        **run.costs.summary(),
        "keys_put": run.keys_put, "keys_pinned": run.keys_pinned, "keys_skipped": run.keys_skipped,
        "keys_retried": run.keys_retried, "keys_removed": run.keys_removed,
        "put_failures": run.put_failures, "put_failed_keys": run.put_failed_keys,
        "lag_mean_s": sum(lags) / len(lags), "lag_max_s": max(lags), "stretch_s": run.stretch_s,
        "fleet": build_fleet_result(run),
    }


MASTER_COUNTERS = ("master_evicted_key_count", "master_put_start_alloc_failures_total",
                   "master_successful_evictions_total", "master_key_count", "master_allocated_bytes")


def build_replay_eviction(bed: MooncakeBed, watermark: float, fleet_order_url: str | None = None) -> Any:
    """Retention ``evict`` as the engine runs it, reading this bed's master metrics.

    Its watermark is the master's (what the operator renders from the policy's master settings);
    with `fleet_order_url`, its order is the fleet order service's (a client of its own).
    """
    from moonlease_connector.adapters.fleet_order_client import FleetOrderClient
    from moonlease_connector.adapters.store_eviction import StoreEviction
    from moonlease_connector.core.store_room import StoreUsage

    def usage() -> StoreUsage | None:
        values = bed.metrics()
        if "master_total_capacity_bytes" not in values:
            return None
        return StoreUsage(values.get("master_allocated_bytes", 0.0), values["master_total_capacity_bytes"])

    order = FleetOrderClient(fleet_order_url) if fleet_order_url else None
    return StoreEviction(bed.client, usage, watermark, order=order)


def run_mode(trace: Trace, mode: ModeSpec, ideal: IdealReplay, settings: ReplaySettings, *,
             segment_mib: int, ttl_ms: int, scale: float, log_dir: Path,
             progress: Any | None = None) -> dict[str, Any]:
    """One mode's replay of the trace against a fresh real master and store pool."""
    from moonlease_connector.adapters.mooncake_store import build_soft_pin_config

    bed = MooncakeBed(segment_mib=segment_mib, lease_ttl_ms=ttl_ms, watermark=settings.watermark,
                      eviction_ratio=settings.eviction_ratio, log_dir=log_dir,
                      soft_pin_ttl_ms=max(1, round(settings.soft_pin_ttl_s * 1000 * scale)))
    # The fleet order service as the chart runs it: its own process beside the master.
    fleet_order = FleetOrderProcess(log_dir=log_dir).start() if mode.fleet_evict else None
    try:
        pin_config = build_soft_pin_config() if mode.retention.pin else None
        url = fleet_order.url if fleet_order is not None else None
        new_eviction = (lambda: build_replay_eviction(bed, settings.watermark, url)) if mode.retention.evict else None
        run = replay_requests(trace, bed.client, mode, ideal, settings.sizes, pacer=Pacer(scale),
                              pin_config=pin_config, new_eviction=new_eviction, fleet=settings.fleet,
                              routing=settings.routing, routing_seed=settings.routing_seed,
                              after_request=(lambda _: progress.update(1)) if progress else None)
        metrics = bed.metrics()
        universe = sorted(ideal.key_sizes)
        survival = summarize_survival(universe, ideal.loaded_keys(), fetch_presence(bed.client, universe))
    finally:
        bed.close()
        if fleet_order is not None:
            fleet_order.stop()
    return {**build_mode_result(run), "master": {name: metrics.get(name, 0.0) for name in MASTER_COUNTERS},
            "survival": survival}


def build_repeat_summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Repeated runs of one cell: the mean of every number, and each run's hit rate.

    Pure. One run comes back as it is, plus `hit_rate_runs` with its single value.
    """
    def mean(values: list[Any]) -> Any:
        if isinstance(values[0], dict):
            return {key: mean([v[key] for v in values]) for key in values[0]}
        if len(values) == 1 or isinstance(values[0], str):
            return values[0]
        if isinstance(values[0], list):
            return [mean(list(column)) for column in zip(*values, strict=True)]
        return sum(values) / len(values)

    return {**mean(list(runs)), "hit_rate_runs": [run["hit_rate"] for run in runs]}


def segment_mib_for(stored_bytes: int, capacity: float, watermark: float) -> int:
    """Segment whose watermark holds `capacity` of the trace's stored bytes (at least 16 MiB)."""
    return max(MIN_SEGMENT_MIB, math.ceil(stored_bytes * capacity / watermark / (1 << 20)))


def run_trace(trace: Trace, settings: ReplaySettings, log_dir: Path,
              progress: Any | None = None) -> dict[str, Any]:
    """Every applicable mode at every capacity, plus the ideal and Belady, for one trace."""
    layout = layout_by_name(trace.header.layout)
    modes = [MODES[name] for name in settings.modes if MODES[name].applies_to(layout, trace.header.retention)]
    decode = settings.fleet.decode > 0
    ideals = {flag: build_ideal_replay(trace, junction_retention=flag, sizes=settings.sizes, decode=decode)
              # The plain ideal always: the report's Belady and capacities are over what upstream stores.
              for flag in sorted({False, *(m.junction_retention for m in modes)})}
    base = ideals[False] if False in ideals else next(iter(ideals.values()))
    scale = settings.wall_s_per_run / trace.span_s if trace.span_s else 1.0
    ttl_ms = max(1, round(settings.lease_ttl_s * 1000 * scale))
    prompt_tokens = sum(r.prompt_tokens(trace.header.hash_block_tokens) for r in trace.requests)
    capacities = []
    for capacity in settings.capacities:
        segment_mib = segment_mib_for(base.stored_bytes, capacity, settings.watermark)
        capacity_bytes = int((segment_mib << 20) * settings.watermark)
        belady, belady_decode = {}, {}
        for flag, ideal in ideals.items():
            hits = build_belady_replay(trace, ideal, capacity_bytes, junction_retention=flag)
            belady["junctions" if flag else "plain"] = sum(hits.prefill) / prompt_tokens
            if decode:
                belady_decode["junctions" if flag else "plain"] = sum(hits.decode) / prompt_tokens
        results = {}
        for mode in modes:
            runs = []
            for repeat in range(settings.repeats):
                if progress is not None:
                    progress.set_postfix_str(f"{trace.header.workload} {capacity:g} {mode.name}")
                run_dir = log_dir / f"{trace.header.workload}-{capacity:g}-{mode.name}-{repeat}".replace("+", "_")
                runs.append(run_mode(trace, mode, ideals[mode.junction_retention], settings,
                                     segment_mib=segment_mib, ttl_ms=ttl_ms, scale=scale,
                                     log_dir=run_dir, progress=progress))
            results[mode.name] = build_repeat_summary(runs)
        capacities.append({"capacity": capacity, "segment_mib": segment_mib,
                           "fits": capacity_bytes / base.stored_bytes,
                           "capacity_bytes": capacity_bytes, "belady": belady,
                           **({"belady_decode": belady_decode} if decode else {}), "modes": results})
    return {
        "workload": trace.header.workload, "layout": trace.header.layout,
        "retention": trace.header.retention, "seed": trace.header.seed, "knobs": trace.header.knobs,
        "requests": len(trace.requests), "span_s": trace.span_s, "prompt_tokens": prompt_tokens,
        "kinds": {kind: sum(1 for r in trace.requests if r.kind == kind)
                  for kind in ("new", "turn", "resume", "branch", "long", "resend")},
        "stored_bytes": base.stored_bytes, "time_scale": scale, "lease_ttl_ms": ttl_ms,
        "ideal_rate": {("junctions" if flag else "plain"): sum(i.hits) / prompt_tokens
                       for flag, i in ideals.items()},
        "modes": [m.name for m in modes], "capacities": capacities,
        "engines": settings.fleet.label, "routing": settings.routing,
        **({"ideal_decode_rate": {("junctions" if flag else "plain"): sum(i.decode_hits) / prompt_tokens
                                  for flag, i in ideals.items()}} if decode else {}),
    }


def count_runs(traces: Sequence[Trace], settings: ReplaySettings) -> int:
    """Requests the progress bar will count."""
    total = 0
    for trace in traces:
        layout = layout_by_name(trace.header.layout)
        modes = [n for n in settings.modes if MODES[n].applies_to(layout, trace.header.retention)]
        total += len(modes) * len(settings.capacities) * len(trace.requests) * settings.repeats
    return total


def settings_record(settings: ReplaySettings) -> dict[str, Any]:
    return asdict(settings)
