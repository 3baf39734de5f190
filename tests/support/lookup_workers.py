"""Test-only recorders around the lookups of `moonlease_dev.bench.workers`.

The lookups themselves (layouts, `build_lookup`, `build_upstream_lookup`, `keys_the_load_reads`)
are product code of `moonlease bench`; this module re-exports them for the tests and adds stores
that record every call, a recorder of store-call metrics, and the universe of keys random
existence patterns are drawn over.

`build_lookup` builds the lookup without its deadline unless the test keeps the settings' own
(`keep_deadline=True`): these tests compare hits and leases, and on a loaded machine a 1 s
deadline turns a hit into a `store_timeout` miss (a CI run on a loaded 2-core machine failed the
last-hit-only property test that way, when only lease modes had the deadline removed). The
deadline's own tests pass `keep_deadline=True` with the timeout they test (0 included).
"""

from __future__ import annotations

from typing import Any

from moonlease_dev.bench import workers as _workers
from moonlease_dev.bench.workers import (  # noqa: F401  (re-exported for the tests)
    HASH_BLOCK,
    LAYOUTS,
    CLIENT_0_3_14,
    Layout,
    LayoutParts,
    build_layout_parts,
    build_upstream_lookup,
    full_attention,
    keys_the_load_reads,
    layout_by_name,
    mamba_align,
    sliding_window,
)
from moonlease_connector.adapters.vllm_lookup import StoreLookup
from moonlease_settings.config import LeaseMode, MoonleaseConnectorConfig


def build_lookup(layout: Layout | LayoutParts, store: Any,
                 settings: MoonleaseConnectorConfig | LeaseMode | None = None, *,
                 junction_retention: bool = False, keep_deadline: bool = False, **kwargs: Any) -> StoreLookup:
    """`moonlease_dev.bench.workers.build_lookup`, without the deadline unless `keep_deadline` (see above)."""
    if not isinstance(settings, MoonleaseConnectorConfig):
        settings = MoonleaseConnectorConfig.for_mode(
            settings or LeaseMode.LEASE_ALL, junction_retention=junction_retention)
    if not keep_deadline:
        settings = settings.model_copy(update={"mooncake_lookup_timeout_ms": 0})
    return _workers.build_lookup(layout, store, settings, **kwargs)


class RecordingStore:
    """Answers batch_is_exist from a fixed pattern and records every call."""

    def __init__(self, answer_for: dict[str, int]) -> None:
        self.answer_for = answer_for
        self.calls: list[tuple[str, tuple[str, ...]]] = []

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self.calls.append(("batch_is_exist", tuple(keys)))
        return [self.answer_for.get(key, 0) for key in keys]


class PatternStore(RecordingStore):
    """A recorder that also probes: `batch_probe_key` answers like `batch_is_exist`, and each
    call records whether it leases (is_exist) or not (probe)."""

    def batch_probe_key(self, keys: list[str], policy: str = "none", candidate_size: int = 1) -> list[int]:
        self.calls.append((f"batch_probe_key:{policy}:{candidate_size}", tuple(keys)))
        return [self.answer_for.get(key, 0) for key in keys]

    def put(self, key: str, value: bytes) -> int:
        self.answer_for[key] = 1
        return 0

    def remove(self, key: str, force: bool = False) -> int:
        self.answer_for.pop(key, None)
        return 0

    def leased_keys(self) -> set[str]:
        return {key for name, keys in self.calls if name == "batch_is_exist"
                for key, answer in zip(keys, (self.answer_for.get(k, 0) for k in keys)) if answer == 1}

    def probed_keys(self) -> set[str]:
        return {key for name, keys in self.calls if name.startswith("batch_probe_key") for key in keys}


class OperationRecorder:
    """Receives every store-call record (upstream's `_record_kv_connector_operation` signature)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def __call__(self, operation: str, duration_seconds: float, num_keys: int, *,
                 num_bytes: int = 0, status: str = "ok", num_failed_keys: int = 0) -> None:
        self.records.append({"operation": operation, "num_keys": num_keys, "status": status,
                             "num_failed_keys": num_failed_keys})


def every_possible_key(layout: Layout | LayoutParts, hashes: list[bytes]) -> list[str]:
    """Every key a lookup over `hashes` could ask about (per-hash and per-chunk, all namespaces),
    sorted: the universe random existence patterns are drawn over."""
    parts = layout if isinstance(layout, LayoutParts) else build_layout_parts(layout)
    keys: set[str] = set()
    for group, prefixes in enumerate(parts.key_prefixes):
        spec = parts.coordinator.kv_cache_groups[group].kv_cache_spec
        group_hashes = parts.coordinator.block_hashes_for_spec(hashes, spec)
        for chunk_hash in list(hashes) + [group_hashes[i] for i in range(len(group_hashes))]:
            keys.update(f"{prefix}@{bytes(chunk_hash).hex()}" for prefix in prefixes)
    return sorted(keys)
