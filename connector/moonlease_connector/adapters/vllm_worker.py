"""vLLM worker binding: upstream's MooncakeStoreWorker with Moonlease's lookup and save guard.

I/O adapter. Everything it decides comes from `moonlease_connector.core`; this module gathers
vLLM's inputs (key namespaces, chunk hashes, lookup masks, the coordinator's hit rule), makes
the store calls through `StoreCalls`, and hands results back in upstream's types.

Two deliberate differences from upstream in the default mode, both safety fixes:
- the lookup never raises (upstream's lookup server thread dies on an unexpected exception and
  every later lookup hangs); anything unexpected is logged and reported as a miss;
- `wait_for_save` publishes nothing from a step whose forward pass raised (upstream runs it in
  a `finally` and stores that step's blocks, so garbage KV reaches the shared store: NOTES §2).

With junction retention (seed 004) on, a lookup — in either lease mode, hit or miss — also
returns the shared-prefix junction by vLLM's local rule (`longest_single_group_hit`), as
sentinel entries of the response (`core.lookup_protocol`), and saves run on
`JunctionSendingThread`, whose save mask adds the tails at each job's junctions.

With a settings file (`moonlease_connector.settings`), the settings are live: a
`SettingsWatcher` replaces them whole when the file changes (or refuses the change), each
lookup reads one snapshot of them, and the save thread is `JunctionSendingThread` from the
start, adding junction tails only while junction retention is on.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
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
from vllm.v1.core.kv_cache_utils import eagle_proof_margin
from vllm.v1.kv_cache_interface import KVCacheConfig, MambaSpec

from moonlease_connector.adapters.mooncake_store import StoreCalls, detect_capabilities
from moonlease_connector.adapters.settings_watcher import LiveSettings, SettingsExporter, SettingsWatcher
from moonlease_connector.adapters.vllm_last_hit import check_last_hit_only_layout, lookup_last_hit_only
from moonlease_connector.adapters.vllm_metrics import MoonleaseConnectorStats
from moonlease_connector.adapters.vllm_save import JunctionSendingThread
from moonlease_connector.adapters.vllm_specs import is_recurrent
from moonlease_connector.config import ConnectorConfigError, LeaseMode, MoonleaseConnectorConfig
from moonlease_connector.core.capabilities import missing_capability
from moonlease_connector.core.junctions import find_junctions
from moonlease_connector.core.live_settings import ActiveSettings, SettingsSource, SwitchDecision
from moonlease_connector.core.lookup import (
    GroupNamespaces,
    LookupOutcome,
    MissReason,
    TailKey,
    Unit,
    build_candidates,
    build_tail_keys,
    present_units,
    resolve_hit,
)
from moonlease_connector.core.lookup_protocol import LookupResponse, build_wire_entries
from moonlease_connector.core.selective import LoadPlan, build_load_plan, lease_selectively
from moonlease_connector.settings import SettingsDelivery

logger = logging.getLogger("vllm.moonlease.connector.worker")


class MoonleaseStoreWorker(MooncakeStoreWorker):
    """Upstream's worker; lookups go through Moonlease's core, saves skip failed steps."""

    #: The settings a lookup in progress on this thread runs with (one snapshot per lookup).
    _lookup_snapshot = threading.local()
    _live: LiveSettings | None = None
    settings_watcher: SettingsWatcher | None = None
    settings_exporter: SettingsExporter | None = None
    settings_delivery = SettingsDelivery(None, None)

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                 config: MoonleaseConnectorConfig,
                 delivery: SettingsDelivery = SettingsDelivery(None, None)) -> None:
        self.moonlease_config = config
        self.settings_delivery = delivery
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
        if delivery.settings_file is not None:
            self._start_settings_watcher(vllm_config, config, delivery)

    @property
    def moonlease_config(self) -> MoonleaseConnectorConfig:
        """The settings in effect: the lookup's snapshot inside a lookup, else the current ones."""
        pinned = getattr(self._lookup_snapshot, "config", None)
        if pinned is not None:
            return pinned
        assert self._live is not None
        return self._live.current().config

    @moonlease_config.setter
    def moonlease_config(self, config: MoonleaseConnectorConfig) -> None:
        self._live = LiveSettings(ActiveSettings(config, SettingsSource.STARTUP))

    def _start_settings_watcher(self, vllm_config: VllmConfig, defaults: MoonleaseConnectorConfig,
                                delivery: SettingsDelivery) -> None:
        """Follow the settings file; the rank that answers lookups also serves the endpoint."""
        assert self._live is not None and delivery.settings_file is not None
        extra_config = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})

        def layout_problem(mode: LeaseMode) -> str | None:
            if mode is not LeaseMode.LAST_HIT_ONLY:
                return None
            try:
                check_last_hit_only_layout(self._kv_cache_groups, extra_config)
            except ConnectorConfigError as error:
                return str(error)
            return None

        if self.lookup_server is not None and delivery.metrics_port is not None:
            exporter = SettingsExporter()
            exporter.show(self._live.current())
            try:
                port = exporter.serve(delivery.metrics_port)
            except OSError as error:
                # Serving continues; the operator cannot verify this pod and will say so.
                logger.error("Moonlease settings endpoint not served (port %d: %s); set %s to a free "
                             "port", delivery.metrics_port, error, "mooncake_settings_metrics_port")
            else:
                self.settings_exporter = exporter
                logger.info("Moonlease settings metrics on port %d", port)
        self.settings_watcher = SettingsWatcher(
            delivery.settings_file, self._live, defaults=defaults, capabilities=self.capabilities,
            layout_problem=layout_problem, exporter=self.settings_exporter,
            on_decision=self._record_settings_decision)
        self._record_settings_decision(None)
        self.settings_watcher.start()

    def _record_settings_decision(self, decision: SwitchDecision | None) -> None:
        """Carry what runs (and any refusal) to vLLM's /metrics with the next step's stats."""
        assert self._live is not None
        active = self._live.current()
        with self._kv_connector_stats_lock:
            self.kv_connector_stats.record_settings(active, decision)
            self.kv_connector_stats.record_capability(self.capabilities,
                                                      active.config.lease_mode.value)

    def close(self) -> None:
        if self.settings_watcher is not None:
            self.settings_watcher.stop()
            self.settings_watcher = None
        if self.settings_exporter is not None:
            self.settings_exporter.close()
            self.settings_exporter = None
        super().close()

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
                            is_recurrent=is_recurrent(self._kv_cache_groups[group_id].kv_cache_spec))
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
        # Settings may be swapped at any time; this lookup runs on one version throughout.
        self._lookup_snapshot.config = self.moonlease_config
        try:
            result, outcome = self._lookup(num_tokens, block_hashes)
        except Exception:
            logger.exception("Moonlease lookup failed; reporting a miss")
            result, outcome = MooncakeLookupResult(0), LookupOutcome.miss(MissReason.INTERNAL_ERROR)
        finally:
            self._lookup_snapshot.config = None
        with self._kv_connector_stats_lock:
            self.kv_connector_stats.record_lookup(outcome)
        return result

    def longest_single_group_hit(self, block_hashes: Sequence[Any], max_length: int,
                                 pool: ExternalCachedBlockPool) -> int:
        """The hit of the group vLLM's convergence loop evaluates first, at `max_length`.

        Mirrors the first step of `MooncakeStoreCoordinator._find_hit_blocks` (and of core's
        `HybridKVCacheCoordinator.find_longest_cache_hit`, whose ``longest_hit_length`` it is:
        every later step is bounded by the hit before it). With one spec group there is no
        lagging group, so no junction: 0.
        """
        coord = self.coord
        if len(coord.attention_groups) < 2:
            return 0
        spec, group_ids, manager_cls, group_eagle = coord.attention_groups[0]
        fine_grained = coord.enable_partial_hash_hits
        length = max_length
        if group_eagle and not isinstance(spec, MambaSpec):
            margin = eagle_proof_margin(spec.block_size, coord.hash_block_size,
                                        fine_grained and manager_cls.supports_fine_grained_hash_lookup)
            length = min(max_length + margin, len(block_hashes) * coord.hash_block_size)
        _, hit = manager_cls.find_longest_cache_hit(
            block_hashes=block_hashes, max_length=length, kv_cache_group_ids=group_ids,
            block_pool=pool, kv_cache_spec=spec, drop_eagle_block=group_eagle,
            alignment_tokens=coord.hash_block_size if fine_grained else coord.lcm_block_size)
        return int(hit)

    def store_junctions(self, num_tokens: int, block_hashes: Sequence[Any], hit_length: int,
                        present: frozenset[Unit]) -> tuple[int, ...]:
        """Junctions to return with a lookup (none unless junction retention is on).

        Bounded like core's local lookup (``num_tokens - 1``: the last token is recomputed),
        so the store and the local cache agree on where a shared prefix ends.
        """
        if not self.moonlease_config.mooncake_junction_retention or num_tokens <= 1:
            return ()
        bound = min(num_tokens - 1, len(block_hashes) * self.hash_block_size)
        pool = ExternalCachedBlockPool(self.hash_block_size, set(present))
        try:
            longest = self.longest_single_group_hit(block_hashes, bound, pool)
        except Exception:
            # A junction only helps later siblings: failing to find one must not cost this hit.
            logger.exception("Moonlease junction search failed; returning the hit without one")
            return ()
        return find_junctions(hit_length, (longest,))

    def _respond(self, hit: int, tails: Sequence[TailKey], junctions: tuple[int, ...],
                 outcome: LookupOutcome) -> tuple[MooncakeLookupResult, LookupOutcome]:
        """Upstream's result type; junctions ride in it as sentinel tail entries."""
        entries = build_wire_entries(LookupResponse(hit, tuple(tails), junctions))
        result = MooncakeLookupResult(hit, tuple(TailKeyBoundary(g, n) for g, n in entries))
        if junctions:
            outcome = dataclasses.replace(outcome, junctions=len(junctions))
        return result, outcome

    def _lookup(self, num_tokens: int, block_hashes: Sequence[Any]
                ) -> tuple[MooncakeLookupResult, LookupOutcome]:
        if self._capacity_only:
            return MooncakeLookupResult(0), LookupOutcome.miss(MissReason.NO_CANDIDATES)
        lookup_length = self.coord.align_lookup_length(num_tokens)
        if not block_hashes or lookup_length <= 0:
            return MooncakeLookupResult(0), LookupOutcome.miss(MissReason.NO_CANDIDATES)
        groups = self.store_groups()

        def hit_for(present: frozenset[tuple[int, bytes]]) -> int:
            pool = ExternalCachedBlockPool(self.hash_block_size, set(present))
            return resolve_hit(num_tokens, lookup_length,
                               lambda length: self.coord.find_longest_cache_hit(block_hashes, length, pool)[1],
                               self.coord.align_lookup_length)

        if self.moonlease_config.lease_mode is LeaseMode.LAST_HIT_ONLY:
            # Builds its own candidates: KV keys as below, recurrent keys per checkpoint.
            return lookup_last_hit_only(self, num_tokens, lookup_length, block_hashes, groups, hit_for)

        candidates = build_candidates(groups, self.lookup_chunk_hashes(groups, lookup_length,
                                                                       block_hashes))
        if not candidates.keys:
            return MooncakeLookupResult(0), LookupOutcome.miss(MissReason.NO_CANDIDATES)
        hashes = [bytes(h) for h in block_hashes]

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
            junctions = self.store_junctions(num_tokens, block_hashes, selective.hit_length,
                                             selective.present)
            tails = selective.plan.tails if selective.plan is not None else ()
            return self._respond(selective.hit_length, tails, junctions, selective.outcome)

        answers = self.store_calls.exists_with_lease(candidates.keys)
        if answers is None:
            return MooncakeLookupResult(0), LookupOutcome.miss(
                MissReason.STORE_ERROR, rounds=1, keys_probed=len(candidates))
        present = present_units(candidates, answers)
        leased = sum(1 for answer in answers if answer == 1)
        hit = hit_for(present)
        junctions = self.store_junctions(num_tokens, block_hashes, max(hit, 0), present)
        if hit <= 0:
            return self._respond(0, (), junctions, LookupOutcome.miss(
                MissReason.NOT_FOUND, rounds=1, keys_probed=len(candidates), keys_leased=leased))
        tails = build_tail_keys(groups, hashes, self.hash_block_size, hit,
                                lambda group_id, chunk_hash: (group_id, chunk_hash) in present)
        return self._respond(hit, tails, junctions,
                             LookupOutcome(hit, None, 1, len(candidates), leased))

    # ------------------------------------------------------------------- save

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Upstream's registration; with junction retention, our send thread in upstream's place.

        Upstream starts its send thread at the end of registration when this rank stores
        (`can_put`); it is held back here and `JunctionSendingThread` — the same thread with
        junction tails in the save mask — started with the same arguments instead.
        """
        live = self.settings_delivery.settings_file is not None
        if not self.moonlease_config.mooncake_junction_retention and not live:
            super().register_kv_caches(kv_caches)
            return
        can_put, self.can_put = self.can_put, False
        try:
            super().register_kv_caches(kv_caches)
        finally:
            self.can_put = can_put
        if not can_put or self._capacity_only or not kv_caches:
            return  # upstream would not have started a send thread either
        self.kv_send_thread = JunctionSendingThread(
            self.store, self.coord, self.token_dbs, self.block_size, self.tp_rank,
            self._group_tp_replication_factors, self.kv_role, threading.Event(),
            self.enable_kv_events, self.store_replicate_config,
            enable_group_semantics=self.enable_group_semantics,
            supports_group_ids=self._supports_group_ids,
            record_operation=self._record_kv_connector_operation,
            group_participates=[group.kv_cache_spec.prefix_cacheable
                                for group in self._kv_cache_groups],
            on_junction_tails_saved=self._record_junction_tails,
            junctions_enabled=lambda: self.moonlease_config.mooncake_junction_retention)
        self.kv_send_thread.start()

    def _record_junction_tails(self, written: int) -> None:
        with self._kv_connector_stats_lock:
            self.kv_connector_stats.record_junction_tails(written)

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
