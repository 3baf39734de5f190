"""Lookup planning: candidate keys, existence → present units, the hit's tail keys.

Pure: no vLLM, no Mooncake. The vLLM adapter supplies each group's key namespaces and the
chunk hashes to check (from vLLM's own lookup masks), and vLLM's coordinator decides the hit
length from the present units; everything around that decision lives here, so every lease mode
shares one candidate order and one notion of "present".

Conventions (upstream's, kept exactly so the default mode issues the same store calls):
- candidates are ordered group-major, then chunk, then rank namespace;
- a `(group, hash)` unit is present only when *every* namespace key of it exists (a store
  answer other than 1 — missing or an error code — counts as absent);
- a store key is `f"{namespace_prefix}@{hash.hex()}"`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

#: A `(group_id, chunk hash)` pair: the unit vLLM's hit rule reasons about.
Unit = tuple[int, bytes]


@dataclass(frozen=True)
class GroupNamespaces:
    """One KV-cache group as the store sees it: its block size and rank namespaces."""

    group_id: int
    block_size: int
    key_prefixes: tuple[str, ...]
    is_recurrent: bool = False  # Mamba / linear attention: one state per boundary
    #: `prefix + "@"` per namespace, built once: a lookup builds hundreds of keys per call.
    _heads: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_heads", tuple(prefix + "@" for prefix in self.key_prefixes))

    def keys_for(self, chunk_hash: bytes) -> tuple[str, ...]:
        """`store_key` in every namespace, the hash's hex computed once."""
        hex_hash = chunk_hash.hex()
        return tuple([head + hex_hash for head in self._heads])


@dataclass(frozen=True)
class CandidateSet:
    """The keys a lookup asks the store about, and which unit each run of keys belongs to."""

    keys: tuple[str, ...]
    units: tuple[Unit, ...]
    namespaces_per_unit: tuple[int, ...]
    #: Per group, in `keys` order: where its run starts in `keys` and in `units`, and how many
    #: units it has (`GroupRun`). Lets a later call reuse these keys by slicing.
    group_runs: tuple[GroupRun, ...] = ()

    def __len__(self) -> int:
        return len(self.keys)


@dataclass(frozen=True)
class GroupRun:
    """One group's run of candidates: units `first_unit ..` with keys `first_key ..`, each unit
    spanning `namespaces` keys (one per rank namespace), `units` of them."""

    group_id: int
    first_key: int
    first_unit: int
    units: int
    namespaces: int


def build_candidates(groups: Sequence[GroupNamespaces],
                     chunk_hashes: Mapping[int, Sequence[bytes]]) -> CandidateSet:
    """Expand each group's chunk hashes (`bytes`) across its namespaces, group-major (upstream
    order)."""
    keys: list[str] = []
    units: list[Unit] = []
    spans: list[int] = []
    runs: list[GroupRun] = []
    for group in groups:
        group_hashes = chunk_hashes.get(group.group_id, ())
        heads = group._heads
        runs.append(GroupRun(group.group_id, len(keys), len(units), len(group_hashes), len(heads)))
        # One comprehension per group: a lookup builds hundreds of keys, and this is most of
        # its own time (`head + h.hex()` inline beats `map(head.__add__, ...)`'s bound calls).
        if len(heads) == 1:
            head = heads[0]
            keys.extend([head + chunk_hash.hex() for chunk_hash in group_hashes])
        else:
            keys.extend([head + hex_hash for hex_hash in map(bytes.hex, group_hashes) for head in heads])
        units.extend(zip(itertools.repeat(group.group_id, len(group_hashes)), group_hashes))
        spans.extend([len(heads)] * len(group_hashes))
    return CandidateSet(tuple(keys), tuple(units), tuple(spans), tuple(runs))


def present_units(candidates: CandidateSet, answers: Sequence[int]) -> frozenset[Unit]:
    """Units whose every namespace key the store answered 1 for.

    A short or long answer list is a broken reply, not a partial one: it yields no units,
    which the caller reports as a miss.
    """
    if len(answers) != len(candidates.keys):
        return frozenset()
    if len(candidates.units) == len(answers):  # one namespace per unit: answers line up
        return frozenset(itertools.compress(candidates.units, map((1).__eq__, answers)))
    present: list[Unit] = []
    position = 0
    for unit, span in zip(candidates.units, candidates.namespaces_per_unit, strict=True):
        end = position + span
        if answers[position:end].count(1) == span:
            present.append(unit)
        position = end
    return frozenset(present)


def has_error_code(answers: Sequence[int]) -> bool:
    """Whether a store answer holds an error code (a negative value). The usual answer is all
    0s and 1s, told by two counts (C loops, no comparison per value); any other is scanned."""
    if answers.count(1) + answers.count(0) == len(answers):
        return False
    return bool(answers) and min(answers) < 0


def leading_present_run(candidates: CandidateSet, answers: Sequence[int]) -> int | None:
    """`n` when the present units are exactly the first `n` (one namespace per unit): then
    `present_units` is `units[:n]` and their keys are `keys[:n]`, read without a pass per key
    (the common shape of a KV answer: a stored prefix, nothing stored past it). None otherwise
    (a hole, several namespaces per unit, a broken reply): read them with `present_units`.
    """
    if len(answers) != len(candidates.keys) or len(candidates.units) != len(answers):
        return None
    count = answers.count(1)
    return count if answers[:count].count(1) == count else None


@dataclass(frozen=True)
class TailKey:
    """The token boundary whose prefix hash keys a group's last loaded block.

    With partial-hash hits the hit may end inside a block that was stored under a later hash;
    the loader must read that block under this boundary's hash (upstream `TailKeyBoundary`).
    """

    group_id: int
    num_tokens: int


class TailKeyMissing(LookupError):
    """A hit was reported for a group that has no stored key covering it (a rule violation)."""


def build_tail_keys(groups: Sequence[GroupNamespaces], block_hashes: Sequence[bytes],
                    hash_block_size: int, hit_length: int,
                    is_present: Callable[[int, bytes], bool]) -> tuple[TailKey, ...]:
    """Per group, the boundary whose hash keys the block that contains the hit's last token.

    Usually that is the hit itself; with partial-hash hits the block may have been stored
    under the first later hash inside the same block that is present.
    """
    if hit_length <= 0:
        return ()
    tails: list[TailKey] = []
    hit_hash_index = hit_length // hash_block_size - 1
    for group in groups:
        boundary = hit_length
        if not is_present(group.group_id, bytes(block_hashes[hit_hash_index])):
            chunk_index = -(-hit_length // group.block_size) - 1
            next_chunk_hash_index = min((chunk_index + 1) * group.block_size // hash_block_size,
                                        len(block_hashes))
            for hash_index in range(hit_hash_index + 1, next_chunk_hash_index):
                if is_present(group.group_id, bytes(block_hashes[hash_index])):
                    boundary = (hash_index + 1) * hash_block_size
                    break
            else:
                raise TailKeyMissing(f"no stored key covers group {group.group_id} at hit length "
                                     f"{hit_length}")
        tails.append(TailKey(group.group_id, boundary))
    return tuple(tails)


def resolve_hit(num_tokens: int, lookup_length: int, longest_hit: Callable[[int], int],
                align: Callable[[int], int]) -> int:
    """The hit to report: vLLM's longest hit, shortened when it would cover every token.

    The last prompt token must be recomputed to sample from it, so a hit covering all
    `num_tokens` is re-derived at `align(num_tokens - 1)` (upstream's rule).
    """
    hit = longest_hit(lookup_length)
    if hit >= num_tokens:
        usable = align(num_tokens - 1)
        if usable <= 0:
            return 0
        hit = longest_hit(usable)
    return hit


class MissReason(str, Enum):
    """Why a lookup reported no hit (the `reason` label of the miss counter)."""

    NO_CANDIDATES = "no_candidates"  # prompt shorter than one aligned block: nothing to ask
    NOT_FOUND = "not_found"  # the store holds no usable prefix
    STORE_ERROR = "store_error"  # an RPC raised or returned a malformed or error reply
    STORE_TIMEOUT = "store_timeout"  # no answer within mooncake_lookup_timeout_ms, or an
    #                                   earlier abandoned store call has not returned yet
    LEASE_LOST = "lease_lost"  # keys vanished between probe and lease in every round
    INTERNAL_ERROR = "internal_error"  # a bug caught by the lookup guard (logged with a trace)


def miss_reason_of(answers: Sequence[int]) -> MissReason:
    """Why a lookup whose store answered `answers` found nothing: a store that answered any
    key with an error code (Mooncake's negative codes: -900 while the master is unreachable)
    failed, rather than holding no prefix."""
    return MissReason.STORE_ERROR if answers and min(answers) < 0 else MissReason.NOT_FOUND


@dataclass(frozen=True)
class LookupOutcome:
    """What one lookup did, for metrics: the hit, or why it missed, and what it touched."""

    hit_tokens: int
    miss_reason: MissReason | None
    rounds: int
    keys_probed: int
    keys_leased: int
    junctions: int = 0  # shared-prefix junctions the lookup returned (seed 004)

    @classmethod
    def miss(cls, reason: MissReason, *, rounds: int = 0, keys_probed: int = 0,
             keys_leased: int = 0) -> LookupOutcome:
        return cls(0, reason, rounds, keys_probed, keys_leased)
