"""vLLM binding of last-hit-only recurrent lookup (seed 000); the decisions are in core.last_hit.

I/O adapter, called by `MoonleaseStoreWorker` when `mooncake_kda_last_hit_only` is on: it
gathers vLLM's inputs (which groups are recurrent, their chunk hashes, the lookup mask, the
coordinator's hit rule) and makes two store calls — upstream's leasing existence check for the
KV keys, and one LastHitOnly probe for the recurrent keys of the legal checkpoints.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import MooncakeLookupResult
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

from moonlease_connector.adapters.vllm_specs import unwrap_spec
from moonlease_connector.config import ConnectorConfigError
from moonlease_connector.core.last_hit import (
    LAST_HIT_ONLY_POLICY,
    build_checkpoint_candidates,
    contract_for,
    legal_checkpoints,
    select_checkpoint,
)
from moonlease_connector.core.lookup import (
    GroupNamespaces,
    LookupOutcome,
    MissReason,
    TailKey,
    Unit,
    build_candidates,
    build_tail_keys,
    present_units,
)

HitRule = Callable[[frozenset[Unit]], int]
logger = logging.getLogger("vllm.moonlease.connector.last_hit")


def check_last_hit_only_layout(kv_cache_groups: Sequence[Any], extra_config: dict[str, Any]) -> None:
    """Start-up gate: full attention + align-mode Mamba only, and no shared group leases."""
    problems = []
    if str(extra_config.get("enable_group_semantics", "False")).strip().lower() == "true":
        problems.append("enable_group_semantics=true makes Mooncake lease a group's keys together "
                        "(shared group leases), which defeats leasing one checkpoint")
    recurrent_sizes = set()
    for group_id, group in enumerate(kv_cache_groups):
        spec = unwrap_spec(group.kv_cache_spec)
        if not spec.prefix_cacheable:
            continue
        if isinstance(spec, MambaSpec):
            if spec.mamba_cache_mode != "align":
                problems.append(f"group {group_id}: mamba_cache_mode={spec.mamba_cache_mode!r}, "
                                "needs 'align'")
            recurrent_sizes.add(spec.block_size)
        elif type(spec) is not FullAttentionSpec:
            problems.append(f"group {group_id}: {type(spec).__name__} is not supported "
                            "(full attention and align-mode Mamba only)")
    if not recurrent_sizes:
        problems.append("the model has no recurrent (Mamba) group: last-hit-only has nothing to select")
    if len(recurrent_sizes) > 1:
        problems.append(f"recurrent groups with different block sizes {sorted(recurrent_sizes)}")
    if problems:
        raise ConnectorConfigError("mooncake_kda_last_hit_only cannot run on this model: "
                                   + "; ".join(problems) + ". Turn the mode off for this model.")


def lookup_last_hit_only(worker: Any, num_tokens: int, lookup_length: int, block_hashes: Sequence[Any],
                         groups: Sequence[GroupNamespaces], hit_for: HitRule
                         ) -> tuple[MooncakeLookupResult, LookupOutcome]:
    """KV keys as upstream; recurrent keys through one LastHitOnly probe of the legal checkpoints."""
    hashes = [bytes(h) for h in block_hashes]
    kv_groups = [g for g in groups if not g.is_recurrent]
    recurrent = [g for g in groups if g.is_recurrent]

    kv_present: frozenset[Unit] = frozenset()
    kv_leased = kv_asked = 0
    if kv_groups:
        kv_candidates = build_candidates(kv_groups, worker.lookup_chunk_hashes(kv_groups, lookup_length,
                                                                               block_hashes))
        if kv_candidates.keys:
            answers = worker.store_calls.exists_with_lease(kv_candidates.keys)
            if answers is None:
                return MooncakeLookupResult(0), LookupOutcome.miss(
                    MissReason.STORE_ERROR, rounds=1, keys_probed=len(kv_candidates))
            kv_present = present_units(kv_candidates, answers)
            kv_leased = sum(1 for answer in answers if answer == 1)
            kv_asked = len(kv_candidates)

    def respond(hit: int, tails: tuple[TailKey, ...], outcome: LookupOutcome,
                present: frozenset[Unit]) -> tuple[MooncakeLookupResult, LookupOutcome]:
        """Every answer after the KV lookup carries the store junction (seed 004), if on."""
        junctions = worker.store_junctions(num_tokens, block_hashes, max(hit, 0), present)
        return worker._respond(hit, tails, junctions, outcome)

    # Where a recurrent state can be keyed: at every hash block with partial-hash hits (upstream
    # probes every hash unit then), else at the recurrent group's block boundaries. A state is
    # keyed by the hash of the prefix it ends, which is the chunk hash at a block boundary.
    fine_grained = worker.coord.enable_partial_hash_hits
    step = worker.hash_block_size if fine_grained else recurrent[0].block_size
    limit = min(lookup_length, len(hashes) * worker.hash_block_size)

    def state_hash(position: int) -> bytes:
        return hashes[position // worker.hash_block_size - 1]

    every_state = frozenset((g.group_id, state_hash(position)) for g in recurrent
                            for position in range(step, limit + 1, step))
    bound = hit_for(kv_present | every_state)
    masks = None if fine_grained else worker.coord.lookup_mask(lookup_length)

    def reachable(position: int) -> bool:
        if masks is None:
            return True
        chunk = position // step - 1
        return all(masks[g.group_id] is None or (chunk < len(masks[g.group_id]) and masks[g.group_id][chunk])
                   for g in recurrent)

    positions = legal_checkpoints(step, min(bound, limit), reachable)
    if not positions:
        return respond(0, (), LookupOutcome.miss(
            MissReason.NOT_FOUND, rounds=1, keys_probed=kv_asked, keys_leased=kv_leased), kv_present)
    candidates = build_checkpoint_candidates(recurrent, positions,
                                             lambda group, position: state_hash(position))
    answers = worker.store_calls.probe(candidates.keys, policy=LAST_HIT_ONLY_POLICY,
                                       candidate_size=candidates.candidate_size,
                                       operation="lookup_last_hit_probe")
    selection = select_checkpoint(candidates, answers,
                                  contract_for(worker.capabilities.mooncake_version))
    probed = kv_asked + len(candidates.keys)
    if not selection.valid:
        logger.error("LastHitOnly probe answer rejected (%s); reporting a miss", selection.problem)
        return MooncakeLookupResult(0), LookupOutcome.miss(
            MissReason.STORE_ERROR, rounds=1, keys_probed=probed, keys_leased=kv_leased)
    if selection.index is None:
        return respond(0, (), LookupOutcome.miss(
            MissReason.NOT_FOUND, rounds=1, keys_probed=probed, keys_leased=kv_leased), kv_present)

    present = kv_present | frozenset(candidates.units[selection.index])
    hit = hit_for(present)
    leased = kv_leased + candidates.candidate_size
    if hit <= 0:
        return respond(0, (), LookupOutcome.miss(
            MissReason.NOT_FOUND, rounds=1, keys_probed=probed, keys_leased=leased), present)
    tails = build_tail_keys(groups, hashes, worker.hash_block_size, hit,
                            lambda group_id, chunk_hash: (group_id, chunk_hash) in present)
    return respond(hit, tails, LookupOutcome(hit, None, 1, probed, leased), present)
