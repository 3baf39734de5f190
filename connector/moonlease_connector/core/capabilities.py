"""What each lease mode needs from the Mooncake client, decided once. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from moonlease_connector.config import LeaseMode


@dataclass(frozen=True)
class StoreCapabilities:
    """What the installed Mooncake client can do; detected, logged and exported at start-up."""

    mooncake_version: str
    batch_probe_key: bool
    probe_policies: tuple[str, ...]

    def supports(self, policy: str) -> bool:
        return self.batch_probe_key and policy in self.probe_policies


#: The `batch_probe_key` policies each mode relies on (empty: plain upstream calls only).
#: Last-hit-only also asks a lease-free question when the final-token pass depends on it.
REQUIRED_PROBE_POLICIES: dict[LeaseMode, tuple[str, ...]] = {
    LeaseMode.LEASE_ALL: (),
    LeaseMode.SELECTIVE: ("none",),
    LeaseMode.LAST_HIT_ONLY: ("LastHitOnly", "none"),
}

_SWITCH = {
    LeaseMode.SELECTIVE: "mooncake_selective_lease (or VLLM_MOONCAKE_STORE_SELECTIVE_LEASE)",
    LeaseMode.LAST_HIT_ONLY: "mooncake_kda_last_hit_only",
}


def missing_capability(mode: LeaseMode, capabilities: StoreCapabilities) -> str | None:
    """None when the client can serve `mode`; otherwise the start-up error, saying what to do."""
    missing = [policy for policy in REQUIRED_PROBE_POLICIES[mode] if not capabilities.supports(policy)]
    if not missing:
        return None
    policy = missing[0]
    what = ("MooncakeDistributedStore.batch_probe_key" if policy == "none"
            else f"batch_probe_key(policy={policy!r})")
    return (f"{_SWITCH[mode]} needs Mooncake >= 0.3.14 on the master and every client ({what}); "
            f"this worker has Mooncake {capabilities.mooncake_version} without it. Upgrade Mooncake "
            f"on the master and every vLLM pod, or turn the mode off.")
