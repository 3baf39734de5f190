"""vLLM worker binding: upstream's MooncakeStoreWorker with Moonlease's lookup and save guard.

I/O adapter. Everything it decides comes from `moonlease_connector.core`; this module gathers
vLLM's inputs (key namespaces, chunk hashes, lookup masks, the coordinator's hit rule), makes
the store calls through `StoreCalls`, and hands results back in upstream's types.

Two deliberate differences from upstream in the default mode, both safety fixes:
- the lookup never raises (upstream's lookup server thread dies on an unexpected exception and
  every later lookup hangs); anything unexpected is logged and reported as a miss;
- `wait_for_save` publishes nothing from a step whose forward pass raised (upstream runs it in
  a `finally` and stores that step's blocks, so garbage KV reaches the shared store: NOTES §2).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (
    ExternalCachedBlockPool,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    MooncakeLookupResult,
    MooncakeStoreConnectorMetadata,
    TailKeyBoundary,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import MooncakeStoreWorker
from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec, UniformTypeKVCacheSpecs

from moonlease_connector.adapters.mooncake_store import StoreCalls, detect_capabilities
from moonlease_connector.adapters.vllm_metrics import MoonleaseConnectorStats
from moonlease_connector.config import ConnectorConfigError, LeaseMode, MoonleaseConnectorConfig
from moonlease_connector.core.capabilities import missing_capability
from moonlease_connector.core.lookup import (
    GroupNamespaces,
    LookupOutcome,
    MissReason,
    build_candidates,
    build_tail_keys,
    present_units,
    resolve_hit,
)
from moonlease_connector.core.selective import LoadPlan, build_load_plan, lease_selectively

logger = logging.getLogger("vllm.moonlease.connector.worker")


def _is_recurrent(spec: Any) -> bool:
    if isinstance(spec, UniformTypeKVCacheSpecs):
        spec = next(iter(spec.kv_cache_specs.values()))
    return isinstance(spec, MambaSpec)


class MoonleaseStoreWorker(MooncakeStoreWorker):
    """Upstream's worker; lookups go through Moonlease's core, saves skip failed steps."""

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                 config: MoonleaseConnectorConfig) -> None:
        self.moonlease_config = config
        super().__init__(vllm_config, kv_cache_config)
        # Upstream created a plain stats object; ours carries lookup outcomes too.
        self.kv_connector_stats = MoonleaseConnectorStats()
        self.store_calls = StoreCalls(self.store, self._record_kv_connector_operation)
        self.capabilities = detect_capabilities(self.store)
        logger.info("Mooncake client %s: batch_probe_key=%s, probe policies=%s; lease mode %s",
                    self.capabilities.mooncake_version, self.capabilities.batch_probe_key,
                    ",".join(self.capabilities.probe_policies) or "-", config.lease_mode.value)
        with self._kv_connector_stats_lock:
            self.kv_connector_stats.record_capability(self.capabilities, config.lease_mode.value)
        self._check_mode_requirements()

    def _check_mode_requirements(self) -> None:
        """Refuse to start in a mode the installed Mooncake client cannot serve."""
        problem = missing_capability(self.moonlease_config.lease_mode, self.capabilities)
        if problem is not None:
            self.close()
            raise ConnectorConfigError(problem)

    def get_kv_connector_stats(self) -> MoonleaseConnectorStats | None:
        with self._kv_connector_stats_lock:
            if self.kv_connector_stats.is_empty():
                return None
            stats, self.kv_connector_stats = self.kv_connector_stats, MoonleaseConnectorStats()
            return stats

    # ----------------------------------------------------------------- lookup

    def store_groups(self) -> list[GroupNamespaces]:
        """The prefix-cacheable groups with the rank namespaces a load reads."""
        return [
            GroupNamespaces(group_id, db.block_size, tuple(self._lookup_key_prefixes[group_id]),
                            is_recurrent=_is_recurrent(self._kv_cache_groups[group_id].kv_cache_spec))
            for group_id, db in enumerate(self.token_dbs)
            if self._kv_cache_groups[group_id].kv_cache_spec.prefix_cacheable
        ]

    def lookup_chunk_hashes(self, groups: Sequence[GroupNamespaces], lookup_length: int,
                            block_hashes: Sequence[Any]) -> dict[int, list[bytes]]:
        """Per group, the chunk hashes vLLM's lookup masks say may end a hit."""
        if self.coord.enable_partial_hash_hits:
            units = min(len(block_hashes), lookup_length // self.hash_block_size)
            every = [bytes(block_hashes[i]) for i in range(units)]
            return {group.group_id: every for group in groups}
        masks = self.coord.lookup_mask(lookup_length)
        chunk_hashes: dict[int, list[bytes]] = {}
        for group in groups:
            spec = self._kv_cache_groups[group.group_id].kv_cache_spec
            group_hashes = self.coord.block_hashes_for_spec(block_hashes, spec)
            chunks = min(len(group_hashes), -(-lookup_length // group.block_size))
            mask = masks[group.group_id]
            limit = chunks if mask is None else min(chunks, len(mask))
            chunk_hashes[group.group_id] = [bytes(group_hashes[c]) for c in range(limit)
                                            if mask is None or mask[c]]
        return chunk_hashes

    def lookup(self, num_tokens: int, block_hashes: Sequence[Any]) -> MooncakeLookupResult:
        """Upstream's contract: how many prefix tokens the store can load. Never raises."""
        try:
            result, outcome = self._lookup(num_tokens, block_hashes)
        except Exception:
            logger.exception("Moonlease lookup failed; reporting a miss")
            result, outcome = MooncakeLookupResult(0), LookupOutcome.miss(MissReason.INTERNAL_ERROR)
        with self._kv_connector_stats_lock:
            self.kv_connector_stats.record_lookup(outcome)
        return result

    def _lookup(self, num_tokens: int, block_hashes: Sequence[Any]
                ) -> tuple[MooncakeLookupResult, LookupOutcome]:
        if self._capacity_only:
            return MooncakeLookupResult(0), LookupOutcome.miss(MissReason.NO_CANDIDATES)
        lookup_length = self.coord.align_lookup_length(num_tokens)
        if not block_hashes or lookup_length <= 0:
            return MooncakeLookupResult(0), LookupOutcome.miss(MissReason.NO_CANDIDATES)
        groups = self.store_groups()
        candidates = build_candidates(groups, self.lookup_chunk_hashes(groups, lookup_length,
                                                                       block_hashes))
        if not candidates.keys:
            return MooncakeLookupResult(0), LookupOutcome.miss(MissReason.NO_CANDIDATES)

        hashes = [bytes(h) for h in block_hashes]

        def hit_for(present: frozenset[tuple[int, bytes]]) -> int:
            pool = ExternalCachedBlockPool(self.hash_block_size, set(present))
            return resolve_hit(num_tokens, lookup_length,
                               lambda length: self.coord.find_longest_cache_hit(block_hashes, length, pool)[1],
                               self.coord.align_lookup_length)

        if self.moonlease_config.lease_mode is LeaseMode.SELECTIVE:
            def plan_for(hit: int, present: frozenset[tuple[int, bytes]]) -> LoadPlan:
                masks = self.coord.load_mask(block_hashes, hit)
                return build_load_plan(groups, {g.group_id: masks[g.group_id] for g in groups},
                                       hashes, self.hash_block_size, hit, present)

            selective = lease_selectively(
                candidates,
                probe=self.store_calls.probe,
                lease=lambda keys: self.store_calls.exists_with_lease(keys, operation="lookup_lease"),
                hit_for=hit_for, plan_for=plan_for,
                max_rounds=self.moonlease_config.mooncake_max_lease_rounds)
            if selective.plan is None:
                return MooncakeLookupResult(0), selective.outcome
            boundaries = tuple(TailKeyBoundary(t.group_id, t.num_tokens) for t in selective.plan.tails)
            return MooncakeLookupResult(selective.hit_length, boundaries), selective.outcome

        answers = self.store_calls.exists_with_lease(candidates.keys)
        if answers is None:
            return MooncakeLookupResult(0), LookupOutcome.miss(
                MissReason.STORE_ERROR, rounds=1, keys_probed=len(candidates))
        present = present_units(candidates, answers)
        leased = sum(1 for answer in answers if answer == 1)
        hit = hit_for(present)
        if hit <= 0:
            return MooncakeLookupResult(0), LookupOutcome.miss(
                MissReason.NOT_FOUND, rounds=1, keys_probed=len(candidates), keys_leased=leased)
        tails = build_tail_keys(groups, hashes, self.hash_block_size, hit,
                                lambda group_id, chunk_hash: (group_id, chunk_hash) in present)
        boundaries = tuple(TailKeyBoundary(t.group_id, t.num_tokens) for t in tails)
        return (MooncakeLookupResult(hit, boundaries),
                LookupOutcome(hit, None, 1, len(candidates), leased))

    # ------------------------------------------------------------------- save

    def wait_for_save(self, metadata: MooncakeStoreConnectorMetadata) -> None:
        """Publish this step's blocks, unless the forward pass that filled them raised.

        vLLM calls this from a `finally` after the forward (kv_connector_model_runner_mixin);
        an exception in flight there means the blocks hold no valid KV for their hashes.
        """
        failure = sys.exc_info()[1]
        if failure is not None:
            skipped = [request.req_id for request in metadata.requests if request.can_save]
            if skipped:
                logger.error("Forward pass failed (%s: %s); not storing KV of %d request(s): %s",
                             type(failure).__name__, failure, len(skipped), ", ".join(skipped))
                self._record_kv_connector_operation("save_skipped_failed_step", 0.0, len(skipped),
                                                    status="error", num_failed_keys=len(skipped))
            return
        super().wait_for_save(metadata)
