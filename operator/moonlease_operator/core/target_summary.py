"""The bounded per-target part of a policy's status (issue 16). Pure.

A policy may cover thousands of workloads; one entry each would make its status grow past what
the API server stores (1.5 MiB) and what is worth writing on every change. So the status keeps
counts per stage and phase for the whole fleet, and lists only the workloads that need
attention — any phase but Ready, or a refused write — at most `limit` of them: refused writes
and failures first (what a person must act on), then the rest, each group in fleet order (the
master first). Every workload's own state stays on its labels and annotations, which
`moonlease status NAME --targets` reads.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from moonlease_operator.api import StageName, TargetCount, TargetPhase, TargetStatus

DEFAULT_LISTED_TARGETS = 20
LISTED_TEXT_LIMIT = 1024
"""Characters of a listed target's message and write error (the API allows 32 KiB and 4 KiB):
20 targets then stay within ~50 KiB of status whatever they say."""
_URGENT = (TargetPhase.FAILED, TargetPhase.EXCLUDED)


@dataclass(frozen=True)
class TargetSummary:
    """What the status says about the targets: the listed ones, the counts, how many are left out."""

    listed: tuple[TargetStatus, ...]
    counts: tuple[TargetCount, ...]
    total: int
    omitted: int


def needs_attention(target: TargetStatus) -> bool:
    """Listed in the status: anything but a Ready workload whose last write went through."""
    return target.phase is not TargetPhase.READY or bool(target.write_error)


def build_target_summary(targets: Sequence[TargetStatus], limit: int = DEFAULT_LISTED_TARGETS) -> TargetSummary:
    """Counts of every target per (stage, phase) in stage then phase order, and the first `limit`
    targets that need attention (see the module docstring), kept in fleet order."""
    if limit < 0:
        raise ValueError(f"limit must be >= 0, not {limit}")
    attention = [(i, t) for i, t in enumerate(targets) if needs_attention(t)]
    urgent = [(i, t) for i, t in attention if t.write_error or t.phase in _URGENT]
    rest = [(i, t) for i, t in attention if not (t.write_error or t.phase in _URGENT)]
    chosen = sorted((urgent + rest)[:limit], key=lambda pair: pair[0])
    stage_rank = {stage: n for n, stage in enumerate(StageName)}
    phase_rank = {phase: n for n, phase in enumerate(TargetPhase)}
    tally = Counter((t.role, t.phase) for t in targets)
    counts = tuple(TargetCount(role=role, phase=phase, count=n) for (role, phase), n in
                   sorted(tally.items(), key=lambda item: (stage_rank[item[0][0]], phase_rank[item[0][1]])))
    return TargetSummary(listed=tuple(_shortened(t) for _, t in chosen), counts=counts, total=len(targets),
                         omitted=len(attention) - len(chosen))


def _shortened(target: TargetStatus) -> TargetStatus:
    update: dict[str, str] = {}
    if len(target.message) > LISTED_TEXT_LIMIT:
        update["message"] = target.message[:LISTED_TEXT_LIMIT - 1] + "…"
    if target.write_error and len(target.write_error) > LISTED_TEXT_LIMIT:
        update["write_error"] = target.write_error[:LISTED_TEXT_LIMIT - 1] + "…"
    return target.model_copy(update=update) if update else target
