"""Which store calls a last-hit-only lookup makes, and what each leases (whole-block layout).

The common case — a fully stored prompt — is one LastHitOnly call whose single candidate is
the KV keys plus the recurrent keys of the checkpoint the prompt resumes from; the store leases
it only when all are present. The other cases go on from what a per-key answer showed. The
recorder plays Mooncake's LastHitOnly probe under either contract (`LastHitStore`); the hit is
always compared with upstream's own lookup over the same existence pattern.
"""

from __future__ import annotations

import pytest

from moonlease_connector.core.last_hit import legal_checkpoints
from moonlease_connector.core.lookup import MissReason
from tests.support.lookup_workers import HASH_BLOCK, RecordingStore, build_upstream_lookup
from tests.unit.test_last_hit_matches_upstream import HYBRID_LAYOUTS, LastHitStore, last_hit_worker

pytestmark = pytest.mark.unit

LAYOUT = HYBRID_LAYOUTS[0]  # full attention (16-token blocks, 1 namespace) + Mamba (64, 2 ranks)
HASHES = [bytes([index, 9]) * 4 for index in range(16)]  # 256 tokens, checkpoints at 64..256
NUM_TOKENS = 250  # the lookup length is 192 (aligned to the 64-token checkpoints)


def kv_key(index: int) -> str:
    return f"tiny@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{HASHES[index].hex()}"


def state_keys(position: int) -> list[str]:
    return [f"tiny@tp_rank:{rank}@pcp0@dcp0@pp_rank:0@group:1@{HASHES[position // HASH_BLOCK - 1].hex()}"
            for rank in range(2)]


def pattern(kv_blocks: int = 16, states: tuple[int, ...] = (64, 128, 192, 256),
            holes: tuple[str, ...] = ()) -> dict[str, int]:
    keys = [kv_key(index) for index in range(kv_blocks)]
    keys += [key for position in states for key in state_keys(position)]
    return {key: 1 for key in keys if key not in holes}


def run(answers: dict[str, int], contract: str = "per-key-existence"):
    upstream = build_upstream_lookup(LAYOUT, RecordingStore(answers))(NUM_TOKENS, HASHES)
    store = LastHitStore(answers, contract)
    worker = last_hit_worker(LAYOUT, store)
    ours = worker.lookup(NUM_TOKENS, HASHES)
    assert (ours.hit_length, ours.tail_key_boundaries) == (upstream.hit_length, upstream.tail_key_boundaries)
    return ours, store


def kinds(store: LastHitStore) -> list[str]:
    return [name for name, _ in store.calls]


@pytest.mark.parametrize("contract", ["per-key-existence", "selected-only"])
def test_a_fully_stored_prompt_is_one_call_leasing_the_kv_and_one_checkpoint(contract) -> None:
    ours, store = run(pattern(), contract)
    assert ours.hit_length == 192
    (name, keys), = store.calls
    kv_keys = [kv_key(index) for index in range(12)]  # upstream's KV candidates: up to 192
    assert name == f"batch_probe_key:LastHitOnly:{len(kv_keys) + 2}"
    assert list(keys) == kv_keys + state_keys(192)
    assert store.last_hit_leased == set(kv_keys) | set(state_keys(192))
    assert ours.outcome.keys_leased == ours.outcome.keys_probed == 14


def test_a_prompt_extending_a_stored_one_confirms_the_checkpoint_its_kv_allows() -> None:
    """KV stored for 8 blocks (128 tokens), every state stored: the first call leases nothing
    (incomplete); its per-key answer bounds the checkpoint at 128, asked about together with
    the KV keys found present — no state past the KV evidence is ever leased."""
    ours, store = run(pattern(kv_blocks=8))
    assert ours.hit_length == 128
    assert kinds(store) == ["batch_probe_key:LastHitOnly:14", "batch_probe_key:LastHitOnly:10"]
    assert list(store.calls[1][1]) == [kv_key(index) for index in range(8)] + state_keys(128)
    assert store.last_hit_leased == {kv_key(index) for index in range(8)} | set(state_keys(128))
    assert store.leased_keys() == set(), "no batch_is_exist"
    assert ours.outcome.keys_leased == 10 and ours.outcome.keys_probed == 24


def test_the_same_prompt_under_the_selected_only_contract_takes_the_exact_steps() -> None:
    """RFC 4255 answers an incomplete candidate with zeros only: nothing to go on, so the KV
    keys go through upstream's leasing check and the checkpoints through LastHitOnly probes."""
    ours, store = run(pattern(kv_blocks=8), "selected-only")
    assert ours.hit_length == 128
    assert kinds(store) == ["batch_probe_key:LastHitOnly:14", "batch_is_exist", "batch_probe_key:LastHitOnly:2"]
    assert store.last_hit_leased == set(state_keys(128))


def test_an_incomplete_last_checkpoint_is_not_probed_again() -> None:
    """192 is missing on rank 1: the first answer showed it, so the exact steps start from
    128 (alone, then the rest if it were incomplete)."""
    ours, store = run(pattern(holes=(state_keys(192)[1],)))
    assert ours.hit_length == 128
    assert kinds(store) == ["batch_probe_key:LastHitOnly:14", "batch_is_exist", "batch_probe_key:LastHitOnly:2"]
    assert [len(keys) for _, keys in store.calls] == [14, 12, 2]
    assert list(store.calls[-1][1]) == state_keys(128)
    assert store.last_hit_leased == set(state_keys(128))


def test_a_missing_state_at_the_confirmed_checkpoint_falls_back_without_it() -> None:
    ours, store = run(pattern(kv_blocks=8, states=(64, 192)))
    assert ours.hit_length == 64
    assert kinds(store) == ["batch_probe_key:LastHitOnly:14", "batch_probe_key:LastHitOnly:10",
                            "batch_is_exist", "batch_probe_key:LastHitOnly:2"]
    assert [len(keys) for _, keys in store.calls][-1] == 2, "only 64: 128 was shown incomplete"
    assert store.last_hit_leased == set(state_keys(64))


def test_nothing_stored_is_one_call_and_a_miss() -> None:
    ours, store = run({})
    assert ours.hit_length == 0 and ours.outcome.miss_reason is MissReason.NOT_FOUND
    assert kinds(store) == ["batch_probe_key:LastHitOnly:14"]
    assert store.last_hit_leased == set()


def test_kv_without_any_state_leases_the_kv_as_upstream_and_misses() -> None:
    ours, store = run(pattern(states=()))
    assert ours.hit_length == 0
    assert kinds(store) == ["batch_probe_key:LastHitOnly:14", "batch_is_exist",
                            "batch_probe_key:LastHitOnly:2", "batch_probe_key:LastHitOnly:2"]
    assert [list(keys) for _, keys in store.calls[2:]] == [state_keys(128), state_keys(64)], \
        "192 was shown incomplete"
    assert store.leased_keys() == {kv_key(index) for index in range(12)}
    assert store.last_hit_leased == set()


def test_a_failed_first_call_is_a_store_error_miss() -> None:
    class Failing(LastHitStore):
        def batch_probe_key(self, keys, policy="none", candidate_size=1):
            answers = super().batch_probe_key(keys, policy, candidate_size)
            if keys[0].startswith("moonlease-contract-probe"):
                return answers
            raise RuntimeError("master unreachable")

    store = Failing(pattern(), "per-key-existence")
    answer = last_hit_worker(LAYOUT, store).lookup(NUM_TOKENS, HASHES)
    assert answer.hit_length == 0 and answer.outcome.miss_reason is MissReason.STORE_ERROR
    assert len(store.calls) == 1


def test_a_kv_hole_confirms_with_every_present_kv_key_as_before() -> None:
    """KV block 6 missing (blocks 0-5 and 7-11 stored): the KV reach is 96 tokens, so the
    checkpoint is 64; the confirming call carries every KV key found present — the ones past the
    hole included, which the exact steps' `batch_is_exist` would lease too — then 64's state."""
    ours, store = run(pattern(holes=(kv_key(6),)))
    assert ours.hit_length == 64
    present_kv = [kv_key(index) for index in range(12) if index != 6]
    assert kinds(store) == ["batch_probe_key:LastHitOnly:14", "batch_probe_key:LastHitOnly:13"]
    assert list(store.calls[1][1]) == present_kv + state_keys(64)
    assert store.last_hit_leased == set(present_kv) | set(state_keys(64))


def test_masks_and_legal_checkpoints_are_remembered_per_length() -> None:
    """vLLM's lookup masks depend on the lookup length only: asked again, the lookup object
    answers from memory with what the coordinator answers."""
    worker = last_hit_worker(LAYOUT, LastHitStore(pattern(), "per-key-existence"))
    for length in (64, 128, 192, 256):
        masks = worker.lookup_masks(length)
        assert masks == tuple(None if mask is None else tuple(mask)
                              for mask in worker.coord.lookup_mask(length))
        assert worker.lookup_masks(length) is masks
        recurrent = [mask for mask in masks[1:] if mask is not None]
        positions = worker.legal_positions(64, length, length, recurrent)
        assert positions == legal_checkpoints(64, length, recurrent)
        assert worker.legal_positions(64, length, length, recurrent) is positions
