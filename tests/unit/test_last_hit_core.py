"""Last-hit-only's pure core: checkpoint-major candidates and both response contracts."""

from __future__ import annotations

import itertools

import pytest

from moonlease_connector.core.last_hit import (
    ProbeContract,
    build_checkpoint_candidates,
    HitPass,
    HitPlan,
    contract_from_probe,
    hit_known_from_selection,
    kv_reach,
    legal_checkpoints,
    OneCandidateFollowUp,
    plan_checkpoint_probes,
    plan_hit_passes,
    plan_one_candidate_follow_up,
    select_checkpoint,
    whole_block_bound,
)
from moonlease_connector.core.lookup import GroupNamespaces

pytestmark = pytest.mark.unit

MAMBA_A = GroupNamespaces(1, 64, ("a@r0", "a@r1"), is_recurrent=True)
MAMBA_B = GroupNamespaces(2, 64, ("b@r0", "b@r1"), is_recurrent=True)


def state_hash(group: GroupNamespaces, position: int) -> bytes:
    return bytes([position // 64]) * 4


def candidates(groups=(MAMBA_A, MAMBA_B), positions=(64, 128, 192)):
    return build_checkpoint_candidates(list(groups), list(positions), state_hash)


def test_keys_are_checkpoint_major_across_groups_and_namespaces() -> None:
    c = candidates(positions=(128, 64))
    assert c.positions == (64, 128) and c.candidate_size == 4
    assert c.keys == ("a@r0@01010101", "a@r1@01010101", "b@r0@01010101", "b@r1@01010101",
                      "a@r0@02020202", "a@r1@02020202", "b@r0@02020202", "b@r1@02020202")
    assert c.units[1] == ((1, b"\x02" * 4), (2, b"\x02" * 4))


def test_unequal_namespace_counts_give_one_candidate_size() -> None:
    odd = GroupNamespaces(3, 64, ("c@r0", "c@r1", "c@r2"), is_recurrent=True)
    c = candidates(groups=(GroupNamespaces(1, 64, ("a@r0",), is_recurrent=True), odd))
    assert c.candidate_size == 4 and len(c.keys) == 12
    answers = [1, 1, 1, 1,  1, 1, 0, 1,  1, 1, 1, 1]
    assert select_checkpoint(c, answers, ProbeContract.PER_KEY_EXISTENCE).index == 2


def test_duplicate_keys_are_read_by_position() -> None:
    twin = GroupNamespaces(1, 64, ("same", "same"), is_recurrent=True)
    c = candidates(groups=(twin,))
    assert c.keys[:c.candidate_size] == ("same@01010101", "same@01010101")
    assert select_checkpoint(c, [1, 1, 1, 0, 0, 0], ProbeContract.PER_KEY_EXISTENCE).index == 0


def reference_last_complete(pattern: tuple[int, ...], size: int) -> int | None:
    complete = [i for i in range(len(pattern) // size) if all(pattern[i * size:(i + 1) * size])]
    return complete[-1] if complete else None


def test_all_4096_physical_existence_patterns_under_both_contracts() -> None:
    c = candidates()
    assert len(c.keys) == 12
    for pattern in itertools.product((0, 1), repeat=12):
        expected = reference_last_complete(pattern, 4)
        # Mooncake 0.3.14 answers per-key existence.
        per_key = select_checkpoint(c, pattern, ProbeContract.PER_KEY_EXISTENCE)
        assert per_key.valid and per_key.index == expected
        # An RFC 4255 store answers ones on the selected candidate only.
        mask = [0] * 12
        if expected is not None:
            mask[expected * 4:(expected + 1) * 4] = [1] * 4
        selected_only = select_checkpoint(c, mask, ProbeContract.SELECTED_ONLY)
        assert selected_only.valid and selected_only.index == expected
        # A per-key answer read under RFC 4255 is valid only if it is a selected-only mask.
        strict = select_checkpoint(c, pattern, ProbeContract.SELECTED_ONLY)
        assert strict.valid == (list(pattern) == mask)


@pytest.mark.parametrize(("answers", "contract", "why"), [
    (None, ProbeContract.PER_KEY_EXISTENCE, "RPC failed"),
    ([1] * 11, ProbeContract.PER_KEY_EXISTENCE, "11 answers"),
    ([1] * 11 + [-600], ProbeContract.PER_KEY_EXISTENCE, "outside the contract"),
    ([1] * 11 + [2], ProbeContract.PER_KEY_EXISTENCE, "outside the contract"),
    ([1] * 8 + [0] * 4, ProbeContract.SELECTED_ONLY, "2 candidates selected"),
    ([0, 1, 0, 0] + [1] * 4 + [0] * 4, ProbeContract.SELECTED_ONLY, "outside the selected"),
])
def test_answers_outside_the_contract_are_misses(answers, contract, why) -> None:
    selection = select_checkpoint(candidates(), answers, contract)
    assert not selection.valid and selection.index is None and why in selection.problem


@pytest.mark.parametrize(("answers", "contract"), [
    ([1, 1, 0], ProbeContract.PER_KEY_EXISTENCE),  # Mooncake 0.3.14
    ((0, 1, 0), ProbeContract.SELECTED_ONLY),  # Mooncake RFC 4255
    ([1, 1, 1], None), ([0, 0, 0], None), ([1, 1], None), ([-600] * 3, None), (None, None),
])
def test_the_contract_is_read_from_the_probe_answer(answers, contract) -> None:
    assert contract_from_probe(answers) is contract


def test_selected_only_misfits_are_flagged_for_redetection() -> None:
    per_key_answer = [1] * 8 + [0] * 4  # two complete checkpoints: fine per key, not RFC 4255
    assert select_checkpoint(candidates(), per_key_answer, ProbeContract.SELECTED_ONLY).contract_misfit
    broken = select_checkpoint(candidates(), [1] * 11, ProbeContract.SELECTED_ONLY)
    assert not broken.valid and not broken.contract_misfit, "a malformed answer is no contract question"


def test_legal_checkpoints_stop_at_the_bound_and_respect_the_lookup_mask() -> None:
    assert legal_checkpoints(64, 200) == (64, 128, 192)
    assert legal_checkpoints(64, 191) == (64, 128)
    assert legal_checkpoints(64, 256, ([True, False, True, True],)) == (64, 192, 256)
    assert legal_checkpoints(64, 256, ([True, True, True, True], [True, True, False, True])) \
        == (64, 128, 256), "every recurrent group's mask must keep a checkpoint"
    assert legal_checkpoints(64, 256, ([True, True],)) == (64, 128), "past a mask's end: not kept"
    assert legal_checkpoints(64, 63) == ()


def test_the_kv_reach_is_the_shortest_leading_run_of_present_chunks() -> None:
    hashes = {0: [b"a", b"b", b"c", b"d"], 2: [b"w", b"x"]}
    every = frozenset({(0, b"a"), (0, b"b"), (0, b"c"), (0, b"d"), (2, b"w"), (2, b"x")})
    assert kv_reach(hashes, {0: 16, 2: 64}, every) == 64
    assert kv_reach(hashes, {0: 16, 2: 64}, every - {(0, b"b")}) == 16, "a missing chunk ends the run"
    assert kv_reach(hashes, {0: 16, 2: 64}, every - {(2, b"w")}) == 0
    assert kv_reach({}, {}, every) == 0


def test_one_pass_when_even_every_state_stays_below_num_tokens() -> None:
    calls = []

    def longest(length: int, with_final: bool) -> int:
        calls.append((length, with_final))
        return 192

    assert plan_hit_passes(256, 256, 240, longest) == HitPlan(HitPass(256, 192))
    assert calls == [(256, True)], "no second run of the rule when the final state cannot matter"


def test_a_reachable_final_state_plans_both_of_upstreams_passes() -> None:
    """The recompute pass (length 240) may hit less than the first pass without the final
    state (partial-hash hits: the tail block is keyed at 256); both are kept."""
    hits = {(256, True): 256, (256, False): 240, (240, True): 192}
    plan = plan_hit_passes(256, 256, 240, lambda length, final: hits[(length, final)])
    assert plan == HitPlan(HitPass(256, 240), HitPass(240, 192))
    assert plan.pass_for(True) == HitPass(240, 192) and plan.pass_for(False) == HitPass(256, 240)


def test_no_recompute_room_means_a_present_final_state_hits_nothing() -> None:
    plan = plan_hit_passes(16, 16, 0, lambda length, final: 16 if final else 0)
    assert plan.pass_for(True) == HitPass(0, 0) and plan.pass_for(False) == HitPass(16, 0)


def test_without_partial_hash_hits_the_final_state_never_splits_the_plan() -> None:
    hits = {(256, True): 256, (256, False): 192}
    plan = plan_hit_passes(256, 256, 192, lambda length, final: hits[(length, final)],
                           final_state_can_matter=False)
    assert plan == HitPlan(HitPass(256, 192)) and plan.pass_for(True) == HitPass(256, 192)


def test_without_partial_hash_hits_the_plan_is_one_run_of_the_rule() -> None:
    calls = []

    def longest(length: int, with_final: bool) -> int:
        calls.append((length, with_final))
        return 192

    assert plan_hit_passes(256, 256, 192, longest, final_state_can_matter=False) == HitPlan(HitPass(256, 192))
    assert calls == [(256, False)]


def test_the_last_checkpoint_is_probed_alone_first_then_the_rest_together() -> None:
    assert plan_checkpoint_probes((64, 128, 192)) == ((192,), (64, 128))
    assert plan_checkpoint_probes((192, 64, 64)) == ((192,), (64,)), "ordered, each once"
    assert plan_checkpoint_probes((64,)) == ((64,),)
    assert plan_checkpoint_probes(()) == ()


def test_checkpoints_known_incomplete_are_never_probed() -> None:
    assert plan_checkpoint_probes((64, 128, 192), known_incomplete={192}) == ((128,), (64,))
    assert plan_checkpoint_probes((64, 128, 192), known_incomplete={128}) == ((192,), (64,))
    assert plan_checkpoint_probes((64,), known_incomplete={64}) == ()


def test_the_one_candidate_follow_up_confirms_only_what_the_answer_leaves_open() -> None:
    # The bound is the speculated checkpoint and it was complete (a KV block past it missing).
    assert plan_one_candidate_follow_up(192, 192, True) == OneCandidateFollowUp(192, frozenset())
    # ... and incomplete: the exact steps, without it.
    assert plan_one_candidate_follow_up(192, 192, False) == OneCandidateFollowUp(None, frozenset({192}))
    # The KV evidence stops earlier: that checkpoint was never asked about, so confirm it.
    assert plan_one_candidate_follow_up(128, 192, True) == OneCandidateFollowUp(128, frozenset())
    assert plan_one_candidate_follow_up(128, 192, False) == OneCandidateFollowUp(128, frozenset())
    # No legal checkpoint: nothing to confirm.
    assert plan_one_candidate_follow_up(0, 192, True) == OneCandidateFollowUp(None, frozenset())


def test_the_hit_is_the_bound_only_when_the_bound_itself_was_selected_on_whole_blocks() -> None:
    assert hit_known_from_selection(HitPass(256, 192), 192, final_state_can_matter=False) == 192
    assert hit_known_from_selection(HitPass(256, 192), 128, final_state_can_matter=False) is None
    assert hit_known_from_selection(HitPass(256, 192), 192, final_state_can_matter=True) is None, \
        "partial-hash hits: the final-token re-run may pick another length"
    assert hit_known_from_selection(HitPass(256, 0), 0, final_state_can_matter=False) is None


def test_the_whole_block_bound_is_the_last_aligned_legal_checkpoint_within_the_kv_reach() -> None:
    positions = (64, 128, 192, 256)
    assert whole_block_bound(positions, 256, 64, None) == 256
    assert whole_block_bound(positions, 256, 64, 256) == 192, "the state at num_tokens is left out"
    assert whole_block_bound(positions, 200, 64, None) == 192, "the KV reach, down to the grid"
    assert whole_block_bound(positions, 256, 128, None) == 256
    assert whole_block_bound(positions, 250, 128, None) == 128, "only checkpoints on the grid"
    assert whole_block_bound((64, 192), 256, 64, None) == 192
    assert whole_block_bound(positions, 63, 64, None) == 0
