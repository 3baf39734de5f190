"""Loads under a deadline: upstream's receive thread, its store call bounded, its blocks pinned.

I/O adapter; the decisions are in `core.load_deadline`. Upstream's `KVCacheStoreRecvingThread`
calls `batch_get_into_multi_buffers` and waits as long as Mooncake does (a frozen master: until
Mooncake's own RPC timeout, ~30 s, and then, past the lease TTL, a failure). `DeadlineRecvingThread`
is that thread with the call on a `BoundedCaller`: past `mooncake_load_timeout_ms` every key of
the batch reads `LOAD_DEADLINE_PASSED`, so upstream's own code reports the load failed (invalid
block ids, or the failed request on hybrid models) and vLLM recomputes. While an abandoned call
is still out, later loads of that thread fail at once (`BUSY`), never piling up.

An abandoned call can still write into the blocks it was given. The scheduler pins every load's
blocks when it emits the load (`pin_loads`, the same block references and per-rank completion
counts upstream's save jobs use) and the worker reports the pin settled only once every store
call of that load has returned (`LoadPins`), so a recomputing or finished request's blocks stay
out of the free pool until then.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    LoadSpec,
    MooncakeStoreConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
    KVCacheStoreRecvingThread,
)
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

from moonlease_connector.adapters.store_deadline import BoundedCaller, CallStatus
from moonlease_connector.core.load_deadline import LOAD_DEADLINE_PASSED, LoadPins

logger = logging.getLogger("vllm.moonlease.connector.load")


@dataclass
class PinnedLoadSpec(LoadSpec):
    """Upstream's load spec plus the pin holding its blocks (`pin_loads`)."""

    pin: int | None = None


def load_failure_policy(vllm_config: Any) -> str:
    """vLLM's `kv_load_failure_policy` ("fail", vLLM's default, where a config predates it)."""
    return str(getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "fail"))


def pin_loads(scheduler: Any, meta: MooncakeStoreConnectorMetadata) -> None:
    """Take a block reference for every load this step emits, under a fresh pin id counted down
    by each rank's report (upstream's `_pinned_saves` ledger: `update_connector_output` drops
    the references once every rank has reported, `has_pending_push_work` keeps the engine
    stepping until then)."""
    pool = scheduler._gpu_block_pool
    for req_meta in meta.requests:
        spec = req_meta.load_spec
        if spec is None or not spec.can_load or isinstance(spec, PinnedLoadSpec):
            continue
        assert pool is not None, "GPU block pool must be bound before any load is emitted"
        pin = scheduler._next_store_job_id
        scheduler._next_store_job_id += 1
        fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(LoadSpec)}
        req_meta.load_spec = PinnedLoadSpec(**fields, pin=pin)
        block_ids = list(dict.fromkeys(block_id for group in req_meta.block_ids for block_id in group
                                       if block_id != NULL_BLOCK_ID))
        if not block_ids:
            continue  # nothing to hold; the report finds no entry, as for an empty save job
        scheduler._pinned_saves[pin] = (block_ids, scheduler._num_workers)
        pool.touch([pool.blocks[block_id] for block_id in block_ids])


class _BoundedGets:
    """What a receive thread's `store` is: the real store, its BatchGet under the deadline."""

    def __init__(self, store: Any, thread: DeadlineRecvingThread) -> None:
        self._store = store
        self._thread = thread

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def batch_get_into_multi_buffers(self, keys: list[str], addrs: Any, sizes: Any) -> list[int]:
        return self._thread.bounded_get(self._store, keys, addrs, sizes)


class DeadlineRecvingThread(KVCacheStoreRecvingThread):
    """Upstream's receive thread; each load's store call waits at most `load_timeout_s`."""

    def __init__(self, *args: Any, load_timeout_s: float, pins: LoadPins, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.load_timeout_s = load_timeout_s
        self.pins = pins
        self.caller = BoundedCaller(load_timeout_s, name="moonlease-load")
        self.store = _BoundedGets(self.store, self)
        #: The pin of the load being handled, and whether one of its calls was abandoned.
        self._pin: int | None = None
        self._abandoned = False
        #: Store calls this thread reported failed for the deadline (abandoned or not attempted).
        self.calls_past_deadline = 0

    def _handle_request(self, req_meta: Any) -> None:
        spec = req_meta.load_spec
        self._pin = spec.pin if isinstance(spec, PinnedLoadSpec) else None
        self._abandoned = False
        try:
            super()._handle_request(req_meta)
        finally:
            if self._pin is not None and not self._abandoned:
                self.pins.settle(self._pin)  # every call returned: the blocks are free to go

    def bounded_get(self, store: Any, keys: list[str], addrs: Any, sizes: Any) -> list[int]:
        pin, lock = self._pin, threading.Lock()
        state = {"returned": False, "abandoned": False}

        def get() -> Any:
            try:
                return store.batch_get_into_multi_buffers(keys, addrs, sizes)
            finally:
                with lock:
                    state["returned"] = True
                    late = state["abandoned"]
                if late and pin is not None:
                    self.pins.settle(pin)  # the abandoned call is back: its blocks may go

        outcome = self.caller.call(get)
        if outcome.status is CallStatus.OK:
            return outcome.value
        if outcome.status is CallStatus.RAISED:
            assert outcome.error is not None
            raise outcome.error
        if outcome.status is CallStatus.TIMED_OUT:
            with lock:
                if not state["returned"]:
                    state["abandoned"] = self._abandoned = True
            logger.warning("Mooncake load of %d key(s) did not return within %d ms; reporting it "
                           "failed (vLLM recomputes those tokens)", len(keys),
                           int(self.load_timeout_s * 1000))
        else:  # BUSY
            logger.warning("Mooncake load of %d key(s) not attempted: an earlier load past its "
                           "deadline has not returned; reporting it failed", len(keys))
        self.calls_past_deadline += 1
        return [LOAD_DEADLINE_PASSED] * len(keys)

    def close(self) -> None:
        self.caller.close()
