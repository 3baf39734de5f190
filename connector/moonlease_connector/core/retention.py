"""Moonlease retention (issue 21): how a save asks the store to keep what it writes.

Pure: no vLLM, no Mooncake. The adapters hand in the chunks a save would write and the
chunks a continuation of the same prompt would load; the decision about each chunk lives here.

Why. A lease mode only changes which keys a lookup renews. Mooncake gives a save two more
levers (`../shared/NOTES.md` §3, Mooncake 0.3.14's `ReplicateConfig.soft_pin_action`):
- a put can soft-pin the object: the master's eviction skips soft-pinned objects in its first
  pass and takes them only when unpinned, lease-expired objects cannot free enough (second
  pass, oldest lease first, and only with ``allow_evict_soft_pinned_objects``); every lease
  renews the pin (``default_kv_soft_pin_ttl``);
- a save may simply not write a chunk.
Without pins the first pass picks, shard by shard, the oldest lease-expired object of each
shard: with few objects per shard that is close to random, so the state a session's next turn
resumes from is as likely to go as a sliding-window tail or Mamba checkpoint nobody will read.

The resume set. A conversation's next turn (or a branch of it, or a sibling that shares the
prompt) looks the prompt up again and loads exactly what vLLM's load rule reads for a hit at
the prompt's end (``coord.load_mask``) — and an exact re-send of a block-aligned prompt (a
retry, a regeneration) one block lower, where vLLM re-derives a hit covering the whole prompt
so that the last token is recomputed (`resume_ends`): every full-attention block, the sliding-window blocks
inside the window before that end, the Mamba state at that end. The adapters compute that set
with vLLM's own rule (and add the loads at the request's shared-prefix junctions, where a
sibling will resume); everything else a save writes — window blocks and recurrent
checkpoints inside the prompt, kept by dense retention — is only read by a request that
diverges exactly there.

Pieces (each a connector setting, off by default; docs/benchmarks.md "Choosing a retention policy"):
- ``pin``: put the prompt's *shared* prefix soft-pinned — the deepest prefix four different
  continuations have followed (`core.shared_prefix`: a system prompt, a branch point), with
  what a hit there loads — and everything else unpinned, so eviction takes the rest first.
  The first cut pinned the whole resume set; with most objects pinned, eviction fell to the
  master's second pass (strict oldest-lease-first across the store), which under pressure
  evicts each conversation just before its next turn: it lost 3 to 47 points
  (`git show 5cab163:benchmarks/results/retention.md`). Pins age out: every lease renews one for
  ``default_kv_soft_pin_ttl``, so a prefix nobody reads again is unpinned after that;
- ``skip``: do not write window blocks or recurrent states outside the resume set (and the
  shared prefix) at all (they stay out of the store: bytes for more sessions). Full-attention blocks are never
  skipped: every longer prompt over them reads them.
- ``retry``: put again, once the master has evicted, the keys a put was refused for lack of
  space (`core.put_retry`) — every full-attention and window chunk, recurrent states only in
  the resume set or shared prefix (`SaveRetentionPlan.retried`).
- ``evict``: before a save's put would take the store above the master's eviction watermark,
  remove the keys this connector's saves and loads touched least recently, so conversations leave whole
  and oldest first instead of by the master's near-random first pass (`core.store_room`) —
  never the shared prefix, which other engines on the store read.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import Enum

from moonlease_settings.retention import RetentionSettings


class ChunkKind(str, Enum):
    """What a stored chunk holds, as far as retention cares."""

    FULL = "full"  # full attention: read by every longer prompt over it
    WINDOW = "window"  # a sliding-window block: read only near the end of a hit
    RECURRENT = "recurrent"  # a Mamba state: read only by a hit ending exactly there


class ChunkRetention(str, Enum):
    """How a save writes one chunk."""

    PINNED = "pinned"  # put with soft pin
    PLAIN = "plain"  # put as upstream does (no pin)
    SKIPPED = "skipped"  # not written, not re-checked


@dataclass(frozen=True)
class SaveChunk:
    """One group's chunk that a save would write (or re-check), identified by group and index."""

    group_id: int
    chunk: int
    kind: ChunkKind


@dataclass(frozen=True)
class SaveRetentionPlan:
    """Per chunk of the save, in the order given: how to write it.

    `retried[i]` (with ``retry``; empty otherwise): whether chunk i is put again when the
    store refuses it for lack of space — only what a continuation reads (`plan_save_retention`).
    """

    decisions: tuple[ChunkRetention, ...]
    retried: tuple[bool, ...] = ()
    #: With ``evict`` (empty otherwise): whether chunk i is in the prompt's shared prefix,
    #: which the connector's own eviction leaves alone (`core.store_room`).
    shared: tuple[bool, ...] = ()

    def count(self, decision: ChunkRetention) -> int:
        return sum(1 for d in self.decisions if d is decision)


def resume_ends(num_tokens: int, alignment: int, resend_end: int,
                junctions: Collection[int] = ()) -> tuple[int, ...]:
    """Where the hits that resume this prompt end, in tokens (ascending, each > 0).

    - the prompt's end aligned down to `alignment` (the coordinator's lcm block): what a longer
      prompt over this one (the next turn, the prompt plus its generated tokens) hits;
    - when that end is the prompt's own end (a block-aligned prompt), `resend_end`: the hit an
      exact re-send of the prompt computes. vLLM recomputes the last token, so a hit covering
      the whole prompt is re-derived at `num_tokens - 1` aligned down (the coordinator's
      `align_lookup_length`) — one block lower, on states the end alone would not keep;
    - each shared-prefix junction inside the prompt, aligned the same way (a sibling's hit).
    """
    end = num_tokens // alignment * alignment
    ends = {end, *(j // alignment * alignment for j in junctions if 0 < j <= num_tokens)}
    if end >= num_tokens:
        ends.add(resend_end)
    return tuple(sorted(e for e in ends if e > 0))


def plan_save_retention(chunks: Sequence[SaveChunk], resume_set: Collection[tuple[int, int]],
                        settings: RetentionSettings,
                        shared_set: Collection[tuple[int, int]] = frozenset()) -> SaveRetentionPlan:
    """Decide, for each chunk a save writes, whether it is pinned, plain or skipped.

    `resume_set` holds the `(group_id, chunk)` pairs a continuation of this prompt loads (the
    adapters' `load_mask` at the prompt's end and at its junctions); `shared_set` the pairs a
    hit at the end of the prompt's shared prefix loads (empty when nothing is shared). With
    ``pin`` the shared set is pinned; with ``skip`` window and recurrent chunks in neither set
    are skipped. Full-attention chunks are never skipped. With ``retry`` the plan also says
    which chunks are put again after a refusal (`SaveRetentionPlan.retried`), with ``evict``
    which are shared (`SaveRetentionPlan.shared`).
    """
    decisions = []
    retried = []
    for chunk in chunks:
        key = (chunk.group_id, chunk.chunk)
        # `retry` re-puts full-attention and window blocks, but recurrent states only in the
        # resume set or the shared prefix: re-putting dense retention's intermediate Mamba states
        # (4x a block each) took room from conversations (hybrid trace at 0.05: -0.8 points over
        # three runs, `git show a7dea1c:benchmarks/results/retention_retry_spread_hybrid.md`).
        # Window blocks stay retried: under sparse retention the tails a save writes end at the
        # replay boundary (align(prompt - 1): where the same prompt resumes), which the resume
        # set, taken at the prompt's end, does not hold.
        retried.append(settings.retry and (chunk.kind is not ChunkKind.RECURRENT or key in resume_set
                                           or key in shared_set))
        if settings.pin and key in shared_set:
            decisions.append(ChunkRetention.PINNED)
        elif key in resume_set or key in shared_set:
            decisions.append(ChunkRetention.PLAIN)
        elif settings.skip and chunk.kind is not ChunkKind.FULL:
            decisions.append(ChunkRetention.SKIPPED)
        else:
            decisions.append(ChunkRetention.PLAIN)
    shared = tuple((chunk.group_id, chunk.chunk) in shared_set for chunk in chunks) if settings.evict else ()
    return SaveRetentionPlan(tuple(decisions), tuple(retried) if settings.retry else (), shared)
