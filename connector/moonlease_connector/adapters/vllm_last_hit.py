"""vLLM binding of last-hit-only recurrent lookup (seed 000); the decisions are in core.last_hit.

I/O adapter, called by `MoonleaseStoreWorker` when `mooncake_lease_mode` is lastHitOnly: it
gathers vLLM's inputs (which groups are recurrent, their chunk hashes, the lookup mask, the
coordinator's hit rule) and makes its store calls — upstream's leasing existence check for the
KV keys, then LastHitOnly probes for the recurrent keys of the legal checkpoints (the last one
alone first, the rest only when it is incomplete).
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import MooncakeLookupResult
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, MambaManager
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from moonlease_connector.adapters.vllm_specs import unwrap_spec
from moonlease_settings.config import ConnectorConfigError
from moonlease_settings.lease_modes import LEASE_MODE_KEY, LeaseMode
from moonlease_connector.core.last_hit import (
    CheckpointCandidates,
    HitPass,
    HitPlan,
    ProbeContract,
    build_checkpoint_candidates,
    hit_known_from_selection,
    kv_reach,
    plan_checkpoint_probes,
    plan_hit_passes,
    plan_one_candidate_follow_up,
    whole_block_bound,
)
from moonlease_settings.lease_modes import LAST_HIT_ONLY_POLICY
from moonlease_connector.core.last_hit_layout import (
    GroupServing,
    ManagerKind,
    last_hit_only_layout_problems,
)
from moonlease_connector.core.lookup import (
    CandidateSet,
    GroupNamespaces,
    LookupOutcome,
    MissReason,
    TailKey,
    Unit,
    build_candidates,
    build_tail_keys,
    leading_present_run,
    miss_reason_of,
    present_units,
)

LongestHit = Callable[[frozenset[Unit], int], int]
#: The lookup's reply, junctions included: (hit, tails, outcome, present units).
Respond = Callable[[int, tuple[TailKey, ...], LookupOutcome, frozenset[Unit]],
                   tuple[MooncakeLookupResult, LookupOutcome]]
logger = logging.getLogger("vllm.moonlease.connector.last_hit")


def serving_of(group_id: int, group: Any) -> GroupServing:
    """How vLLM serves one KV-cache group: the manager its own spec registry picks (role
    included), which is the map vLLM's hit rule dispatches through."""
    spec = unwrap_spec(group.kv_cache_spec)
    role = getattr(group, "role", None)
    manager = KVCacheSpecRegistry.get_manager_class(spec, role) if role is not None \
        else KVCacheSpecRegistry.get_manager_class(spec)
    if manager is None:
        kind = ManagerKind.UNREGISTERED
    elif manager is FullAttentionManager:
        kind = ManagerKind.FULL_ATTENTION
    elif manager is MambaManager:
        kind = ManagerKind.RECURRENT
    else:
        kind = ManagerKind.OTHER
    return GroupServing(group_id, type(spec).__name__, None if manager is None else manager.__name__,
                        kind, spec.block_size, prefix_cacheable=spec.prefix_cacheable,
                        mamba_cache_mode=getattr(spec, "mamba_cache_mode", None)
                        if kind is ManagerKind.RECURRENT else None)


def check_last_hit_only_layout(kv_cache_groups: Sequence[Any], extra_config: dict[str, Any],
                               mode: LeaseMode = LeaseMode.LAST_HIT_ONLY) -> None:
    """Start-up gate of a mode that needs a hybrid model (decision in core.last_hit_layout):
    refuse with every reason at once."""
    problems = last_hit_only_layout_problems(
        [serving_of(group_id, group) for group_id, group in enumerate(kv_cache_groups)],
        enable_group_semantics=str(extra_config.get("enable_group_semantics", "False")
                                   ).strip().lower() == "true")
    if problems:
        raise ConnectorConfigError(f"{LEASE_MODE_KEY}={mode.value} cannot run on this model: "
                                   + "; ".join(problems) + ". Choose another lease mode for this model.")


def refuse_unservable_mode(settings: Any, vllm_config: Any, kv_cache_groups: Sequence[Any]) -> None:
    """The layout gate of `settings`' lease mode, for every object that runs it (the worker, the
    scheduler, the connector through them): built for a model its mode cannot serve, it refuses
    at construction, before connecting anywhere, instead of missing on every lookup.
    Only modes that need a hybrid model depend on the layout (their strategy says so)."""
    if not settings.strategy.needs_hybrid_model:
        return
    transfer = vllm_config.kv_transfer_config
    check_last_hit_only_layout(kv_cache_groups,
                               dict(transfer.kv_connector_extra_config or {}) if transfer else {},
                               settings.lease_mode)


def rule_reads_off_existence(coord: Any) -> bool:
    """Whether vLLM's hit rule over this coordinator is the whole-block rule that
    `core.last_hit.whole_block_bound` reads off the existence answers: no partial-hash hits,
    no EAGLE group, every spec group served by `FullAttentionManager` or `MambaManager`.
    Elsewhere the bound comes from the coordinator itself."""
    return (not coord.enable_partial_hash_hits and not coord.use_eagle and not coord.eagle_group_ids
            and all(group.manager_cls in (FullAttentionManager, MambaManager) and not group.use_eagle
                    for group in coord.attention_groups))


def _probe_final_state(worker: Any, recurrent: Sequence[GroupNamespaces], chunk_hash: bytes
                       ) -> tuple[bool | None, int]:
    """Whether every recurrent key of the state at num_tokens exists, asked without a lease
    (`batch_probe_key(..., "none")`); None when the probe failed. Also the number of keys asked."""
    keys = [key for group in recurrent for key in group.keys_for(chunk_hash)]
    answers = worker.store_calls.probe(keys, operation="lookup_last_hit_final_probe")
    if answers is None:
        return None, len(keys)
    return all(answer == 1 for answer in answers), len(keys)


def _one_candidate_lookup(worker: Any, block_hashes: Sequence[Any], kv_candidates: CandidateSet,
                          kv_chunk_hashes: dict[int, list[bytes]], block_sizes: dict[int, int],
                          recurrent: Sequence[GroupNamespaces], positions: Sequence[int],
                          limit: int, final_position: int | None,
                          state_hash: Callable[[int], bytes], respond: Respond
                          ) -> tuple[MooncakeLookupResult, LookupOutcome] | tuple[int, frozenset[int]]:
    """The common case in one store call (whole-block layouts, see core.last_hit).

    One LastHitOnly candidate holds the KV keys and the recurrent keys of the checkpoint a
    fully stored prompt resumes from: the store leases it only when every key is present,
    which is exactly what the exact steps would lease, and then the hit is that checkpoint.
    Otherwise nothing was leased; with a per-key answer (Mooncake 0.3.14's contract) the KV
    evidence is known, and `core.last_hit.plan_one_candidate_follow_up` says whether one more
    such call (the KV keys found present + the checkpoint they allow) is worth making.
    Returns the lookup's answer, or (keys asked, checkpoints known incomplete) for the exact
    steps to go on with.
    """
    alignment = worker.coord.lcm_block_size
    reach_if_all = min(len(hashes) * block_sizes[gid] for gid, hashes in kv_chunk_hashes.items())
    speculated = whole_block_bound(positions, min(limit, reach_if_all), alignment, final_position)
    if speculated <= 0:
        return 0, frozenset()
    store_calls = worker.store_calls
    asked = 0

    def ask(kv_keys: Sequence[str], checkpoint: CheckpointCandidates) -> list[int] | None:
        nonlocal asked
        keys = [*kv_keys, *checkpoint.keys]
        asked += len(keys)
        return store_calls.probe(keys, policy=LAST_HIT_ONLY_POLICY, candidate_size=len(keys),
                                 operation="lookup_last_hit_probe")

    def hit(bound: int, kv_present: frozenset[Unit], checkpoint: CheckpointCandidates,
            leased: int) -> tuple[MooncakeLookupResult, LookupOutcome]:
        # The store selected the bound itself: the hit is the bound (hit_known_from_selection).
        present = kv_present | frozenset(checkpoint.units[0])
        tails = build_tail_keys(worker.groups, block_hashes, worker.hash_block_size, bound,
                                lambda group_id, chunk_hash: (group_id, chunk_hash) in present)
        return respond(bound, tails, LookupOutcome(bound, None, 1, asked, leased), present)

    spec = build_checkpoint_candidates(recurrent, (speculated,), lambda _, position: state_hash(position))
    answers = ask(kv_candidates.keys, spec)
    if answers is None:
        return MooncakeLookupResult(0), LookupOutcome.miss(MissReason.STORE_ERROR, rounds=1,
                                                           keys_probed=asked)
    present_count = answers.count(1)
    if present_count == len(answers):
        return hit(speculated, frozenset(kv_candidates.units), spec, len(answers))
    if worker.probe_contract.contract is not ProbeContract.PER_KEY_EXISTENCE \
            or answers.count(0) + present_count != len(answers):
        return asked, frozenset()  # no per-key evidence to go on: the exact steps
    kv_count = len(kv_candidates.keys)
    kv_answers = answers[:kv_count]
    # One KV group whose stored blocks are a leading run (the common answer): the present
    # units, their keys and the reach are slices of what this call was built from.
    run = leading_present_run(kv_candidates, kv_answers) if len(kv_chunk_hashes) == 1 else None
    present_kv_keys: Sequence[str] | None = None
    if run is None:
        kv_present = present_units(kv_candidates, kv_answers)
        reach = kv_reach(kv_chunk_hashes, block_sizes, kv_present)
    else:
        kv_present = frozenset(kv_candidates.units[:run])
        reach = run * block_sizes[next(iter(kv_chunk_hashes))]
        present_kv_keys = kv_candidates.keys[:run]
    if not kv_present:
        return respond(0, (), LookupOutcome.miss(MissReason.NOT_FOUND, rounds=1, keys_probed=asked),
                       kv_present)
    bound = whole_block_bound(positions, min(limit, reach), alignment, final_position)
    follow_up = plan_one_candidate_follow_up(
        bound, speculated, answers[kv_count:].count(1) == len(answers) - kv_count)
    if follow_up.confirm is None:
        return asked, follow_up.known_incomplete
    checkpoint = spec if follow_up.confirm == speculated else build_checkpoint_candidates(
        recurrent, (follow_up.confirm,), lambda _, position: state_hash(position))
    if present_kv_keys is None:
        present_kv_keys = list(itertools.compress(kv_candidates.keys, map((1).__eq__, kv_answers)))
    confirmed = ask(present_kv_keys, checkpoint)
    if confirmed is None:
        return MooncakeLookupResult(0), LookupOutcome.miss(MissReason.STORE_ERROR, rounds=1,
                                                           keys_probed=asked)
    if confirmed.count(1) == len(confirmed):
        return hit(follow_up.confirm, kv_present, checkpoint, len(confirmed))
    state_answers = confirmed[len(present_kv_keys):]
    if all(answer in (0, 1) for answer in confirmed) and state_answers.count(1) != len(state_answers):
        return asked, follow_up.known_incomplete | {follow_up.confirm}
    return asked, follow_up.known_incomplete


def lookup_last_hit_only(worker: Any, num_tokens: int, lookup_length: int, block_hashes: Sequence[Any],
                         groups: Sequence[GroupNamespaces], longest_hit: LongestHit
                         ) -> tuple[MooncakeLookupResult, LookupOutcome]:
    """KV keys as upstream; recurrent keys through LastHitOnly probes of the legal checkpoints.

    `longest_hit(present, length)` is vLLM's hit rule (the coordinator's longest hit) at one
    length; which length(s) upstream runs it at is planned by `core.last_hit.plan_hit_passes`.
    On whole-block layouts without EAGLE the common case is one store call
    (`_one_candidate_lookup`); otherwise, and when that call does not prove the hit, the exact
    steps run: the KV keys through upstream's leasing existence check, then the checkpoints
    probed last-first (`core.last_hit.plan_checkpoint_probes`): one small probe when the last
    legal checkpoint is complete, a second over the rest otherwise. A lease-free probe of the
    state at num_tokens is made only when the answer depends on it (partial-hash hits whose
    prompt ends on a stored state).
    """
    coord = worker.coord
    hash_block_size = worker.hash_block_size
    kv_groups = [g for g in groups if not g.is_recurrent]
    recurrent = [g for g in groups if g.is_recurrent]

    def respond(hit: int, tails: tuple[TailKey, ...], outcome: LookupOutcome,
                present: frozenset[Unit]) -> tuple[MooncakeLookupResult, LookupOutcome]:
        """Every answer after the KV lookup carries the store junction (seed 004), if on."""
        junctions = worker.store_junctions(num_tokens, block_hashes, max(hit, 0), present)
        return worker._respond(hit, tails, junctions, outcome)

    # Where a recurrent state can be keyed: at every hash block with partial-hash hits (upstream
    # probes every hash unit then), else at the recurrent group's block boundaries. A state is
    # keyed by the hash of the prefix it ends, which is the chunk hash at a block boundary.
    fine_grained = coord.enable_partial_hash_hits
    step = hash_block_size if fine_grained else recurrent[0].block_size
    limit = min(lookup_length, len(block_hashes) * hash_block_size)
    recurrent_ids = [g.group_id for g in recurrent]

    def state_hash(position: int) -> bytes:
        return bytes(block_hashes[position // hash_block_size - 1])

    masks = None if fine_grained else worker.lookup_masks(lookup_length)  # once per length
    recurrent_masks: list[Any] = [] if masks is None else \
        [masks[g] for g in recurrent_ids if masks[g] is not None]
    # Every KV chunk is asked about, in order (no lookup mask): no hit reaches past their run.
    reach_known = masks is not None and all(masks[g.group_id] is None for g in kv_groups)
    kv_chunk_hashes = worker.lookup_chunk_hashes(kv_groups, lookup_length, block_hashes, masks) \
        if kv_groups else {}
    kv_candidates = build_candidates(kv_groups, kv_chunk_hashes) if kv_groups else None
    block_sizes = {g.group_id: g.block_size for g in kv_groups}

    probed = 0
    known_incomplete: frozenset[int] = frozenset()
    if kv_candidates is not None and kv_candidates.keys and reach_known \
            and worker.rule_reads_off_existence:
        every_possible = worker.legal_positions(step, limit, lookup_length, recurrent_masks)
        final_possible = num_tokens if every_possible and every_possible[-1] == num_tokens else None
        early = _one_candidate_lookup(worker, block_hashes, kv_candidates, kv_chunk_hashes,
                                      block_sizes, recurrent, every_possible, limit,
                                      final_possible, state_hash, respond)
        if isinstance(early[0], MooncakeLookupResult):
            return early
        probed, known_incomplete = early

    kv_present: frozenset[Unit] = frozenset()
    kv_leased = kv_asked = 0
    kv_miss_reason = MissReason.NOT_FOUND
    if kv_candidates is not None and kv_candidates.keys:
        answers = worker.store_calls.exists_with_lease(kv_candidates.keys)
        kv_asked = len(kv_candidates)
        if answers is None:
            return MooncakeLookupResult(0), LookupOutcome.miss(
                MissReason.STORE_ERROR, rounds=1, keys_probed=probed + kv_asked)
        kv_present = present_units(kv_candidates, answers)
        kv_miss_reason = miss_reason_of(answers)
        kv_leased = answers.count(1)

    if reach_known and kv_groups:
        limit = min(limit, kv_reach(kv_chunk_hashes, block_sizes, kv_present))

    # The states a lookup may ask about, and among them the one at num_tokens (if any): only it
    # can switch upstream to the final-token recompute pass (core.last_hit.plan_hit_passes).
    every_position = worker.legal_positions(step, limit, lookup_length, recurrent_masks)
    final_position = num_tokens if every_position and every_position[-1] == num_tokens else None

    def longest_with_every_state(length: int, with_final: bool) -> int:
        states = frozenset([(gid, state_hash(position)) for position in every_position
                            if with_final or position != final_position for gid in recurrent_ids])
        return longest_hit(kv_present | states, length)

    if reach_known and worker.rule_reads_off_existence:
        # The bound without a run of the rule (the plan `plan_hit_passes` makes here: one pass,
        # without the final state), read off the KV answers.
        plan = HitPlan(HitPass(lookup_length, whole_block_bound(
            every_position, limit, coord.lcm_block_size, final_position)))
    else:
        plan = plan_hit_passes(num_tokens, lookup_length, coord.align_lookup_length(num_tokens - 1),
                               longest_with_every_state, final_state_can_matter=fine_grained)
    probed += kv_asked
    final_present: bool | None = None
    if plan.with_final is not None and plan.with_final.bound != plan.without_final.bound:
        # The two passes ask about different checkpoints: learn first, without a lease,
        # whether the state at num_tokens exists.
        final_present, asked = _probe_final_state(worker, recurrent, state_hash(num_tokens))
        probed += asked
        if final_present is None:
            return MooncakeLookupResult(0), LookupOutcome.miss(
                MissReason.STORE_ERROR, rounds=1, keys_probed=probed, keys_leased=kv_leased)
    hit_pass = plan.pass_for(bool(final_present))
    positions = every_position[:bisect.bisect_right(every_position, hit_pass.bound)]
    if not positions:  # the KV evidence allows no checkpoint (or the store answered errors)
        return respond(0, (), LookupOutcome.miss(
            kv_miss_reason, rounds=1, keys_probed=probed, keys_leased=kv_leased), kv_present)
    selected: tuple[int, CheckpointCandidates] | None = None
    for probe_positions in plan_checkpoint_probes(positions, known_incomplete):
        candidates = build_checkpoint_candidates(recurrent, probe_positions,
                                                 lambda group, position: state_hash(position))
        answers = worker.store_calls.probe(candidates.keys, policy=LAST_HIT_ONLY_POLICY,
                                           candidate_size=candidates.candidate_size,
                                           operation="lookup_last_hit_probe")
        selection = worker.probe_contract.read(candidates, answers)
        probed += len(candidates.keys)
        if not selection.valid:
            logger.error("LastHitOnly probe answer rejected (%s); reporting a miss", selection.problem)
            return MooncakeLookupResult(0), LookupOutcome.miss(
                MissReason.STORE_ERROR, rounds=1, keys_probed=probed, keys_leased=kv_leased)
        if selection.index is not None:
            selected = (selection.index, candidates)
            break
    if selected is None:
        return respond(0, (), LookupOutcome.miss(
            MissReason.NOT_FOUND, rounds=1, keys_probed=probed, keys_leased=kv_leased), kv_present)

    index, candidates = selected
    present = kv_present | frozenset(candidates.units[index])

    def hit_of(chosen: HitPass) -> int:
        return longest_hit(present, chosen.length) if chosen.length > 0 else 0

    hit = hit_known_from_selection(hit_pass, candidates.positions[index],
                                   final_state_can_matter=fine_grained)
    if hit is None:
        hit = hit_of(hit_pass)  # the without-final pass unless the final state was asked about
        if final_present is None and plan.with_final is not None and hit_of(plan.with_final) != hit:
            # Same checkpoints, different answers: only the state at num_tokens decides.
            final_present, asked = _probe_final_state(worker, recurrent, state_hash(num_tokens))
            probed += asked
            if final_present is None:
                return MooncakeLookupResult(0), LookupOutcome.miss(
                    MissReason.STORE_ERROR, rounds=1, keys_probed=probed, keys_leased=kv_leased)
            hit = hit_of(plan.pass_for(final_present))
    leased = kv_leased + candidates.candidate_size
    if hit <= 0:
        return respond(0, (), LookupOutcome.miss(
            MissReason.NOT_FOUND, rounds=1, keys_probed=probed, keys_leased=leased), present)
    tails = build_tail_keys(groups, block_hashes, hash_block_size, hit,
                            lambda group_id, chunk_hash: (group_id, chunk_hash) in present)
    return respond(hit, tails, LookupOutcome(hit, None, 1, probed, leased), present)
