"""Store handles for the benchmarks: in-memory, counting, and a fresh real Mooncake store.

`DictStore` answers from a set (no leases, no time): the never-evicting store of the ideal
replay and the Belady simulation. `CountingStore` wraps any store and counts a lookup's RPCs.
`MooncakeBed` starts a real master + store pool on loopback and connects an in-process client
(I/O; stop it with `close()`, which stops the servers by PID).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any


class DictStore:
    """In-memory store: existence answers from a set; leases are not modelled (no time).

    `LastHitOnly` probes answer per key, like Mooncake 0.3.14 (NOTES §3).
    """

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self.keys = set(keys)

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        present = self.keys
        return [1 if key in present else 0 for key in keys]

    def batch_probe_key(self, keys: list[str], policy: str = "none", candidate_size: int = 1) -> list[int]:
        present = self.keys
        return [1 if key in present else 0 for key in keys]

    def put_batch(self, keys: list[str], values: list[bytes], config: Any = None) -> int:
        self.keys.update(keys)  # no eviction here, so a soft pin changes nothing
        return 0

    def put(self, key: str, value: bytes) -> int:
        self.keys.add(key)
        return 0

    def remove(self, key: str, force: bool = False) -> int:
        self.keys.discard(key)
        return 0


class CountingStore:
    """Counts the lookup's RPCs and the keys they carry; forwards to the real store."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.rpcs = 0
        self.keys_sent = 0
        self.lease_rpcs = 0
        self.probe_rpcs = 0

    def reset(self) -> None:
        self.rpcs = self.keys_sent = self.lease_rpcs = self.probe_rpcs = 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self.rpcs += 1
        self.lease_rpcs += 1
        self.keys_sent += len(keys)
        return self.inner.batch_is_exist(keys)

    def batch_probe_key(self, keys: list[str], policy: str = "none", candidate_size: int = 1) -> list[int]:
        self.rpcs += 1
        self.probe_rpcs += 1
        self.keys_sent += len(keys)
        return self.inner.batch_probe_key(keys, policy, candidate_size)

    # Not lookup RPCs: the last-hit-only contract probe writes and removes its own keys.
    def put(self, key: str, value: bytes) -> int:
        return self.inner.put(key, value)

    def remove(self, key: str, force: bool = False) -> int:
        return self.inner.remove(key, force)


class MooncakeBed:
    """A fresh real master + store pool + in-process client (the test bed's parts)."""

    def __init__(self, *, segment_mib: int, lease_ttl_ms: int, log_dir: Path,
                 watermark: float | None = None, eviction_ratio: float | None = None,
                 soft_pin_ttl_ms: int | None = None) -> None:
        from moonlease_dev.testbed.mooncake import (
            MasterSettings,
            MooncakeMaster,
            StorePool,
            connect_store_client,
        )

        settings = MasterSettings(eviction_high_watermark_ratio=watermark,
                                  eviction_ratio=eviction_ratio, default_kv_lease_ttl=lease_ttl_ms,
                                  default_kv_soft_pin_ttl=soft_pin_ttl_ms)
        self.master = MooncakeMaster(settings, log_dir=log_dir).start()
        try:
            self.pool = StorePool(self.master, segment_bytes=segment_mib << 20, log_dir=log_dir).start()
            self.client = connect_store_client(self.master)
        except BaseException:
            self.master.stop()
            raise

    def metrics(self) -> dict[str, float]:
        return self.master.metrics()

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            self.pool.stop()
            self.master.stop()


def fetch_presence(client: Any, keys: list[str]) -> bytes:
    """Lease-free existence of every key (`batch_probe_key(..., "none")` renews nothing)."""
    present = bytearray(len(keys))
    for start in range(0, len(keys), 4096):
        answers = client.batch_probe_key(list(keys[start:start + 4096]), "none", 1)
        for offset, answer in enumerate(answers):
            present[start + offset] = 1 if answer == 1 else 0
    return bytes(present)
