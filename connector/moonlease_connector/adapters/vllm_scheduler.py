"""vLLM binding, scheduler side of junction retention (seed 004).

I/O adapter around upstream's `MooncakeStoreScheduler`; the decisions come from
`moonlease_connector.core.junctions` and the wire format from `core.lookup_protocol`.

Flow of a junction:
1. the worker's lookup returns it as a sentinel entry of the lookup response;
2. `JunctionLookupClient` decodes the response with Moonlease's reader, hands upstream only
   the real tail keys (so the load spec is upstream's) and keeps the junctions per request;
3. `MoonleaseStoreScheduler.get_num_new_matched_tokens` — core calls it after setting
   ``request.shared_prefix_boundary`` and before the request computes anything — merges them
   with core's boundary: into ``request.shared_prefix_boundary`` when core found none (vLLM
   0.32/0.33 hold one value; core then keeps the local blocks there and, on hybrid models,
   checkpoints the Mamba state there and hands it to the store), and all of them into the
   request's junction record;
4. `build_connector_meta` attaches the record to each save job of the request
   (`JunctionReqMeta`), where the worker's save mask adds their tails.

The record lives beside upstream's `RequestTracker`s, keyed by request id, for the request's
lifetime: upstream rebuilds a request's tracker when a request that loaded from the store is
scheduled after its load (and on resume), and a loading request's first metadata carries no
save, so junctions kept on a tracker or on that metadata would be lost before the first save.
Block lifetime is upstream's: a save job pins every non-null block of the request when the job
is created, in the same `schedule()` pass, and the worker skips null block ids.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    MooncakeLookupResult,
    MooncakeStoreConnectorMetadata,
    ReqMeta,
    TailKeyBoundary,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.scheduler import (
    MooncakeStoreScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import LookupKeyClient
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.request import Request

from moonlease_connector.adapters.vllm_last_hit import refuse_unservable_mode
from moonlease_connector.adapters.vllm_load import load_failure_policy, pin_loads
from moonlease_connector.adapters.vllm_lookup_client import BoundedLookupClient
from moonlease_connector.adapters.vllm_metrics import MoonleaseConnectorStats
from moonlease_connector.adapters.vllm_settings import connector_settings, settings_delivery
from moonlease_connector.core.handoff import (
    POLL_INTERVAL_S,
    HandoffOutcome,
    decide_handoff,
    expected_hit,
    promised_tokens,
)
from moonlease_connector.core.junctions import merge_junctions, request_boundary
from moonlease_connector.core.load_deadline import load_deadline_s, policy_warning
from moonlease_connector.core.lookup import LookupOutcome, MissReason
from moonlease_connector.core.lookup_protocol import decode_lookup_response

logger = logging.getLogger("vllm.moonlease.connector.scheduler")


@dataclass
class JunctionLookupResult(MooncakeLookupResult):
    """Upstream's lookup result (real tail keys only) plus the store's junctions."""

    junctions: tuple[int, ...] = ()


@dataclass
class JunctionReqMeta(ReqMeta):
    """Upstream's per-request step metadata plus the junctions its save mask keeps tails at."""

    junctions: tuple[int, ...] = ()

    @classmethod
    def from_req_meta(cls, req_meta: ReqMeta, junctions: Sequence[int]) -> JunctionReqMeta:
        fields = {f.name: getattr(req_meta, f.name) for f in dataclasses.fields(ReqMeta)}
        return cls(**fields, junctions=tuple(junctions))


def junctions_of(req_meta: Any) -> tuple[int, ...]:
    """The junctions a save job carries (none on upstream's own metadata)."""
    return req_meta.junctions if isinstance(req_meta, JunctionReqMeta) else ()


class JunctionLookupClient(BoundedLookupClient):
    """The bounded lookup client reading responses with Moonlease's decoder.

    The request frames are upstream's. Junction entries are split off the response and kept
    per request until the scheduler takes them; a response from a worker that predates
    junctions simply has none.
    """

    def __init__(self, vllm_config: VllmConfig, **kwargs: Any) -> None:
        super().__init__(vllm_config, **kwargs)
        self._junctions: dict[str, tuple[int, ...]] = {}

    def _decode(self, reply: bytes) -> MooncakeLookupResult:
        response = decode_lookup_response(reply)
        return JunctionLookupResult(
            response.hit_length,
            tuple(TailKeyBoundary(t.group_id, t.num_tokens) for t in response.tails),
            junctions=response.junctions)

    def _missed(self) -> MooncakeLookupResult:
        return JunctionLookupResult(0)

    def lookup(self, req_id: str, num_tokens: int, block_hashes: list[Any],
               non_block: bool = False) -> MooncakeLookupResult | None:
        result = super().lookup(req_id, num_tokens, block_hashes, non_block=non_block)
        if result is not None:
            self._junctions[req_id] = getattr(result, "junctions", ())
        return result

    def take_junctions(self, req_id: str) -> tuple[int, ...]:
        """The junctions of the request's last completed lookup (once)."""
        return self._junctions.pop(req_id, ())

    def discard(self, req_id: str) -> None:
        super().discard(req_id)
        self._junctions.pop(req_id, None)


#: How long `reset_store` waits for the worker to drain its saves and wipe the store.
RESET_TIMEOUT_S = 60.0


def bounded_reset(client: BoundedLookupClient, timeout_s: float) -> bool:
    """Upstream's reset request with a deadline; runs on the client's own executor thread
    (`BoundedLookupClient.reset_within`: past the deadline the socket is replaced)."""
    return client.reset_within(timeout_s)


class MoonleaseStoreScheduler(MooncakeStoreScheduler):
    """Upstream's scheduler side; lookups and resets never wait past their deadlines; with
    junction retention on, store junctions are carried from the lookup to the save mask.

    Takes upstream's constructor arguments; the settings come from the vLLM config and the
    environment (`connector_settings`), exactly as the connector reads them. Upstream's lookup
    client is replaced by `BoundedLookupClient` (the lookup deadline, `mooncake_lookup_timeout_ms`,
    is kept here, where the scheduler waits: the worker runs lookups inline). With junction
    retention off it is upstream's scheduler plus the bounded lookups and reset. With a
    settings file the junction path is always on: retention may be switched on live, and the
    junctions come from the worker's lookups, which return none while it is off (the request's
    own boundary, as core set it, is then all its saves get, as upstream).
    The class defaults keep an instance built without this constructor (by code written for
    upstream's) upstream's; with every mode off, a client that is not upstream's own class (a test
    double) is kept.
    """

    junction_retention: bool = False
    load_deadline_s: float | None = None
    reset_timeout_s: float = RESET_TIMEOUT_S
    handoff_timeout_s: float = 0.0
    _lookup_stats: MoonleaseConnectorStats | None = None
    _clock: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
        settings = connector_settings(vllm_config)
        refuse_unservable_mode(settings, vllm_config, kv_cache_config.kv_cache_groups)
        super().__init__(vllm_config, kv_cache_config)
        self.reset_timeout_s = RESET_TIMEOUT_S
        self.moonlease_config = settings
        failure_policy = load_failure_policy(vllm_config)
        #: Loads under a deadline (the worker's receive threads) have their blocks pinned here.
        self.load_deadline_s = load_deadline_s(settings.mooncake_load_timeout_ms, failure_policy)
        warning = policy_warning(failure_policy)
        if warning is not None:
            logger.warning("%s", warning)
        # Retention `skip` needs the junctions too: the state there is what a sibling resumes from.
        self.junction_retention = (self.moonlease_config.finds_junctions
                                   or settings_delivery(vllm_config).settings_file is not None)
        #: request id -> every junction its saves keep tails at (core's and the store's).
        self.request_junctions: dict[str, tuple[int, ...]] = {}
        self.handoff_timeout_s = settings.mooncake_handoff_timeout_ms / 1000
        #: request id -> (first lookup, latest lookup) of a request waiting for its prefill's save.
        self._handoff_waits: dict[str, tuple[float, float]] = {}
        #: Lookups the client answered a miss by itself (the worker did not answer in time).
        self._lookup_stats = MoonleaseConnectorStats()
        self._lookup_stats_lock = threading.Lock()
        if type(self.client) is LookupKeyClient or self.junction_retention:
            # Upstream built its plain client in its constructor; ours replaces it before any use.
            upstream_client = self.client
            client_class = JunctionLookupClient if self.junction_retention else BoundedLookupClient
            self.client = client_class(
                vllm_config, timeout_s=self.moonlease_config.mooncake_lookup_timeout_ms / 1000,
                on_miss=self._record_client_miss)
            upstream_client.close()
            upstream_client.ctx.term()

    def close(self) -> None:
        """Close the lookup channel (socket, executor thread, ZMQ context); idempotent.

        vLLM's scheduler shutdown reaches it through the connector's `shutdown`, garbage
        collection through `__del__`: upstream's scheduler closes nothing, and its context,
        terminated by the collector with a lookup the worker never answered still queued, hung
        for good. A client that is not ours gets its own `close`, as upstream's would."""
        client = self.__dict__.get("client")
        if client is None or self.__dict__.get("_closed"):
            return
        self._closed = True
        close = getattr(client, "close", None)
        if close is not None:
            close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter teardown: modules may be gone already
            pass

    def _record_client_miss(self) -> None:
        with self._lookup_stats_lock:
            if self._lookup_stats is not None:  # None: built without this class's constructor
                self._lookup_stats.record_lookup(LookupOutcome.miss(MissReason.STORE_TIMEOUT))

    def take_lookup_stats(self) -> MoonleaseConnectorStats | None:
        """The scheduler side's lookup records since the last call (None if there are none);
        vLLM's scheduler aggregates them with the workers' stats each step."""
        if self._lookup_stats is None:
            return None
        with self._lookup_stats_lock:
            if self._lookup_stats.is_empty():
                return None
            stats, self._lookup_stats = self._lookup_stats, MoonleaseConnectorStats()
            return stats

    def reset_store(self) -> bool:
        """Upstream's reset (`remove_all` on worker rank 0), bounded: vLLM's reset-prefix-cache
        path calls it and must never hang (no worker listening, a wedged drain)."""
        client = self.client
        if not isinstance(client, BoundedLookupClient):
            return super().reset_store()  # someone else's client, or not built by us: upstream's
        future = client.executor.submit(bounded_reset, client, self.reset_timeout_s)
        try:
            ok = future.result(timeout=self.reset_timeout_s + client.timeout_s + 5.0)
        except Exception as error:  # includes the backstop timeout (a lookup ahead of it stuck)
            future.cancel()
            logger.error("Mooncake reset_store failed or timed out after %.0f s: %s",
                         self.reset_timeout_s, error or type(error).__name__)
            return False
        if ok:
            logger.info("Mooncake store reset via remove_all succeeded.")
        else:
            logger.error("Mooncake store reset failed: no ACK from worker rank 0 within %.0f s "
                         "(or a NACK)", self.reset_timeout_s)
        return ok

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        waiting_since = self._handoff_waits.get(request.request_id) if self.handoff_timeout_s else None
        if waiting_since is not None and self._clock() - waiting_since[1] < POLL_INTERVAL_S:
            return None, False  # waiting for the prefill's save: not yet time to look again
        matched = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if matched[0] is None:  # an asynchronous lookup still in flight
            return matched
        if not self._handoff_settled(request, num_computed_tokens + matched[0]):
            self.load_specs.pop(request.request_id, None)  # the next lookup writes it afresh
            if isinstance(self.client, JunctionLookupClient):
                self.client.take_junctions(request.request_id)
            return None, False
        if not self.junction_retention:
            return matched
        assert isinstance(self.client, JunctionLookupClient)
        store_junctions = self.client.take_junctions(request.request_id)
        local = int(request.shared_prefix_boundary or 0)
        self.request_junctions[request.request_id] = merge_junctions(local, store_junctions)
        request.shared_prefix_boundary = request_boundary(local, store_junctions)
        if store_junctions:
            logger.debug("Request %s: store junctions %s (core's boundary %d)",
                         request.request_id, store_junctions, local)
        return matched

    def _handoff_settled(self, request: Request, covered_tokens: int) -> bool:
        """False while the request waits for the save its prefill engine promised (`core.handoff`);
        the wait's outcome is counted when it ends."""
        # getattr: code written for upstream's scheduler (its own tests) passes request stand-ins.
        promised = promised_tokens(getattr(request, "kv_transfer_params", None))
        if promised is None or not self.handoff_timeout_s or not getattr(self, "enable_lookup", True):
            return True
        now = self._clock()
        first_lookup = self._handoff_waits.get(request.request_id, (now, now))[0]
        coord = getattr(self, "_store_coord", None)  # None: a capacity-only consumer (vLLM 0.33)
        expected = expected_hit(promised, request.num_tokens,
                                coord.align_lookup_length if coord is not None else int)
        outcome = decide_handoff(covered_tokens=covered_tokens, expected_tokens=expected,
                                 waited_s=now - first_lookup, timeout_s=self.handoff_timeout_s)
        if outcome is None:
            self._handoff_waits[request.request_id] = (first_lookup, now)
            return False
        self._handoff_waits.pop(request.request_id, None)
        with self._lookup_stats_lock:
            if self._lookup_stats is not None:
                self._lookup_stats.record_handoff(outcome, now - first_lookup)
        if outcome is HandoffOutcome.TIMED_OUT:
            logger.info("Request %s: the prefill engine's save (%d tokens, %d loadable) had not "
                        "landed after %.0f ms; loading the %d tokens the store holds",
                        request.request_id, promised, expected, (now - first_lookup) * 1000,
                        covered_tokens)
        return True

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self.handoff_timeout_s:
            for req_id in scheduler_output.finished_req_ids:
                self._handoff_waits.pop(req_id, None)  # aborted while waiting
        meta = super().build_connector_meta(scheduler_output)
        if self.load_deadline_s is not None:
            assert isinstance(meta, MooncakeStoreConnectorMetadata)
            pin_loads(self, meta)
        if not self.junction_retention:
            return meta
        for req_id in scheduler_output.finished_req_ids:
            self.request_junctions.pop(req_id, None)
        assert isinstance(meta, MooncakeStoreConnectorMetadata)
        for index, req_meta in enumerate(meta.requests):
            junctions = self.request_junctions.get(req_meta.req_id, ())
            if junctions and req_meta.can_save:
                meta.requests[index] = JunctionReqMeta.from_req_meta(req_meta, junctions)
        return meta
