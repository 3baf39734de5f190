"""Mooncake client binding: the store calls a lookup makes, timed, recorded, never raising.

I/O adapter around a `MooncakeDistributedStore` handle. Errors are data (STYLE.md): a raising
RPC or a malformed reply comes back as `None`, which the lookup reports as a miss, so the lookup
server thread never dies on a store failure.
"""

from __future__ import annotations

import copy
import importlib.metadata
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from moonlease_connector.core.capabilities import StoreCapabilities
from moonlease_connector.core.last_hit import (
    CONTRACT_PROBE_STORED,
    CheckpointCandidates,
    ProbeContract,
    Selection,
    contract_from_probe,
    select_checkpoint,
)
from moonlease_settings.lease_modes import LAST_HIT_ONLY_POLICY
from moonlease_connector.core.lookup import has_error_code

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

    @property
    def store(self) -> Any:
        """The client handle the calls go to."""
        return self._store

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
        if type(answers) is not list:  # Mooncake's binding answers a list of int already
            answers = list(map(int, answers))
        failed = sum(1 for answer in answers if answer < 0) if has_error_code(answers) else 0
        self._record(operation, elapsed, len(keys), status="error" if failed else "ok",
                     num_failed_keys=failed)
        return answers


#: How long after a detection attempt another may run (a misfitting answer or a failed
#: detection must not turn every lookup into three more RPCs).
CONTRACT_REDETECT_INTERVAL_S = 5.0


class ProbeContractDetector:
    """Which LastHitOnly response contract the store follows, detected from its behaviour.

    `detect` writes two keys of its own (a per-worker namespace no model key can share), asks
    `batch_probe_key([stored, stored, never stored], "LastHitOnly", 1)` and removes them (forced:
    the store leases the candidate it selects); `core.last_hit.contract_from_probe` reads the
    answer. The result is cached; `read` re-detects (at most every `redetect_interval_s`) when
    no contract is known yet or when a well-formed answer stops fitting the cached one, and
    re-reads that answer under the contract found. Store failures are logged, never raised.
    """

    def __init__(self, store: Any, *, clock: Callable[[], float] = time.monotonic,
                 redetect_interval_s: float = CONTRACT_REDETECT_INTERVAL_S,
                 key_prefix: str | None = None) -> None:
        self._store = store
        self._clock = clock
        self._interval = redetect_interval_s
        self._prefix = key_prefix or f"moonlease-contract-probe@{uuid.uuid4().hex}"
        self._lock = threading.Lock()
        self._contract: ProbeContract | None = None
        self._last_attempt: float | None = None

    @property
    def contract(self) -> ProbeContract | None:
        return self._contract

    def detect(self) -> ProbeContract | None:
        """Probe the store now; cache and return the contract (None: undetermined)."""
        with self._lock:
            return self._detect_locked()

    def read(self, candidates: CheckpointCandidates, answers: Sequence[int] | None) -> Selection:
        """The selected checkpoint under the store's contract, re-detecting it when needed."""
        contract = self._contract
        if contract is None:
            contract = self._detect_if_due()
            if contract is None:
                return Selection(None, "the store's LastHitOnly response contract is not known "
                                       "(detection failed; retried at most every "
                                       f"{self._interval:g} s)")
        selection = select_checkpoint(candidates, answers, contract)
        if not selection.contract_misfit:
            return selection
        redetected = self._detect_if_due()
        if redetected is None or redetected is contract:
            return selection
        return select_checkpoint(candidates, answers, redetected)

    def _detect_if_due(self) -> ProbeContract | None:
        with self._lock:
            if self._last_attempt is not None and self._clock() - self._last_attempt < self._interval:
                return None
            return self._detect_locked()

    def _detect_locked(self) -> ProbeContract | None:
        self._last_attempt = self._clock()
        keys = [f"{self._prefix}@{index}" for index in range(len(CONTRACT_PROBE_STORED))]
        stored = [key for key, write in zip(keys, CONTRACT_PROBE_STORED, strict=True) if write]
        answers: list[int] | None = None
        try:
            for key in stored:
                code = self._store.put(key, b"moonlease LastHitOnly contract probe")
                if code != 0:
                    raise RuntimeError(f"put of {key} returned {code}")
            answers = list(self._store.batch_probe_key(keys, LAST_HIT_ONLY_POLICY, 1))
        except Exception as error:
            logger.warning("LastHitOnly contract probe failed: %s", error)
        finally:
            for key in stored:
                try:
                    self._store.remove(key, True)
                except Exception as error:  # the keys are tiny and expire with eviction
                    logger.warning("could not remove contract probe key %s: %s", key, error)
        contract = contract_from_probe(answers)
        if contract is None:
            logger.warning("LastHitOnly contract undetermined (answer %r to a probe of %s); "
                           "last-hit-only lookups miss until it is detected", answers,
                           list(CONTRACT_PROBE_STORED))
            return None
        if contract is not self._contract:
            logger.info("Mooncake store answers LastHitOnly probes with %s (was %s)", contract.value,
                        self._contract.value if self._contract else "unknown")
        self._contract = contract
        return contract


class SoftPinUnsupported(RuntimeError):
    """The Mooncake client cannot soft-pin on put (retention `pin` needs it)."""


#: `ReplicateConfig` fields that hold one entry per key of the batch (Mooncake 0.3.14 refuses a
#: batch whose list is not as long as its keys, every key with INVALID_PARAMS).
PER_KEY_CONFIG_FIELDS = ("group_ids", "per_key_preferred_hca_names")


def _copy_config(base: Any) -> Any:
    """A field-by-field copy (Mooncake's `ReplicateConfig` cannot be pickled or copied)."""
    from mooncake.store import ReplicateConfig

    if not isinstance(base, ReplicateConfig):
        return copy.copy(base)  # a test double: its own copy semantics
    config = ReplicateConfig()
    for name in dir(base):
        value = getattr(base, name)
        if name.startswith("_") or callable(value):
            continue
        try:
            setattr(config, name, value)
        except (AttributeError, TypeError):  # read-only in this client version
            continue
    return config


def config_for_keys(base: Any | None, indices: Sequence[int], batch_len: int) -> Any | None:
    """`base` for a put of `indices` of a batch of `batch_len` keys: its per-key lists cut to
    those keys (upstream sets `group_ids` on the whole batch; retention puts parts of it)."""
    if base is None or (len(indices) == batch_len and list(indices) == list(range(batch_len))):
        return base
    cut = {name: [value[i] for i in indices] for name in PER_KEY_CONFIG_FIELDS
           if isinstance(value := getattr(base, name, None), list) and len(value) == batch_len}
    if not cut:
        return base
    config = _copy_config(base)
    for name, value in cut.items():
        setattr(config, name, value)
    return config


def build_soft_pin_config(base: Any | None = None) -> Any:
    """A `ReplicateConfig` like `base` (every field, per-key lists included) whose puts soft-pin.

    Mooncake 0.3.14 spells it `soft_pin_action = SoftPinAction.ENABLE` (the master then keeps
    the object pinned for `default_kv_soft_pin_ttl`, renewed by every lease); older clients
    `with_soft_pin = True`. Raises `SoftPinUnsupported` for a client with neither.
    """
    from mooncake.store import ReplicateConfig

    config = _copy_config(base) if isinstance(base, ReplicateConfig) else ReplicateConfig()
    if hasattr(config, "soft_pin_action"):
        import mooncake.store as store_module

        config.soft_pin_action = store_module.SoftPinAction.ENABLE
    elif hasattr(config, "with_soft_pin"):
        config.with_soft_pin = True
    else:
        raise SoftPinUnsupported("this Mooncake client's ReplicateConfig has neither soft_pin_action "
                                 "nor with_soft_pin: mooncake_retention_pin needs Mooncake >= 0.3.14")
    return config
