"""Moonlease retention ``evict`` (`core.store_room`): the I/O around the connector's own eviction.

Adapter. `MasterUsage` reads the store's usage from the master's Prometheus endpoint
(`master_allocated_bytes`, `master_total_capacity_bytes`); `StoreEviction` keeps the recency
order of the keys saves touch and, before a put, removes the least recently used ones through
the real store client (`batch_remove`, not forced) — on its own order, or on the fleet's
(`adapters.fleet_order_client`, with ``mooncake_fleet_order_url``). The engine's send thread
(`adapters.vllm_retention`) and the replay benchmark (`moonlease_dev.bench.saves`) call the same
three methods: `saw_exist`, `before_put`, `after_put`; the receive threads (their store handle,
`adapters.vllm_retention.LoadObserver`) and the replay's prefill lookups call `saw_load` for what
a load read.
"""

from __future__ import annotations

import json
import logging
import os
import re
import urllib.request
from collections import deque
from collections.abc import Callable, Collection, Sequence
from typing import Any

from moonlease_connector.core.store_room import (
    DEFAULT_CAPACITY,
    DEFAULT_SLACK,
    KeyOrder,
    RecencyOrder,
    StoreUsage,
    bytes_to_free,
    classify_removal,
)

logger = logging.getLogger("vllm.moonlease.connector.retention")

#: Loads remembered until the send thread next uses the order (a decode engine never saves).
MAX_PENDING_LOADS = 1024
#: Removal calls one put may make (each takes the oldest keys worth what is still missing).
MAX_REMOVAL_ROUNDS = 8
#: Mooncake master's default `--metrics_port`.
DEFAULT_MASTER_METRICS_PORT = 9003
_GAUGE = re.compile(r"^(master_allocated_bytes|master_total_capacity_bytes)(?:\{[^}]*\})?\s+(\S+)", re.M)


def parse_master_usage(text: str) -> StoreUsage | None:
    """The two gauges from the master's /metrics text (summed over label sets); None if absent."""
    values: dict[str, float] = {}
    for name, value in _GAUGE.findall(text):
        values[name] = values.get(name, 0.0) + float(value)
    if "master_total_capacity_bytes" not in values or "master_allocated_bytes" not in values:
        return None
    return StoreUsage(values["master_allocated_bytes"], values["master_total_capacity_bytes"])


def default_master_metrics_url(environ: dict[str, str] | None = None) -> str | None:
    """`http://<master host>:9003/metrics` from the engine's Mooncake config (MOONCAKE_CONFIG_PATH)."""
    path = (environ if environ is not None else os.environ).get("MOONCAKE_CONFIG_PATH")
    if not path:
        return None
    try:
        with open(path) as file:
            address = json.load(file).get("master_server_address", "")
    except (OSError, ValueError):
        return None
    host = address.rsplit(":", 1)[0] if address else ""
    return f"http://{host}:{DEFAULT_MASTER_METRICS_PORT}/metrics" if host else None


class MasterUsage:
    """Scrapes the master's usage; None (and one warning) when it cannot: eviction then waits."""

    def __init__(self, url: str | None, timeout_s: float = 0.5) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self._warned = False

    def __call__(self) -> StoreUsage | None:
        if not self.url:
            self._fail("no master metrics URL (set mooncake_master_metrics_url)")
            return None
        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout_s) as response:  # noqa: S310
                usage = parse_master_usage(response.read().decode("utf-8", "replace"))
        except (OSError, ValueError) as error:
            self._fail(f"cannot read {self.url}: {error}")
            return None
        if usage is None:
            self._fail(f"{self.url} has no master_allocated_bytes/master_total_capacity_bytes")
            return None
        return usage

    def _fail(self, why: str) -> None:
        if not self._warned:
            logger.warning("retention evict: %s; the master evicts as without it", why)
            self._warned = True


def _size(size: Any) -> int:
    """One key's bytes: an int, or the list of its buffers' sizes (multi-buffer puts)."""
    if isinstance(size, (list, tuple)):
        return int(sum(size))
    return int(size)


class StoreEviction:
    """The connector's own eviction: recency of its keys, and removal before a put needs room."""

    def __init__(self, store: Any, usage: Callable[[], StoreUsage | None], watermark: float, *,
                 on_removed: Callable[[int], None] = lambda keys: None,
                 capacity: int = DEFAULT_CAPACITY, slack: float = DEFAULT_SLACK,
                 order: KeyOrder | None = None) -> None:
        self.store = store
        self.usage = usage
        self.watermark = watermark
        self.slack = slack
        #: This connector's own order, or the fleet's (`adapters.fleet_order_client`).
        self.order: KeyOrder = order if order is not None else RecencyOrder(capacity)
        self._fleet = self.order.shared_by_fleet
        self._on_removed = on_removed
        self.removed_keys = 0
        self.refused_keys = 0
        #: What loads read, from the receive thread; applied by the thread that owns the order.
        self._loads: deque[Sequence[str]] = deque(maxlen=MAX_PENDING_LOADS)
        #: The loads taken at the current job's re-check: kept above the keys its puts store.
        self._job_loads: list[Sequence[str]] = []

    def saw_load(self, keys: Sequence[str]) -> None:
        """A load read `keys` (prompt order): used now. A save skips the prefix it loaded, so
        without this a conversation's oldest blocks — the ones every turn reads — would look
        unused here since they were first written. Safe from another thread: the order takes it
        at its owner's next call. Keys this connector never ordered stay out (`refresh`). The
        fleet's order hears of it at once: every engine's next put decides by it, not only
        this one's."""
        if self._fleet:
            self.order.refresh(keys)
        self._loads.append(keys)

    def _take_loads(self) -> None:
        while self._loads:
            keys = self._loads.popleft()
            if not self._fleet:  # the fleet's order was told in `saw_load`
                self.order.refresh(keys)
            self._job_loads.append(keys)

    def _loads_on_top(self) -> None:
        """A conversation leaves tail first: the prefix a job loaded stays above what it put."""
        for keys in self._job_loads:
            self.order.refresh(keys)

    def saw_exist(self, keys: Sequence[str], answers: Sequence[int],
                  shared: Collection[str] | None = None) -> None:
        """A save re-checked `keys` (prompt order): those in the store were used now.

        `shared`: the keys of the prompt's shared prefix, which this connector does not remove
        (None: not known, as for a read; each key keeps what the last save said).
        """
        self._job_loads = []
        self._take_loads()
        self.order.touch([key for key, answer in zip(keys, answers) if answer == 1], shared=shared)
        self._loads_on_top()

    def after_put(self, keys: Sequence[str], sizes: Sequence[Any], answers: Sequence[int],
                  shared: Collection[str] | None = None) -> None:
        """Keys a put stored were used now (with their sizes); `shared` as in `saw_exist`."""
        self._take_loads()
        stored = [(key, _size(size)) for key, size, answer in zip(keys, sizes, answers) if answer >= 0]
        self.order.touch([key for key, _ in stored], [size for _, size in stored], shared=shared)
        self._loads_on_top()

    def before_put(self, keys: Sequence[str], sizes: Sequence[Any]) -> int:
        """Remove least recently used keys so this put keeps the store under the watermark.

        Returns the keys removed. Keys of this put are never removed; keys under lease are
        refused by the master and kept (most recent: they are being read).
        """
        self._take_loads()
        usage = self.usage()
        if usage is None:
            return 0
        need = bytes_to_free(usage, sum(_size(size) for size in sizes), self.watermark, self.slack)
        if need <= 0:
            return 0
        removed = 0
        # Keys the master evicted already, or under lease, free nothing: take more, a few rounds.
        for _ in range(MAX_REMOVAL_ROUNDS):
            victims = self.order.take_oldest(need, protect=keys)
            if not victims:
                break
            answers = self.store.batch_remove([key for key, _ in victims], False)
            outcome = classify_removal(victims, answers)
            self.order.keep(outcome.kept)
            self.refused_keys += len(outcome.kept)
            removed += len(outcome.removed)
            need -= outcome.freed_bytes
            if need <= 0:
                break
        self.removed_keys += removed
        if removed:
            self._on_removed(removed)
        return removed
