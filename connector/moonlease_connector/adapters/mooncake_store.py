"""Mooncake client binding: the store calls a lookup makes, timed, recorded, never raising.

I/O adapter around a `MooncakeDistributedStore` handle. Errors are data (STYLE.md): a raising
RPC or a malformed reply comes back as `None`, which the lookup reports as a miss, so the lookup
server thread never dies on a store failure.
"""

from __future__ import annotations

import importlib.metadata
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from moonlease_connector.core.capabilities import StoreCapabilities

logger = logging.getLogger("vllm.moonlease.connector.store")

#: Distributions that ship the `mooncake` package, most specific first.
MOONCAKE_DISTRIBUTIONS = ("mooncake-transfer-engine-cuda13", "mooncake-transfer-engine",
                          "mooncake-transfer-engine-non-cuda")


class RecordOperation(Protocol):
    """Upstream worker's `_record_kv_connector_operation` (→ vllm:mooncake_store_operation_*)."""

    def __call__(self, operation: str, duration_seconds: float, num_keys: int, *,
                 num_bytes: int = 0, status: str = "ok", num_failed_keys: int = 0) -> None: ...


def mooncake_version() -> str:
    for dist in MOONCAKE_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def detect_capabilities(store: Any) -> StoreCapabilities:
    """Probe the client without touching any key: an empty probe is answered locally.

    An unknown policy raises ValueError in 0.3.14; an empty key list never reaches the master.
    """
    has_probe = callable(getattr(store, "batch_probe_key", None))
    policies: list[str] = []
    if has_probe:
        for policy in ("none", "LastHitOnly"):
            try:
                store.batch_probe_key([], policy, 1)
            except (ValueError, TypeError):
                continue
            except Exception as error:  # a client that cannot even answer locally
                logger.warning("batch_probe_key(policy=%s) failed at start-up: %s", policy, error)
                continue
            policies.append(policy)
    return StoreCapabilities(mooncake_version(), has_probe, tuple(policies))


class StoreCalls:
    """The lookup's store RPCs, each recorded under upstream's operation names."""

    def __init__(self, store: Any, record: RecordOperation,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._store = store
        self._record = record
        self._clock = clock

    def exists_with_lease(self, keys: Sequence[str], operation: str = "lookup_exists"
                          ) -> list[int] | None:
        """`batch_is_exist`: existence per key; leases every key that exists (Mooncake)."""
        return self._call(operation, keys, lambda: self._store.batch_is_exist(list(keys)))

    def probe(self, keys: Sequence[str], *, policy: str = "none", candidate_size: int = 1,
              operation: str = "lookup_probe") -> list[int] | None:
        """`batch_probe_key`: existence per key; `none` leases nothing (Mooncake >= 0.3.14)."""
        return self._call(operation, keys,
                          lambda: self._store.batch_probe_key(list(keys), policy, candidate_size))

    def _call(self, operation: str, keys: Sequence[str], rpc: Callable[[], Any]) -> list[int] | None:
        started = self._clock()
        try:
            answers = rpc()
        except Exception as error:
            self._record(operation, self._clock() - started, len(keys), status="error",
                         num_failed_keys=len(keys))
            logger.error("Mooncake %s of %d keys failed: %s", operation, len(keys), error)
            return None
        elapsed = self._clock() - started
        if not isinstance(answers, (list, tuple)) or len(answers) != len(keys):
            self._record(operation, elapsed, len(keys), status="error", num_failed_keys=len(keys))
            logger.error("Mooncake %s returned %r for %d keys", operation,
                         type(answers).__name__, len(keys))
            return None
        failed = sum(1 for answer in answers if answer < 0)
        self._record(operation, elapsed, len(keys), status="error" if failed else "ok",
                     num_failed_keys=failed)
        return [int(answer) for answer in answers]
