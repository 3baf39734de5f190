"""The compatibility gate: whether the fleet can run the policy's lease mode at all. Pure.

Checked before any change (by `core.rollout`), from the mode's strategy in the connector's
settings contract (`moonlease_settings.lease_modes`): modes that probe keys without leasing them
(`batch_probe_key`: selective, lastHitOnly) need Mooncake 0.3.14 on the master and on every
client; modes that need hybrid models (full attention + align-mode Mamba: lastHitOnly) need every
target declared hybrid (a CEL rule says so; it is checked here again for specs that bypassed it).

A version comes from what the policy declares (`master.version`, `targets[].mooncakeVersion`),
else from the image tag of an image whose name says Mooncake (`.../mooncake-master:v0.3.14`). A
vLLM image's tag is vLLM's version, not Mooncake's, so it is never read as one: an undeclared,
unreadable version refuses a mode that needs 0.3.14 rather than guessing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moonlease_settings.lease_modes import strategy_of
from moonlease_operator.api import PolicySpec, StageName

#: The first Mooncake release with batch_probe_key (Mooncake PR 3801).
PROBE_KEY_VERSION = (0, 3, 14)

_VERSION = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)(.*)$")


@dataclass(frozen=True, order=True)
class MooncakeVersion:
    """A release number with its kind: pre-releases (dev, rc, a, b) sort before the release,
    post-releases after it, so 0.3.14.dev1 < 0.3.14 < 0.3.14.post1."""

    release: tuple[int, int, int]
    rank: int  # -1 pre-release, 0 release, 1 post-release or local build
    text: str

    def at_least(self, release: tuple[int, int, int]) -> bool:
        return (self.release, self.rank) >= (release, 0)


def parse_mooncake_version(text: str | None) -> MooncakeVersion | None:
    """`0.3.14`, `v0.3.14`, `0.3.13.post1`, `0.3.14.dev20261022`, `0.3.14-rc1`; None otherwise."""
    if not text:
        return None
    match = _VERSION.match(text.strip())
    if match is None:
        return None
    major, minor, patch, rest = match.groups()
    suffix = rest.lstrip(".-+_").lower()
    if not suffix:
        rank = 0
    elif re.match(r"^(dev|rc|a|alpha|b|beta|pre)", suffix):
        rank = -1
    else:
        rank = 1
    return MooncakeVersion((int(major), int(minor), int(patch)), rank, text.strip())


def image_mooncake_version(image: str | None) -> str | None:
    """The tag of an image whose repository name mentions Mooncake, else None."""
    if not image:
        return None
    name = image.split("@", 1)[0]
    repository, _, tag = name.rpartition(":")
    if not repository or "/" in tag:  # no tag (the colon was a registry port)
        return None
    if "mooncake" not in repository.rsplit("/", 1)[-1].lower():
        return None
    return tag


@dataclass(frozen=True)
class VersionSource:
    """One workload's Mooncake version as the gate sees it."""

    stage: StageName
    kind: str
    name: str
    declared: str | None
    image: str | None


def evaluate_compatibility(spec: PolicySpec, sources: Sequence[VersionSource]) -> list[str]:
    """What stops this fleet from running `spec.connector.leaseMode`; empty when nothing does."""
    mode = spec.connector.lease_mode
    strategy = strategy_of(mode)
    problems: list[str] = []
    if spec.connector.retention_pin and spec.master.allow_evict_soft_pinned_objects is False:
        # Soft-pinned objects would leave only when their pin expires (default_kv_soft_pin_ttl):
        # with shared prefixes pinned the store can fill with them and puts fail (-200) meanwhile.
        problems.append("connector.retentionPin needs master.allowEvictSoftPinnedObjects true "
                        "(Mooncake's default): set it or turn retentionPin off")
    if spec.connector.retention_evict and spec.master.eviction_high_watermark_ratio is None:
        # The connector keeps the store under the master's watermark; an unknown one is either
        # above the real one (the master's near-random pass runs first) or below it (room wasted).
        problems.append("connector.retentionEvict needs master.evictionHighWatermarkRatio declared "
                        "(the connector keeps the store under it; Mooncake's default is 0.9)")
    if strategy.needs_hybrid_model:
        problems.extend(f"targets[{i}] is not declared hybrid: {mode.value} needs full attention +"
                        f" align-mode Mamba" for i, t in enumerate(spec.targets) if not t.hybrid)
    if not strategy.needs_probe_key():
        return problems
    wanted = ".".join(map(str, PROBE_KEY_VERSION))
    for source in sources:
        where = "the master" if source.stage is StageName.MASTER else f"{source.stage.value} target"
        text = source.declared or image_mooncake_version(source.image)
        version = parse_mooncake_version(text)
        if version is None:
            field = "spec.master.version" if source.stage is StageName.MASTER else "spec.targets[].mooncakeVersion"
            problems.append(f"{source.kind}/{source.name} ({where}): Mooncake version unknown; {mode.value}"
                            f" needs >= {wanted}: declare it in {field}")
        elif not version.at_least(PROBE_KEY_VERSION):
            problems.append(f"{source.kind}/{source.name} ({where}) runs Mooncake {version.text}; {mode.value}"
                            f" needs >= {wanted} (batch_probe_key)")
    return problems


def container_image(obj: Mapping[str, Any], container: str | None) -> str | None:
    containers = ((obj.get("spec") or {}).get("template") or {}).get("spec", {}).get("containers") or []
    found = containers[0] if container is None and containers else next(
        (c for c in containers if c.get("name") == container), None)
    return None if found is None else found.get("image")
