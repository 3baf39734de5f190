"""Whether the Mooncake client can serve a lease mode (what each mode needs is on its strategy,
`moonlease_settings.lease_modes`). Pure."""

from __future__ import annotations

from dataclasses import dataclass

from moonlease_settings.lease_modes import LEASE_MODE_KEY, LeaseMode, strategy_of


@dataclass(frozen=True)
class StoreCapabilities:
    """What the installed Mooncake client can do; detected, logged and exported at start-up."""

    mooncake_version: str
    batch_probe_key: bool
    probe_policies: tuple[str, ...]

    def supports(self, policy: str) -> bool:
        return self.batch_probe_key and policy in self.probe_policies


def missing_capability(mode: LeaseMode, capabilities: StoreCapabilities) -> str | None:
    """None when the client can serve `mode`; otherwise the start-up error, saying what to do."""
    missing = [policy for policy in strategy_of(mode).probe_policies if not capabilities.supports(policy)]
    if not missing:
        return None
    policy = missing[0]
    what = ("MooncakeDistributedStore.batch_probe_key" if policy == "none"
            else f"batch_probe_key(policy={policy!r})")
    return (f"{LEASE_MODE_KEY}={mode.value} needs Mooncake >= 0.3.14 on the master and every client ({what}); "
            f"this worker has Mooncake {capabilities.mooncake_version} without it. Upgrade Mooncake "
            f"on the master and every vLLM pod, or turn the mode off.")
