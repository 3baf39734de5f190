"""vLLM worker binding: upstream's MooncakeStoreWorker with Moonlease's lookup and save guard.

I/O adapter. The worker gathers the lookup's inputs once (key namespaces, the coordinator, the
store calls, the settings, the client's capabilities), builds the lookup object of its lease
mode (`vllm_lookup.build_store_lookup`) and forwards every lookup to it; saves are upstream's.

Two deliberate differences from upstream in the default mode, both safety fixes:
- the lookup never raises (upstream's lookup server thread dies on an unexpected exception and
  every later lookup hangs); anything unexpected is logged and reported as a miss;
- `wait_for_save` publishes nothing from a step whose forward pass raised (upstream runs it in
  a `finally` and stores that step's blocks, so garbage KV reaches the shared store: NOTES §2);
  the step is judged by its own exception (`StepOutcomeWatch`), and its skipped jobs are
  reported finished so the scheduler releases their blocks.

With junction retention (seed 004) on, a lookup — in either lease mode, hit or miss — also
returns the shared-prefix junction by vLLM's local rule, as sentinel entries of the response
(`core.lookup_protocol`), and saves run on `JunctionSendingThread`, whose save mask adds the
tails at each job's junctions.

With a settings file (`moonlease_settings.settings_file`) the settings are live: a
`SettingsWatcher` follows the file and, for each change it accepts (`core.live_settings`),
`apply_settings` builds the new mode's lookup object and replaces the current one as a whole
(a lookup reads it once, so it runs on one version throughout); the save thread is
`JunctionSendingThread` from the start and adds junction tails only while retention is on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    MooncakeLookupResult,
    MooncakeStoreConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    MooncakeStoreWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
    KVCacheStoreRecvingThread,
    LookupKeyServer,
    MooncakeStoreWorker,
    get_zmq_rpc_path_lookup,
)
from vllm.v1.kv_cache_interface import KVCacheConfig

from moonlease_connector.adapters.exit_guard import EXIT_WAIT_S, wait_at_exit_for
from moonlease_connector.adapters.settings_watcher import LiveSettings, SettingsExporter, SettingsWatcher
from moonlease_connector.adapters.mooncake_store import (
    ProbeContractDetector,
    StoreCalls,
    detect_capabilities,
)
from moonlease_connector.adapters.store_deadline import BoundedCaller, CallStatus
from moonlease_connector.adapters.vllm_lookup import (
    LookupInputs,
    StoreLookup,
    build_store_lookup,
    lookup_deadline_for,
    store_groups_of,
)
from moonlease_connector.adapters.vllm_lookup_server import (
    BoundedLookupServer,
    stop_upstream_lookup_server,
)
from moonlease_connector.adapters.vllm_load import DeadlineRecvingThread, load_failure_policy
from moonlease_connector.adapters.vllm_metrics import MoonleaseConnectorStats, record_lookup_outcome
from moonlease_connector.adapters.vllm_rebind import with_replaced_globals
from moonlease_connector.adapters.fleet_order_client import FleetOrderClient
from moonlease_connector.adapters.store_eviction import MasterUsage, default_master_metrics_url
from moonlease_connector.adapters.vllm_retention import RetentionSendingThread, observe_loads
from moonlease_connector.adapters.vllm_save import JunctionSendingThread
from moonlease_connector.adapters.vllm_last_hit import check_last_hit_only_layout, refuse_unservable_mode
from moonlease_connector.adapters.vllm_settings import connector_settings, settings_delivery
from moonlease_connector.adapters.vllm_threads import stop_transfer_threads
from moonlease_connector.adapters.vllm_step_outcome import StepOutcomeWatch
from moonlease_settings.config import ConnectorConfigError, LeaseMode, MoonleaseConnectorConfig
from moonlease_connector.core.capabilities import StoreCapabilities, missing_capability
from moonlease_settings.lease_modes import strategy_of
from moonlease_connector.core.load_deadline import LoadPins, load_deadline_s
from moonlease_connector.core.live_settings import ActiveSettings, SettingsSource, SwitchDecision
from moonlease_connector.core.lookup import GroupNamespaces
from moonlease_settings.settings_file import SettingsDelivery

logger = logging.getLogger("vllm.moonlease.connector.worker")

#: Upstream's close waits up to 5 s for in-flight saves; then the store handle closes.
CLOSE_TIMEOUT_S = 15.0
#: How long close waits for the transfer threads to finish what they hold and stop.
THREAD_STOP_S = 5.0
#: `MoonleaseStoreWorker.store_lookup` before (or without) our constructor.
_NOT_BUILT: Any = object()
#: What lease-all needs to know of a client no one probed: nothing (plain upstream calls).
UNDETECTED_CAPABILITIES = StoreCapabilities("unknown", False, ())


def refuse_unsupported_mode(settings: MoonleaseConnectorConfig, capabilities: StoreCapabilities, *,
                            release: Callable[[], None]) -> None:
    """Refuse a lease mode the installed Mooncake client cannot serve, after `release`-ing the
    store handle (start-up fails; nothing should stay connected)."""
    problem = missing_capability(settings.lease_mode, capabilities)
    if problem is not None:
        release()
        raise ConnectorConfigError(problem)


class MoonleaseStoreWorker(MooncakeStoreWorker):
    """Upstream's worker; lookups go through Moonlease's lookup object, saves skip failed steps.

    Takes upstream's constructor arguments; the settings come from the vLLM config and the
    environment (`connector_settings`), exactly as the connector reads them.

    Code written for upstream's worker (upstream's own unit tests among it) may build an
    instance without running this constructor and set only upstream's attributes; the class
    defaults below make such an instance behave as upstream's: every mode off, lookups built
    from upstream's attributes at call time, no step-outcome watch (saves as upstream).
    """

    moonlease_config: MoonleaseConnectorConfig = MoonleaseConnectorConfig()
    settings_delivery: SettingsDelivery = SettingsDelivery(None, None)  # no live settings
    settings_watcher: SettingsWatcher | None = None
    settings_exporter: SettingsExporter | None = None
    step_outcome: StepOutcomeWatch | None = None
    kv_connector_stats: MoonleaseConnectorStats  # upstream's stats plus Moonlease's records
    #: Loads wait as upstream's unless our constructor found a deadline (`core.load_deadline`).
    load_deadline_s: float | None = None
    load_pins: LoadPins | None = None

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        config = connector_settings(vllm_config)
        refuse_unservable_mode(config, vllm_config, kv_cache_config.kv_cache_groups)
        self.moonlease_config = config
        self.step_outcome = StepOutcomeWatch()
        self.load_deadline_s = load_deadline_s(config.mooncake_load_timeout_ms,
                                               load_failure_policy(vllm_config))
        self.load_pins = LoadPins()
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
        refuse_unsupported_mode(config, self.capabilities, release=self.close)
        #: The store's LastHitOnly response contract, detected from its answers and kept across
        #: lookup objects (docs/connector.md: Last-hit-only).
        self.probe_contract = ProbeContractDetector(self.store)
        #: Lookups served through the lookup server (rank 0) have the scheduler's bounded client
        #: in front and run inline; any other in-process caller gets one deadline for every
        #: lookup of this worker (at most one abandoned store call): `lookup_deadline_for`.
        self.lookups_served_by_client = type(self.lookup_server) is LookupKeyServer
        self.lookup_deadline = lookup_deadline_for(
            config, served_by_client=self.lookups_served_by_client)
        if config.strategy.detects_probe_contract and not self._capacity_only:
            self._detect_probe_contract(config)
        #: The current lookup; replaced as a whole (`apply_settings`), never modified.
        self.store_lookup: StoreLookup | None = (
            None if self._capacity_only else build_store_lookup(self.lookup_inputs(config)))
        if self.lookups_served_by_client:
            # Upstream's server waits on resets without a deadline; ours, same protocol, bounds it.
            stop_upstream_lookup_server(self.lookup_server)
            # (The same protocol and the attributes upstream reads of its own server.)
            self.lookup_server = cast(LookupKeyServer, BoundedLookupServer(self, get_zmq_rpc_path_lookup(vllm_config)))
        self.settings_delivery = settings_delivery(vllm_config)
        self.live_settings = LiveSettings(ActiveSettings(config, SettingsSource.STARTUP))
        self.settings_watcher: SettingsWatcher | None = None
        self.settings_exporter: SettingsExporter | None = None
        if self.settings_delivery.settings_file is not None:
            self._start_settings_watcher(vllm_config, config, self.settings_delivery)

    # ----------------------------------------------------------- live settings

    def apply_settings(self, config: MoonleaseConnectorConfig) -> None:
        """Run `config` from the next lookup on: its mode's lookup object replaces the current one
        whole. The watcher has checked that the client and the model can serve it."""
        if config.strategy.detects_probe_contract and self.probe_contract.contract is None \
                and not self._capacity_only:
            self._detect_probe_contract(config)  # as at start-up in this mode
        lookup = None if self._capacity_only else build_store_lookup(self.lookup_inputs(config))
        self.moonlease_config = config  # junction saves read it per job
        self.store_lookup = lookup

    def _detect_probe_contract(self, config: MoonleaseConnectorConfig) -> None:
        """Detect the store's LastHitOnly contract under the lookup deadline: a store that does
        not answer leaves it unknown (lookups miss and re-detect later) instead of hanging
        start-up or the settings watcher."""
        timeout_ms = config.mooncake_lookup_timeout_ms
        if not timeout_ms:
            self.probe_contract.detect()
            return
        caller = BoundedCaller(timeout_ms / 1000, name="moonlease-contract-probe")
        caller.call(self.probe_contract.detect)
        caller.close()

    def _start_settings_watcher(self, vllm_config: VllmConfig, defaults: MoonleaseConnectorConfig,
                                delivery: SettingsDelivery) -> None:
        """Follow the settings file; the rank that answers lookups also serves the endpoint."""
        assert delivery.settings_file is not None and vllm_config.kv_transfer_config is not None
        extra_config = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})

        def layout_problem(mode: LeaseMode) -> str | None:
            if not strategy_of(mode).needs_hybrid_model:
                return None
            try:
                check_last_hit_only_layout(self._kv_cache_groups, extra_config, mode)
            except ConnectorConfigError as error:
                return str(error)
            return None

        if self.lookup_server is not None and delivery.metrics_port is not None:
            exporter = SettingsExporter()
            exporter.show(self.live_settings.current())
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
            delivery.settings_file, self.live_settings, defaults=defaults, capabilities=self.capabilities,
            layout_problem=layout_problem, exporter=self.settings_exporter,
            on_decision=self._settings_decided)
        self._record_settings(None)
        self.settings_watcher.start()

    def _settings_decided(self, decision: SwitchDecision) -> None:
        if decision.refusal is None and decision.active.config != self.moonlease_config:
            self.apply_settings(decision.active.config)
        self._record_settings(decision)

    def _record_settings(self, decision: SwitchDecision | None) -> None:
        """Carry what runs (and any refusal) to vLLM's /metrics with the next step's stats."""
        active = self.live_settings.current()
        with self._kv_connector_stats_lock:
            self.kv_connector_stats.record_settings(active, decision)
            self.kv_connector_stats.record_capability(self.capabilities, active.config.lease_mode.value)

    def close(self) -> None:
        """Upstream's close (which waits up to 5 s for in-flight saves, then closes the store
        handle), bounded: a store that does not answer cannot hold shutdown. Idempotent. The
        settings watcher and endpoint stop first; the send and receive threads, which upstream
        never stops, last (`vllm_threads`)."""
        watcher, exporter = getattr(self, "settings_watcher", None), getattr(self, "settings_exporter", None)
        if watcher is not None:
            watcher.stop()
            self.settings_watcher = None
        if exporter is not None:
            exporter.close()
            self.settings_exporter = None
        deadline = getattr(self, "lookup_deadline", None)
        if deadline is not None:
            deadline.close()
        server = getattr(self, "lookup_server", None)
        if isinstance(server, BoundedLookupServer):
            server.close()
        for thread in getattr(self, "kv_recv_threads", ()):
            if isinstance(thread, DeadlineRecvingThread):
                thread.close()
        closer = BoundedCaller(CLOSE_TIMEOUT_S, name="moonlease-close")
        outcome = closer.call(super().close)
        closer.close()
        if outcome.status is CallStatus.TIMED_OUT:
            logger.warning("Mooncake store did not close within %.0f s; abandoning it", CLOSE_TIMEOUT_S)
        elif outcome.status is CallStatus.RAISED:
            logger.warning("Mooncake store close failed: %r", outcome.error)
        # Upstream never stops its send and receive threads; stop them after what they hold.
        stuck = stop_transfer_threads([getattr(self, "kv_send_thread", None),
                                       *getattr(self, "kv_recv_threads", ())], THREAD_STOP_S)
        if stuck:
            logger.warning("%d Mooncake transfer thread(s) still in a store call at close; they stop "
                           "once it returns (interpreter exit waits up to %.0f s for them)",
                           len(stuck), EXIT_WAIT_S)
            for thread in stuck:
                wait_at_exit_for(thread)
        # Evict's order: the fleet order client sends what it still holds (bounded), then stops.
        send_thread = getattr(self, "kv_send_thread", None)
        if isinstance(send_thread, RetentionSendingThread):
            send_thread.eviction.order.close()

    def get_kv_connector_stats(self) -> MoonleaseConnectorStats | None:
        with self._kv_connector_stats_lock:
            if self.kv_connector_stats.is_empty():
                return None
            stats, self.kv_connector_stats = self.kv_connector_stats, MoonleaseConnectorStats()
            return stats

    # ----------------------------------------------------------------- lookup

    def store_groups(self) -> tuple[GroupNamespaces, ...]:
        """The prefix-cacheable groups with the rank namespaces a load reads."""
        return store_groups_of(self._kv_cache_groups, [db.block_size for db in self.token_dbs],
                               self._lookup_key_prefixes)

    def lookup_inputs(self, settings: MoonleaseConnectorConfig) -> LookupInputs:
        return LookupInputs(groups=self.store_groups(), coordinator=self.coord,
                            hash_block_size=self.hash_block_size, store_calls=self.store_calls,
                            settings=settings, capabilities=self.capabilities,
                            probe_contract=self.probe_contract,
                            served_by_client=self.lookups_served_by_client,
                            deadline=self.lookup_deadline)

    def _lookup_from_upstream_attributes(self) -> StoreLookup | None:
        """A lease-all lookup over upstream's attributes, for an instance our constructor did
        not build (not cached: such code may change those attributes between lookups)."""
        if getattr(self, "_capacity_only", False):
            return None
        contract = self.__dict__.get("probe_contract")
        if contract is None and self.moonlease_config.lease_mode is LeaseMode.LAST_HIT_ONLY:
            # A class whose default mode is last-hit-only: its answers are read under the
            # contract detected from this store, once per instance, as our constructor does.
            contract = self.probe_contract = ProbeContractDetector(self.store)
        return build_store_lookup(LookupInputs(
            groups=self.store_groups(), coordinator=self.coord, hash_block_size=self.hash_block_size,
            store_calls=StoreCalls(self.store, self._record_kv_connector_operation),
            settings=self.moonlease_config, capabilities=UNDETECTED_CAPABILITIES,
            probe_contract=contract))

    def lookup(self, num_tokens: int, block_hashes: Sequence[Any]) -> MooncakeLookupResult:
        """Upstream's contract: how many prefix tokens the store can load. Never raises."""
        # Read once: a concurrent swap of the lookup takes effect at the next lookup.
        store_lookup = self.__dict__.get("store_lookup", _NOT_BUILT)
        if store_lookup is _NOT_BUILT:
            store_lookup = self._lookup_from_upstream_attributes()
        if store_lookup is None:  # capacity-only: upstream answers 0 without a store call
            return MooncakeLookupResult(0)
        answer = store_lookup.lookup(num_tokens, block_hashes)
        record_lookup_outcome(self, answer.outcome)
        return answer.result

    # ------------------------------------------------------------------- save

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Upstream's registration; with junction retention, our send thread in upstream's place.

        Upstream starts its send thread at the end of registration when this rank stores
        (`can_put`); it is held back here and `JunctionSendingThread` — the same thread with
        junction tails in the save mask — started with the same arguments instead.
        """
        retention = self.moonlease_config.retention
        live = self.settings_delivery.settings_file is not None
        if not self.moonlease_config.mooncake_junction_retention and not live and not retention.active:
            self._register_upstream(kv_caches)
            return
        can_put, self.can_put = self.can_put, False
        try:
            self._register_upstream(kv_caches)
        finally:
            self.can_put = can_put
        if not can_put or self._capacity_only or not kv_caches:
            return  # upstream would not have started a send thread either
        thread_class: Any = JunctionSendingThread
        extra: dict[str, Any] = {}
        if retention.active or live:
            # Moonlease retention (issue 21): the same thread, carrying out the save plan of the
            # settings in force (a settings file can switch the pieces without a restart).
            thread_class, extra = RetentionSendingThread, {
                "retention": lambda: self.moonlease_config.retention,
                "on_retention": self._record_retention,
                # Retention `evict` reads the store's usage from the master's metrics.
                "master_usage": MasterUsage(self.moonlease_config.mooncake_master_metrics_url
                                            or default_master_metrics_url()),
                # ... and, with a fleet order service, orders keys by the whole fleet's use.
                "fleet_order": (FleetOrderClient(self.moonlease_config.mooncake_fleet_order_url,
                                                 on_trouble=self._record_fleet_order_trouble)
                                if self.moonlease_config.mooncake_fleet_order_url else None)}
        self.kv_send_thread = thread_class(
            self.store, self.coord, self.token_dbs, self.block_size, self.tp_rank,
            self._group_tp_replication_factors, self.kv_role, threading.Event(),
            self.enable_kv_events, self.store_replicate_config,
            enable_group_semantics=self.enable_group_semantics,
            supports_group_ids=self._supports_group_ids,
            record_operation=self._record_kv_connector_operation,
            group_participates=[group.kv_cache_spec.prefix_cacheable
                                for group in self._kv_cache_groups],
            on_junction_tails_saved=self._record_junction_tails,
            junctions_enabled=lambda: self.moonlease_config.finds_junctions, **extra)
        self.kv_send_thread.start()
        if isinstance(self.kv_send_thread, RetentionSendingThread):
            # Retention `evict` orders keys by use; a save skips the prefix its request loaded.
            observe_loads(getattr(self, "kv_recv_threads", ()), self.kv_send_thread.saw_load)

    def _register_upstream(self, kv_caches: dict[str, Any]) -> None:
        """Upstream's registration; with a load deadline, its receive threads are
        `DeadlineRecvingThread`s (same arguments, the store call bounded)."""
        if self.load_deadline_s is None or self.load_pins is None:
            super().register_kv_caches(kv_caches)
            return
        deadline_s, pins = self.load_deadline_s, self.load_pins

        def receive_thread(*args: Any, **kwargs: Any) -> DeadlineRecvingThread:
            return DeadlineRecvingThread(*args, load_timeout_s=deadline_s, pins=pins, **kwargs)

        with_replaced_globals(MooncakeStoreWorker.register_kv_caches, {
            "KVCacheStoreRecvingThread": (KVCacheStoreRecvingThread, receive_thread),
        })(self, kv_caches)

    def _record_retention(self, decision: str, keys: int) -> None:
        with self._kv_connector_stats_lock:
            self.kv_connector_stats.record_retention(decision, keys)

    def _record_fleet_order_trouble(self, kind: str, count: int) -> None:
        with self._kv_connector_stats_lock:
            self.kv_connector_stats.record_fleet_order_trouble(kind, count)

    def _record_junction_tails(self, written: int) -> None:
        with self._kv_connector_stats_lock:
            self.kv_connector_stats.record_junction_tails(written)

    def wait_for_save(self, metadata: MooncakeStoreConnectorMetadata) -> None:
        """Publish this step's blocks, unless the forward pass that filled them raised.

        vLLM calls this from a `finally` after the forward (kv_connector_model_runner_mixin);
        if the step raised, its blocks hold no valid KV for their hashes. The skipped jobs are
        still finished (as failures): upstream's scheduler holds their blocks until every rank
        reports the job, so a job never reported would keep them for the rest of the run.
        """
        failure = self.step_outcome.failure() if self.step_outcome is not None else None
        if failure is None:
            super().wait_for_save(metadata)
            return
        skipped = [request for request in metadata.requests if request.can_save]
        if not skipped:
            return
        logger.error("Forward pass failed (%s: %s); not storing KV of %d request(s): %s",
                     type(failure).__name__, failure, len(skipped),
                     ", ".join(request.req_id for request in skipped))
        self._record_kv_connector_operation("save_skipped_failed_step", 0.0, len(skipped),
                                            status="error", num_failed_keys=len(skipped))
        if self._capacity_only or not self.can_put or self.kv_send_thread is None:
            return  # upstream would not have queued these jobs either
        for request in skipped:
            if request.store_job_id is not None:
                self.kv_send_thread.finish_store_job(request)

    def build_connector_worker_meta(self) -> Any:
        """Upstream's completed-save report, held back while the step is failing.

        A failed step's output never reaches the scheduler, so completions drained into it
        (the skipped jobs above, and jobs the send thread finished meanwhile) would be lost
        and their blocks stay pinned; they go out with the next step's output instead.
        """
        if self.step_outcome is not None and self.step_outcome.failure() is not None:
            return None
        meta = super().build_connector_worker_meta()
        settled = self.load_pins.take() if self.load_pins is not None else {}
        if not settled:
            return meta
        # Loads whose store calls all returned: the scheduler drops their block pins (same
        # ledger as save jobs, so the counts add up per id).
        if meta is None:
            return MooncakeStoreWorkerMetadata(completed_saves=settled)
        for pin, count in settled.items():
            meta.completed_saves[pin] = meta.completed_saves.get(pin, 0) + count
        return meta
