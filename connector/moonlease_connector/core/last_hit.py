"""Last-hit-only recurrent lookup (seed 000): probe the legal checkpoints, lease only the one.

Pure. For full-attention + align-mode Mamba models, upstream's lookup asks `batch_is_exist`
about every recurrent state of the prompt, so every checkpoint gets a read lease — including
states past the point the KV evidence lets the request resume from. Here:

1. the KV (full-attention) keys are looked up as upstream does; vLLM's hit rule, run with
   every recurrent state assumed present, bounds the legal checkpoints (EAGLE included, since
   it is the same rule). The final-token recompute pass is planned separately
   (`plan_hit_passes`): the hit rule is monotone in the states present at a fixed length, but
   which length upstream runs it at depends on whether the state at `num_tokens` exists;
2. the recurrent keys of those checkpoints go to the store in checkpoint-major order across the
   actual group/rank namespaces, with `batch_probe_key(keys, "LastHitOnly", candidate_size)`:
   the store leases the last complete checkpoint only. The last legal checkpoint is asked
   about alone first (`plan_checkpoint_probes`): when it is complete — every state of a fully
   stored prompt — the lookup sends its few keys instead of every checkpoint's; otherwise the
   rest go in one more probe, which selects what a single probe of all of them would;
3. the answer is validated against the store's response contract and the exact selected
   checkpoint is what the lookup returns for loading; when it is the bound itself, the hit is
   known without running the rule again (`hit_known_from_selection`).

On whole-block layouts the common case takes one store call (`plan_one_candidate_follow_up`):
the KV keys and the recurrent keys of the checkpoint a fully stored prompt resumes from go in a
single LastHitOnly candidate, which the store leases only when every key of it is present —
exactly the KV keys and the one checkpoint the steps above would lease. When it is not
complete, nothing is leased and the steps above run, helped by what a per-key answer showed.

Two response contracts exist (NOTES §3): Mooncake 0.3.14 answers per-key existence and leases
the last complete candidate; Mooncake RFC 4255 answers a selected-only mask with at most one
all-true candidate. Which one a store follows is detected from its answer to a probe of keys
the connector writes itself (`contract_from_probe`), never from a release string. Anything
outside the contract in force — wrong length, values other than 0/1, several selected
candidates under RFC 4255, error codes — is a miss, and so is a failed RPC. There is
deliberately no fallback to a lease-renewing existence check.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from moonlease_connector.core.lookup import GroupNamespaces, Unit


class ProbeContract(str, Enum):
    """How a store answers a LastHitOnly probe."""

    PER_KEY_EXISTENCE = "per-key-existence"  # Mooncake 0.3.14: 1/0 per key
    SELECTED_ONLY = "selected-only"  # Mooncake RFC 4255: 1s only on the selected candidate


#: The contract probe: three one-key candidates, the first two stored, the third never.
#: A per-key store answers (1, 1, 0); an RFC 4255 store selects the last complete one: (0, 1, 0).
CONTRACT_PROBE_STORED: tuple[bool, ...] = (True, True, False)
_CONTRACT_ANSWERS: dict[tuple[int, ...], ProbeContract] = {
    (1, 1, 0): ProbeContract.PER_KEY_EXISTENCE,
    (0, 1, 0): ProbeContract.SELECTED_ONLY,
}


def contract_from_probe(answers: Sequence[int] | None) -> ProbeContract | None:
    """The contract a store follows, read from its answer to the contract probe (pure).

    Decided by behaviour, never by release string: source builds report no version, and later
    releases may keep either contract. None when the answer fits neither (or the probe failed).
    """
    if answers is None:
        return None
    return _CONTRACT_ANSWERS.get(tuple(int(answer) for answer in answers))


@dataclass(frozen=True)
class CheckpointCandidates:
    """Recurrent keys of the legal checkpoints, checkpoint-major, `candidate_size` per checkpoint."""

    positions: tuple[int, ...]  # token positions of the checkpoints, ascending
    keys: tuple[str, ...]
    units: tuple[tuple[Unit, ...], ...]  # the recurrent units each checkpoint stands for
    candidate_size: int


def build_checkpoint_candidates(recurrent_groups: Sequence[GroupNamespaces], positions: Sequence[int],
                                state_hash: Callable[[GroupNamespaces, int], bytes]
                                ) -> CheckpointCandidates:
    """One candidate per checkpoint: every recurrent group's key in every rank namespace.

    Groups may have unequal namespace counts; the candidate size is their sum, the same for
    every checkpoint. Keys are never de-duplicated: answers are read by position, so a key that
    appears twice is simply asked about twice.
    """
    ordered = tuple(positions) if len(positions) == 1 else tuple(sorted(set(positions)))
    keys: list[str] = []
    units: list[tuple[Unit, ...]] = []
    for position in ordered:
        checkpoint_units = []
        for group in recurrent_groups:
            chunk_hash = state_hash(group, position)
            keys.extend(group.keys_for(chunk_hash))
            checkpoint_units.append((group.group_id, chunk_hash))
        units.append(tuple(checkpoint_units))
    size = sum(len(group.key_prefixes) for group in recurrent_groups)
    return CheckpointCandidates(ordered, tuple(keys), tuple(units), size)


@dataclass(frozen=True)
class Selection:
    """The checkpoint the store selected (index into the candidates), or why there is none."""

    index: int | None
    problem: str | None = None  # set when the answer broke the contract
    #: the answer was well-formed but fits another contract (re-detect the store's contract)
    contract_misfit: bool = False

    @property
    def valid(self) -> bool:
        return self.problem is None


def select_checkpoint(candidates: CheckpointCandidates, answers: Sequence[int] | None,
                      contract: ProbeContract) -> Selection:
    """Read the store's answer under `contract`; anything unexpected is a problem (a miss)."""
    if answers is None:
        return Selection(None, "the probe RPC failed")
    if len(answers) != len(candidates.keys):
        return Selection(None, f"{len(answers)} answers for {len(candidates.keys)} keys")
    if any(answer not in (0, 1) for answer in answers):
        bad = sorted({answer for answer in answers if answer not in (0, 1)})
        return Selection(None, f"answers outside the contract: {bad}")
    size = candidates.candidate_size
    complete = [index for index in range(len(candidates.positions))
                if all(answers[index * size + offset] == 1 for offset in range(size))]
    if contract is ProbeContract.SELECTED_ONLY:
        if len(complete) > 1:
            return Selection(None, f"{len(complete)} candidates selected; the contract allows one",
                             contract_misfit=True)
        if sum(answers) != size * len(complete):
            return Selection(None, "keys outside the selected candidate marked present",
                             contract_misfit=True)
    return Selection(complete[-1] if complete else None)


@dataclass(frozen=True)
class HitPass:
    """One run of vLLM's hit rule: at `length`, over the checkpoints up to `bound` (the hit
    with every recurrent state assumed present, which no real existence pattern exceeds)."""

    length: int
    bound: int


@dataclass(frozen=True)
class HitPlan:
    """Which run(s) of vLLM's hit rule can produce upstream's answer.

    Upstream runs the rule at `lookup_length`; if that reaches `num_tokens` it re-runs it at
    `align(num_tokens - 1)` so the last token is recomputed. Only a state *at* `num_tokens` can
    take the first run that far, and with partial-hash hits the re-run may be shorter than the
    first run without that state would be (the block keyed at `num_tokens` also holds the KV
    tail the shorter run cannot see). So when the state at `num_tokens` is reachable there are
    two candidate passes, and which one applies depends on that state's existence:
    `with_final` when it exists, `without_final` when not. `with_final` is None when the state
    at `num_tokens` cannot matter.
    """

    without_final: HitPass
    with_final: HitPass | None = None

    def pass_for(self, final_state_present: bool) -> HitPass:
        if final_state_present and self.with_final is not None:
            return self.with_final
        return self.without_final


def plan_hit_passes(num_tokens: int, lookup_length: int, usable_length: int,
                    longest: Callable[[int, bool], int], *, final_state_can_matter: bool = True
                    ) -> HitPlan:
    """Plan the hit passes (pure): `longest(length, with_final)` is vLLM's longest hit at
    `length` with the KV evidence and every recurrent state assumed present — the state at
    `num_tokens` included only when `with_final`.

    Upstream's rule, decided from existence: if even with every state the first pass stays
    below `num_tokens`, the final state cannot switch passes (one pass). Otherwise it reaches
    `num_tokens` exactly when the state there exists (any hit that long ends at that state), and
    then upstream's answer comes from the re-run at `usable_length` (0 when that is empty).

    `final_state_can_matter=False` (no partial-hash hits: every KV block is keyed at its own
    end and the lookup length is aligned to the recurrent block) says both runs give the same
    answer — the states below `num_tokens` all lie at or below `usable_length`, and the KV
    evidence up to there is the same — so the plan is the run without the final state alone,
    and it is the only run made: when even every state stays below `num_tokens` the state at
    `num_tokens` was never within reach of the recurrent finder (it only looks at or below the
    hit so far, and a state found at `num_tokens` would end the hit there), so leaving it out
    changes nothing.
    """
    if not final_state_can_matter:
        return HitPlan(HitPass(lookup_length, longest(lookup_length, False)))
    every = longest(lookup_length, True)
    if every < num_tokens:
        return HitPlan(HitPass(lookup_length, every))
    without = HitPass(lookup_length, longest(lookup_length, False))
    with_final = HitPass(usable_length, longest(usable_length, True)) if usable_length > 0 \
        else HitPass(0, 0)
    return HitPlan(without, with_final)


def legal_checkpoints(step: int, bound: int, masks: Sequence[Sequence[bool]] = ()
                      ) -> tuple[int, ...]:
    """Checkpoint positions a request may resume from: multiples of `step` up to `bound` that
    every recurrent group's lookup mask keeps (vLLM's `lookup_mask`: `mask[i]` for the
    checkpoint at `(i + 1) * step`; a position past a mask's end is not kept). No masks: all."""
    count = bound // step
    positions = range(step, count * step + 1, step)
    if not masks:
        return tuple(positions)
    kept = masks[0] if len(masks) == 1 else [all(column) for column in zip(*masks)]
    return tuple(itertools.compress(positions, kept))


def kv_reach(chunk_hashes: Mapping[int, Sequence[bytes]], block_sizes: Mapping[int, int],
             present: frozenset[Unit]) -> int:
    """How far the full-attention evidence reaches, in tokens: the shortest run of leading
    present chunks over the KV groups (pure; `chunk_hashes[g]` lists group g's chunks from the
    first, in order).

    vLLM's full-attention hit is a run of present blocks from the start (hashes are chained,
    so a missing block ends it; FullAttentionManager's phase 1), and a hybrid hit is bounded
    by every group's: no hit — so no checkpoint worth asking about — lies beyond it. Only for
    whole-block hits: with partial-hash hits a KV tail may be keyed under a later hash.
    """
    reach: int | None = None
    for group_id, hashes in chunk_hashes.items():
        count = 0
        for chunk_hash in hashes:
            if (group_id, chunk_hash) not in present:
                break
            count += 1
        tokens = count * block_sizes[group_id]
        reach = tokens if reach is None else min(reach, tokens)
    return 0 if reach is None else reach


def plan_checkpoint_probes(positions: Sequence[int], known_incomplete: Collection[int] = ()
                           ) -> tuple[tuple[int, ...], ...]:
    """The LastHitOnly probes to make, in order, over the legal checkpoints (pure).

    The store selects the last complete candidate, so the last legal checkpoint alone decides
    whenever it is complete (a fully stored prompt: the common case), at the cost of its own
    keys only; when it is not, the others go in a second probe, whose selection is what one
    probe of all of them would have selected. Either way at most one checkpoint is leased.
    Checkpoints an earlier answer of this lookup showed incomplete (`known_incomplete`) are
    left out: the store would never select them.
    """
    ordered = tuple(sorted(set(positions) - set(known_incomplete)))
    if not ordered:
        return ()
    if len(ordered) == 1:
        return (ordered,)
    return (ordered[-1:], ordered[:-1])


def hit_known_from_selection(hit_pass: HitPass, selected: int, *, final_state_can_matter: bool
                             ) -> int | None:
    """vLLM's hit with the KV evidence and only the selected checkpoint, when it follows from
    the bound without another run of the rule (pure); None when the rule must run.

    The bound is the rule's hit with every legal state present, and it ends on a state. When
    the store selected exactly that state, the rule gives the bound again: the full-attention
    hits depend on KV evidence alone (unchanged); the recurrent finder picks the last present
    state at or below the hit so far, which never drops below the bound on the way down (the
    bound's state is present and every intermediate hit is at least the bound), and cannot
    exceed it (the rule is monotone in the states present). With partial-hash hits the
    final-token re-run may pick another length (`plan_hit_passes`), so the rule runs.
    """
    if final_state_can_matter or hit_pass.bound <= 0 or selected != hit_pass.bound:
        return None
    return hit_pass.bound


def whole_block_bound(positions: Sequence[int], reach: int, alignment: int,
                      final_position: int | None) -> int:
    """vLLM's hit with the KV evidence and every legal state present except the one at
    `final_position` — the bound `plan_hit_passes` asks the coordinator for — read straight
    off the existence answers (pure), for whole-block layouts without EAGLE.

    There vLLM's rule is: each full-attention group hits its leading run of present blocks,
    capped by the hit so far and rounded down to `alignment` (the scheduler block; nothing
    widens or drops a block); each recurrent group then takes its last present state at or
    below the hit so far on the alignment grid; the loop converges on the recurrent answer.
    With every legal state present that is the last legal checkpoint at or below the KV
    reach (`kv_reach`, already capped by the lookup length) on the grid; `positions` ascend
    (`legal_checkpoints`' order), so the search starts at the reach. The adapter uses it
    only where that reading holds (`vllm_last_hit.rule_reads_off_existence`); the property
    tests compare it with vLLM's coordinator on random existence patterns.
    """
    top = reach - reach % alignment
    for index in range(bisect.bisect_right(positions, top) - 1, -1, -1):  # positions ascend
        position = positions[index]
        if position % alignment == 0 and position != final_position:
            return position
    return 0


@dataclass(frozen=True)
class OneCandidateFollowUp:
    """What a lookup does after its one-candidate call (KV keys + one checkpoint's keys, leased
    only when all are present) did not prove the hit, read from a per-key answer (pure).

    `confirm` is the checkpoint to ask about together with the KV keys found present, again as
    one candidate (None: go straight to the exact steps); `known_incomplete` are checkpoints
    the answers showed incomplete, which the exact steps' probes leave out.
    """

    confirm: int | None
    known_incomplete: frozenset[int]


def plan_one_candidate_follow_up(bound: int, speculated: int, speculated_complete: bool
                                 ) -> OneCandidateFollowUp:
    """Decide the follow-up of a failed one-candidate call (pure).

    `bound` is the checkpoint the KV keys of that answer allow (`whole_block_bound`: the last
    legal checkpoint within the KV reach; 0 when none), `speculated` the checkpoint that was
    asked about (the bound with every KV key present), `speculated_complete` whether all its
    recurrent keys were answered present. The bound's state was asked about only when it is
    the speculated one: if that was complete, a second one-candidate call over the present KV
    keys and it leases exactly what the exact steps would; if it was incomplete, the exact
    steps go on without it. A bound below the speculated checkpoint (the KV evidence stops
    earlier: a prompt that extends a stored one) is unknown, so it is worth one confirming
    call: in the common case its state was stored with its KV.
    """
    if bound <= 0:
        return OneCandidateFollowUp(None, frozenset())
    if bound == speculated:
        if speculated_complete:
            return OneCandidateFollowUp(bound, frozenset())
        return OneCandidateFollowUp(None, frozenset({bound}))
    return OneCandidateFollowUp(bound, frozenset())
