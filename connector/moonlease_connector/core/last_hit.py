"""Last-hit-only recurrent lookup (seed 000): probe the legal checkpoints, lease only the one.

Pure. For full-attention + align-mode Mamba models, upstream's lookup asks `batch_is_exist`
about every recurrent state of the prompt, so every checkpoint gets a read lease — including
states past the point the KV evidence lets the request resume from. Here:

1. the KV (full-attention) keys are looked up as upstream does; vLLM's hit rule, run once with
   every recurrent state assumed present, bounds the legal checkpoints (EAGLE and final-token
   recomputation included, since it is the same rule);
2. the recurrent keys of those checkpoints go to the store in checkpoint-major order across the
   actual group/rank namespaces, with `batch_probe_key(keys, "LastHitOnly", candidate_size)`:
   the store leases the last complete checkpoint only;
3. the answer is validated against the store's response contract and the exact selected
   checkpoint is what the lookup returns for loading.

Two response contracts exist (NOTES §3): Mooncake 0.3.14 answers per-key existence and leases
the last complete candidate; Mooncake RFC 4255 answers a selected-only mask with at most one
all-true candidate. Anything outside the contract in force — wrong length, values other than
0/1, several selected candidates under RFC 4255, error codes — is a miss, and so is a failed
RPC. There is deliberately no fallback to a lease-renewing existence check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

from moonlease_connector.core.lookup import GroupNamespaces, Unit

LAST_HIT_ONLY_POLICY = "LastHitOnly"


class ProbeContract(str, Enum):
    """How a store answers a LastHitOnly probe."""

    PER_KEY_EXISTENCE = "per-key-existence"  # Mooncake 0.3.14: 1/0 per key
    SELECTED_ONLY = "selected-only"  # Mooncake RFC 4255: 1s only on the selected candidate


def contract_for(mooncake_version: str) -> ProbeContract:
    """0.3.14 shipped per-key answers; later releases follow RFC 4255's selected-only mask."""
    return ProbeContract.PER_KEY_EXISTENCE if mooncake_version.startswith("0.3.14") \
        else ProbeContract.SELECTED_ONLY


@dataclass(frozen=True)
class CheckpointCandidates:
    """Recurrent keys of the legal checkpoints, checkpoint-major, `candidate_size` per checkpoint."""

    positions: tuple[int, ...]  # token positions of the checkpoints, ascending
    keys: tuple[str, ...]
    units: tuple[tuple[Unit, ...], ...]  # the recurrent units each checkpoint stands for
    candidate_size: int

    def keys_of(self, index: int) -> tuple[str, ...]:
        start = index * self.candidate_size
        return self.keys[start:start + self.candidate_size]


def build_checkpoint_candidates(recurrent_groups: Sequence[GroupNamespaces], positions: Sequence[int],
                                state_hash: Callable[[GroupNamespaces, int], bytes]
                                ) -> CheckpointCandidates:
    """One candidate per checkpoint: every recurrent group's key in every rank namespace.

    Groups may have unequal namespace counts; the candidate size is their sum, the same for
    every checkpoint. Keys are never de-duplicated: answers are read by position, so a key that
    appears twice is simply asked about twice.
    """
    keys: list[str] = []
    units: list[tuple[Unit, ...]] = []
    for position in sorted(set(positions)):
        checkpoint_units = []
        for group in recurrent_groups:
            chunk_hash = state_hash(group, position)
            keys.extend(group.keys_for(chunk_hash))
            checkpoint_units.append((group.group_id, chunk_hash))
        units.append(tuple(checkpoint_units))
    size = sum(len(group.key_prefixes) for group in recurrent_groups)
    return CheckpointCandidates(tuple(sorted(set(positions))), tuple(keys), tuple(units), size)


@dataclass(frozen=True)
class Selection:
    """The checkpoint the store selected (index into the candidates), or why there is none."""

    index: int | None
    problem: str | None = None  # set when the answer broke the contract

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
            return Selection(None, f"{len(complete)} candidates selected; the contract allows one")
        if sum(answers) != size * len(complete):
            return Selection(None, "keys outside the selected candidate marked present")
    return Selection(complete[-1] if complete else None)


def legal_checkpoints(recurrent_block_size: int, bound: int, reachable: Callable[[int], bool]
                      ) -> tuple[int, ...]:
    """Checkpoint positions a request may resume from: recurrent block boundaries up to `bound`
    (vLLM's hit with every recurrent state assumed present) that vLLM's lookup mask keeps."""
    return tuple(position for position in range(recurrent_block_size, bound + 1, recurrent_block_size)
                 if reachable(position))
