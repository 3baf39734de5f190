"""The LastHitOnly response contract, detected from the store's behaviour and kept current.

RFC 4255's selected-only contract exists in no Mooncake release, so it can only be simulated
(`LastHitStore`); Mooncake 0.3.14's per-key contract is also detected against the real store
in tests/connector/test_last_hit_real_store.py.
"""

from __future__ import annotations

import pytest

from moonlease_connector.adapters.mooncake_store import ProbeContractDetector
from moonlease_connector.core.last_hit import ProbeContract, build_checkpoint_candidates
from moonlease_connector.core.lookup import GroupNamespaces
from tests.support.lookup_workers import HASH_BLOCK
from tests.unit.test_last_hit_matches_upstream import HYBRID_LAYOUTS, LastHitStore, last_hit_worker

pytestmark = pytest.mark.unit

MAMBA = GroupNamespaces(1, 64, ("m@r0", "m@r1"), is_recurrent=True)
CANDIDATES = build_checkpoint_candidates([MAMBA], [64, 128, 192], lambda g, p: bytes([p // 64]) * 4)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("contract", list(ProbeContract))
def test_each_contract_is_detected_and_the_probe_keys_are_removed(contract) -> None:
    store = LastHitStore({}, contract.value)
    detector = ProbeContractDetector(store)
    assert detector.detect() is contract and detector.contract is contract
    assert store.answer_for == {}, "the probe's own keys are removed"
    assert [name for name, _ in store.calls] == ["batch_probe_key:LastHitOnly:1"]


def test_an_unknown_version_with_per_key_answers_hits_with_several_complete_checkpoints() -> None:
    """The version-string rule read 'unknown' as selected-only and rejected every lookup with
    two or more complete checkpoints; detection reads the store's answers instead."""
    layout = HYBRID_LAYOUTS[0]
    hashes = [bytes([index, 9]) * 4 for index in range(16)]
    keys = [f"tiny@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{h.hex()}" for h in hashes]
    keys += [f"tiny@tp_rank:{rank}@pcp0@dcp0@pp_rank:0@group:1@{hashes[i].hex()}"
             for rank in range(2) for i in (3, 7, 11)]
    store = LastHitStore(dict.fromkeys(keys, 1), "per-key-existence")
    worker = last_hit_worker(layout, store)
    assert worker.capabilities.mooncake_version == "unknown"
    assert worker.probe_contract.contract is ProbeContract.PER_KEY_EXISTENCE
    assert worker.lookup(len(hashes) * HASH_BLOCK - 1, hashes).hit_length == 192


def test_answers_that_stop_fitting_trigger_redetection_and_are_reread() -> None:
    """A store upgraded under the engine (selected-only → per-key): the first misfitting
    answer re-detects, and the same answer is read under the contract found."""
    store = LastHitStore({}, "selected-only")
    clock = Clock()
    detector = ProbeContractDetector(store, clock=clock, redetect_interval_s=5)
    assert detector.detect() is ProbeContract.SELECTED_ONLY
    store.contract = "per-key-existence"
    clock.now = 10
    per_key = [1, 1, 1, 1, 0, 1]  # checkpoints 64 and 128 complete
    selection = detector.read(CANDIDATES, per_key)
    assert selection.valid and selection.index == 1
    assert detector.contract is ProbeContract.PER_KEY_EXISTENCE


def test_a_misfit_within_the_interval_is_a_miss_without_another_probe() -> None:
    store = LastHitStore({}, "selected-only")
    clock = Clock()
    detector = ProbeContractDetector(store, clock=clock, redetect_interval_s=5)
    detector.detect()
    store.calls.clear()
    clock.now = 1
    selection = detector.read(CANDIDATES, [1, 1, 1, 1, 0, 1])
    assert not selection.valid and selection.contract_misfit
    assert store.calls == [], "no re-detection within the interval"


def test_a_failed_detection_misses_and_retries_after_the_interval() -> None:
    class Down(LastHitStore):
        down = True

        def put(self, key, value):
            if self.down:
                raise RuntimeError("master unreachable")
            return super().put(key, value)

    store = Down({}, "per-key-existence")
    clock = Clock()
    detector = ProbeContractDetector(store, clock=clock, redetect_interval_s=5)
    assert detector.detect() is None
    answers = [1, 1, 0, 0, 0, 0]
    assert "not known" in detector.read(CANDIDATES, answers).problem
    store.down = False
    clock.now = 2
    assert not detector.read(CANDIDATES, answers).valid, "retried only after the interval"
    clock.now = 6
    assert detector.read(CANDIDATES, answers).index == 0
    assert detector.contract is ProbeContract.PER_KEY_EXISTENCE
