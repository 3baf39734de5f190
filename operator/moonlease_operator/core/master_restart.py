"""A master restart the operator is about to cause: what it says, and how it is approved. Pure.

Restarting mooncake_master empties the store (object metadata lives in its memory), so every
restart the operator causes — rolling settings forward (a drift repair included), rolling them
back, restoring them when the policy is deleted — is announced the same way, built here and
nowhere else: a `MasterRestart` warning event and a stage message naming the flags that change.

Approval (`spec.master.requireApprovalForRestart`) is keyed to the direction, the rollout
revision and a hash (`forward:3:ab12cd34`): of the master settings, and for a forward restart of
the flag changes and the master's generation too, so approving one restart never approves
another: not a later drift repair (a new revision at rest, a new generation while a later stage
runs), not a rollback of the same attempt (another direction).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from moonlease_operator.api import APPROVE_MASTER_RESTART_ANNOTATION, Reason
from moonlease_operator.core.events import EventNote

STORE_WIPE = "restarting the master empties the Mooncake store"


class RestartDirection(str, enum.Enum):
    """Why the master restarts: new settings, a rollback, or the policy's deletion."""

    FORWARD = "forward"
    ROLLBACK = "rollback"
    RESTORE = "restore"


_CAUSES = {
    RestartDirection.FORWARD: "apply its new settings",
    RestartDirection.ROLLBACK: "roll back its settings",
    RestartDirection.RESTORE: "get its settings back from before the policy",
}


@dataclass(frozen=True)
class MasterRestart:
    """One restart of the master workload, with the flag changes that cause it."""

    workload: str
    """`Kind/name` of the master workload."""
    direction: RestartDirection
    revision: int
    """The rollout attempt (`status.revision`) the restart belongs to."""
    settings_hash: str
    """Hash of the master settings being applied (forward: with the change and the master's
    generation) or left (rollback, restore)."""
    changes: tuple[str, ...] = ()
    """Human lines such as `--eviction_ratio: 0.05 -> 0.1` (sorted, unique)."""

    @property
    def approval_key(self) -> str:
        """The value of the approval annotation that lets exactly this restart happen."""
        return f"{self.direction.value}:{self.revision}:{self.settings_hash}"

    def describe(self, *, retry: bool = False) -> str:
        """One sentence: which workload restarts, why, with which flags, and what it costs."""
        what = "; ".join(self.changes)
        return (f"{self.workload} restarts to {_CAUSES[self.direction]}"
                + (f" ({what})" if what else "") + (" (retrying the change)" if retry else "")
                + f": {STORE_WIPE}")

    def note(self, *, retry: bool = False) -> EventNote:
        """The `MasterRestart` warning event that precedes the restart."""
        return EventNote("Warning", Reason.MASTER_RESTART.value, self.describe(retry=retry))

    def approval_request(self, policy: str) -> str:
        """What to run to approve this restart."""
        return (f"{self.describe()}. Approve with: kubectl annotate mlp {policy}"
                f" {APPROVE_MASTER_RESTART_ANNOTATION}={self.approval_key} --overwrite")

    def approved_by(self, annotations: Mapping[str, str]) -> bool:
        """Whether the policy's annotations approve exactly this restart."""
        return annotations.get(APPROVE_MASTER_RESTART_ANNOTATION) == self.approval_key


def build_master_restart(workload: str, direction: RestartDirection, revision: int, settings_hash: str,
                         changes: Sequence[str] = ()) -> MasterRestart:
    return MasterRestart(workload=workload, direction=direction, revision=revision, settings_hash=settings_hash,
                         changes=tuple(sorted(set(changes))))
