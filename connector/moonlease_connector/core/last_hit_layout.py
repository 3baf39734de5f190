"""Which models last-hit-only can serve: decided from the managers vLLM picks. Pure.

Last-hit-only (seed 000) leases one recurrent checkpoint and reads the KV evidence as upstream
does, which is only sound when every prefix-cacheable group is served by vLLM's plain
`FullAttentionManager` (a full prefix of KV blocks: `FullAttentionSpec`, `MLAAttentionSpec` and
the other specs vLLM registers to it) or by `MambaManager` in align mode (one state per block
boundary). The vLLM adapter looks each group's manager up in vLLM's own spec registry — the map
the hit rule itself dispatches through — so a spec is judged by the manager that serves it,
never by its class name: a subclass of `FullAttentionSpec` served by a different manager
(`RSWASpec`, `SinkFullAttentionSpec`, ...) is refused, and a new spec vLLM registers to
`FullAttentionManager` is accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


class ManagerKind(str, Enum):
    """What last-hit-only needs to know about the manager serving a group."""

    FULL_ATTENTION = "full_attention"  # exactly vLLM's FullAttentionManager
    RECURRENT = "recurrent"  # vLLM's MambaManager
    OTHER = "other"  # any other manager (sliding window, chunked local, R-SWA, sink, ...)
    UNREGISTERED = "unregistered"  # no manager registered for the spec


@dataclass(frozen=True)
class GroupServing:
    """One KV-cache group as the gate sees it."""

    group_id: int
    spec_name: str
    manager_name: str | None  # None: unregistered
    kind: ManagerKind
    block_size: int
    prefix_cacheable: bool = True
    mamba_cache_mode: str | None = None  # recurrent groups only


def last_hit_only_layout_problems(groups: Sequence[GroupServing], *, enable_group_semantics: bool
                                  ) -> tuple[str, ...]:
    """Why last-hit-only cannot run on this layout; empty when it can.

    Groups that opt out of prefix caching take no part in lookups (vLLM skips them too).
    """
    problems: list[str] = []
    if enable_group_semantics:
        problems.append("enable_group_semantics=true makes Mooncake lease a group's keys together "
                        "(shared group leases), which defeats leasing one checkpoint")
    recurrent_sizes: set[int] = set()
    for group in groups:
        if not group.prefix_cacheable:
            continue
        if group.kind is ManagerKind.RECURRENT:
            if group.mamba_cache_mode != "align":
                problems.append(f"group {group.group_id}: {group.spec_name} with "
                                f"mamba_cache_mode={group.mamba_cache_mode!r}, needs 'align'")
            recurrent_sizes.add(group.block_size)
        elif group.kind is ManagerKind.UNREGISTERED:
            problems.append(f"group {group.group_id}: {group.spec_name} has no KV-cache manager "
                            "registered in vLLM")
        elif group.kind is ManagerKind.OTHER:
            problems.append(f"group {group.group_id}: {group.spec_name} is served by "
                            f"{group.manager_name}, not FullAttentionManager or MambaManager "
                            "(full attention and align-mode Mamba only)")
    if not recurrent_sizes:
        problems.append("the model has no recurrent (Mamba) group: last-hit-only has nothing to select")
    if len(recurrent_sizes) > 1:
        problems.append(f"recurrent groups with different block sizes {sorted(recurrent_sizes)}")
    return tuple(problems)
