"""The plan's data types: one object to change and how. Pure data.

The rollout planner (`core.rollout`) decides `WorkloadChange`s; the slot editor
(`core.slots.build_update`) turns one into the new object; the workload adapter writes it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

Wrapped = dict[str, Any] | None
"""A slot's value: `{"v": value}` when present, None when absent (so "absent" can be restored)."""
JsonObj = dict[str, Any]


class ChangeAction(str, enum.Enum):
    APPLY = "apply"  # write the desired slots (recording original and rollback snapshots)
    ROLLBACK = "rollback"  # restore the rollback snapshot of this attempt
    RELEASE = "release"  # restore the original snapshot and drop our bookkeeping
    FORGET = "forget"  # drop our bookkeeping only; the settings stay (a master kept on deletion)


@dataclass(frozen=True)
class WorkloadChange:
    """One object to change and how; `build_update` turns it into the new object.

    `place` is the container (workloads) or data key (ConfigMaps) the slots live in.
    `require_annotation`: the pod template must carry `config_hash` even when every other slot
    is in sync (the master whose settings live in a ConfigMap restarts through it).
    `create_from`: see the field.
    """

    kind: str
    name: str
    action: ChangeAction
    policy: str
    place: str | None = None
    desired: Mapping[str, Wrapped] = field(default_factory=dict)
    config_hash: str | None = None
    require_annotation: bool = False
    revision: int = 0
    applied_revision: int | None = None
    create_from: Mapping[str, Any] | None = None
    """The object to create (then change) when it does not exist: a workload's connector
    settings ConfigMap. None: a missing object is left alone."""

    @property
    def ref(self) -> tuple[str, str]:
        return (self.kind, self.name)
