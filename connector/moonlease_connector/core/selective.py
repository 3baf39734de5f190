"""Selective lease (seed 002): probe without leasing, lease only what loading the hit reads.

Pure decision logic. The store calls and vLLM's hit rule come in as callables, so the whole
protocol — probe, hit, load set, lease, shorten on eviction, give up — is exercised in tests
with plain functions, and against the real master through the adapter.

Why: `batch_is_exist` leases every key it finds and moves it to the safe end of the eviction
order. Leasing every candidate of a prompt protects keys loading never reads (blocks outside a
sliding window, recurrent states before the resumed one), so they survive eviction while keys
later requests would load are evicted. Here a lookup probes with `batch_probe_key` (no lease),
computes the hit exactly as upstream would, and leases only that hit's load set.

Rules (seed 002):
- a hit is returned only when every key its load reads was leased in the final round;
- keys that vanished between probe and lease shorten the hit; the shorter hit may read keys the
  previous round did not lease (an earlier boundary state), so it is leased in a further round,
  at most `max_rounds` rounds in all; then the lookup reports a miss;
- an error result (a negative code) or a raising RPC is a miss, never a partial hit.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from moonlease_connector.core.lookup import (
    CandidateSet,
    GroupNamespaces,
    LookupOutcome,
    MissReason,
    TailKey,
    Unit,
    build_tail_keys,
    has_error_code,
    present_units,
)


@dataclass(frozen=True)
class LoadPlan:
    """What loading a hit of `hit_length` tokens reads, and under which tail keys.

    `keys[i]` is a store key the load reads and `key_units[i]` the unit it belongs to (parallel
    tuples: a lookup plans hundreds of keys, an object per key would cost more than the rest).
    """

    hit_length: int
    keys: tuple[str, ...]
    key_units: tuple[Unit, ...]
    tails: tuple[TailKey, ...]


def build_load_plan(groups: Sequence[GroupNamespaces], load_masks: Mapping[int, Sequence[bool]],
                    block_hashes: Sequence[bytes], hash_block_size: int, hit_length: int,
                    present: frozenset[Unit], *, candidates: CandidateSet | None = None,
                    chunk_aligned: frozenset[int] = frozenset()) -> LoadPlan:
    """The keys the receiver reads for a hit, across every rank namespace that loads.

    Mirrors how the load is keyed: per group, the chunks its load mask keeps (a sliding
    window keeps only its tail, a Mamba group only the last state), each keyed by the hash at
    the chunk's end; the chunk that ends the hit is keyed at the group's tail boundary.

    `chunk_aligned`: groups whose run in `candidates` (the probe's) is their chunks 0, 1, ...
    in order, chunk `c` keyed by the hash at its end — the same keys the load reads. A
    contiguous run of loaded chunks of such a group is a slice of the probe's keys and units
    (no key string built twice; the common case: a KV prefix, one recurrent state). Any other
    group, a gap in its loaded chunks, or a tail boundary off the chunk's end is built here,
    in one comprehension per group.
    """
    runs = {run.group_id: run for run in candidates.group_runs} \
        if candidates is not None and chunk_aligned else {}
    tails = build_tail_keys(groups, block_hashes, hash_block_size, hit_length,
                            lambda group_id, chunk_hash: (group_id, chunk_hash) in present)
    tail_by_group = {tail.group_id: tail.num_tokens for tail in tails}
    keys: list[str] = []
    key_units: list[Unit] = []
    for group in groups:
        mask = load_masks.get(group.group_id, ())
        block_size = group.block_size
        chunks = min(-(-hit_length // block_size), len(mask))
        loaded = list(itertools.compress(range(chunks), mask))
        if not loaded:
            continue
        scale = block_size // hash_block_size
        first, last = loaded[0], loaded[-1]
        ends_hit = (last + 1) * block_size >= hit_length  # keyed at the tail boundary
        boundary = tail_by_group.get(group.group_id, hit_length) if ends_hit else 0
        group_id = group.group_id
        run = runs.get(group_id) if group_id in chunk_aligned else None
        if run is not None and last - first + 1 == len(loaded) and last < run.units:
            assert candidates is not None  # runs come from it
            tail_in_run = not ends_hit or boundary == (last + 1) * block_size
            stop = last + 1 if tail_in_run else last
            width = run.namespaces
            keys.extend(candidates.keys[run.first_key + first * width:run.first_key + stop * width])
            units = candidates.units[run.first_unit + first:run.first_unit + stop]
            key_units.extend(units if width == 1 else [unit for unit in units for _ in range(width)])
            if tail_in_run:
                continue
            hashes = [bytes(block_hashes[boundary // hash_block_size - 1])]
        else:
            hashes = [bytes(block_hashes[(chunk + 1) * scale - 1])
                      for chunk in (loaded[:-1] if ends_hit else loaded)]
            if ends_hit:
                hashes.append(bytes(block_hashes[boundary // hash_block_size - 1]))
        heads = group._heads
        if len(heads) == 1:
            head = heads[0]
            keys.extend([head + chunk_hash.hex() for chunk_hash in hashes])
            key_units.extend([(group_id, chunk_hash) for chunk_hash in hashes])
        else:
            keys.extend([head + hex_hash for hex_hash in map(bytes.hex, hashes) for head in heads])
            key_units.extend([(group_id, chunk_hash) for chunk_hash in hashes for _ in heads])
    return LoadPlan(hit_length, tuple(keys), tuple(key_units), tails)


@dataclass(frozen=True)
class SelectiveResult:
    """The outcome of a selective lookup: the plan it leased (or none) and what it did."""

    plan: LoadPlan | None
    outcome: LookupOutcome
    #: The units the final decision saw as present (probe answers less what vanished before the
    #: lease); empty after a store error. Junctions are computed from it: they are not loaded,
    #: so they need no lease.
    present: frozenset[Unit] = frozenset()

    @property
    def hit_length(self) -> int:
        return self.plan.hit_length if self.plan is not None else 0


StoreAnswer = Callable[[Sequence[str]], "list[int] | None"]


def lease_selectively(candidates: CandidateSet, *, probe: StoreAnswer, lease: StoreAnswer,
                      hit_for: Callable[[frozenset[Unit]], int],
                      plan_for: Callable[[int, frozenset[Unit]], LoadPlan],
                      max_rounds: int) -> SelectiveResult:
    """Probe, decide the hit, lease its load set; shorten and retry while keys vanish.

    `probe` must not lease (`batch_probe_key(..., "none")`); `lease` must (`batch_is_exist`).
    Both return one answer per key, or None when the RPC failed.
    """
    if max_rounds < 1:
        raise ValueError("max_rounds must be at least 1")
    probed = len(candidates.keys)
    answers = probe(candidates.keys)
    if answers is None or has_error_code(answers):
        return SelectiveResult(None, LookupOutcome.miss(MissReason.STORE_ERROR, keys_probed=probed))
    present = present_units(candidates, answers)
    leased_total = 0
    for round_number in range(1, max_rounds + 1):
        hit = hit_for(present)
        if hit <= 0:
            reason = MissReason.NOT_FOUND if round_number == 1 else MissReason.LEASE_LOST
            return SelectiveResult(None, LookupOutcome.miss(
                reason, rounds=round_number - 1, keys_probed=probed, keys_leased=leased_total),
                present)
        plan = plan_for(hit, present)
        leased = lease(plan.keys)
        if leased is None or has_error_code(leased):
            return SelectiveResult(None, LookupOutcome.miss(
                MissReason.STORE_ERROR, rounds=round_number, keys_probed=probed,
                keys_leased=leased_total))  # no present set: the lease answer is unusable
        leased_now = leased.count(1)
        leased_total += leased_now
        vanished = set() if leased_now == len(leased) == len(plan.key_units) else \
            {unit for unit, answer in zip(plan.key_units, leased, strict=True) if answer != 1}
        if not vanished:
            return SelectiveResult(plan, LookupOutcome(hit, None, round_number, probed, leased_total),
                                   present)
        present = present - vanished
    return SelectiveResult(None, LookupOutcome.miss(
        MissReason.LEASE_LOST, rounds=max_rounds, keys_probed=probed, keys_leased=leased_total),
        present)
