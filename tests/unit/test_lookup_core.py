"""The pure lookup core, on hand-computed scenarios (no vLLM, no store)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from moonlease_connector.core.lookup import (
    GroupNamespaces,
    TailKey,
    TailKeyMissing,
    build_candidates,
    build_tail_keys,
    leading_present_run,
    present_units,
    resolve_hit,
)

pytestmark = pytest.mark.unit

FULL = GroupNamespaces(0, 16, ("m@tp_rank:0@group:0", "m@tp_rank:1@group:0"))
MAMBA = GroupNamespaces(1, 64, ("m@tp_rank:0@group:1",), is_recurrent=True)
H = [bytes([i]) * 4 for i in range(8)]


def test_candidates_are_group_major_then_chunk_then_namespace() -> None:
    candidates = build_candidates([FULL, MAMBA], {0: H[:2], 1: [H[3]]})
    assert candidates.keys == (
        "m@tp_rank:0@group:0@00000000", "m@tp_rank:1@group:0@00000000",
        "m@tp_rank:0@group:0@01010101", "m@tp_rank:1@group:0@01010101",
        "m@tp_rank:0@group:1@03030303",
    )
    assert candidates.units == ((0, H[0]), (0, H[1]), (1, H[3]))
    assert candidates.namespaces_per_unit == (2, 2, 1)


def test_a_unit_is_present_only_when_every_namespace_answers_one() -> None:
    candidates = build_candidates([FULL, MAMBA], {0: H[:3], 1: [H[3]]})
    answers = [1, 1,   # H0 on both ranks
               1, 0,   # H1 missing on rank 1
               1, -706,  # H2: an error code is not existence
               1]      # mamba H3
    assert present_units(candidates, answers) == {(0, H[0]), (1, H[3])}


def test_a_reply_of_the_wrong_length_yields_nothing() -> None:
    candidates = build_candidates([FULL], {0: H[:2]})
    assert present_units(candidates, [1, 1, 1]) == frozenset()
    assert present_units(candidates, [1, 1, 1, 1, 1]) == frozenset()


@given(st.lists(st.sampled_from([1, 0, -1]), min_size=4, max_size=4))
def test_present_units_agree_with_a_per_unit_reading(answers: list[int]) -> None:
    candidates = build_candidates([FULL], {0: H[:2]})
    expected = {unit for index, unit in enumerate(candidates.units)
                if answers[2 * index] == 1 and answers[2 * index + 1] == 1}
    assert present_units(candidates, answers) == expected


def test_tail_key_is_the_hit_when_its_hash_is_stored() -> None:
    present = {(0, H[0]), (0, H[1])}
    tails = build_tail_keys([FULL], H, 16, 32, lambda g, h: (g, h) in present)
    assert tails == (TailKey(0, 32),)


def test_partial_hit_reads_the_block_under_the_next_stored_hash() -> None:
    # A 64-token block stored under the hash at 64; the hit ends at 32 inside it.
    group = GroupNamespaces(0, 64, ("p",))
    present = {(0, H[3])}
    tails = build_tail_keys([group], H, 16, 32, lambda g, h: (g, h) in present)
    assert tails == (TailKey(0, 64),)


def test_a_hit_no_stored_key_covers_is_a_rule_violation() -> None:
    with pytest.raises(TailKeyMissing):
        build_tail_keys([FULL], H, 16, 32, lambda g, h: False)


def test_no_hit_no_tail_keys() -> None:
    assert build_tail_keys([FULL], H, 16, 0, lambda g, h: True) == ()


def test_store_key_format() -> None:
    assert GroupNamespaces(0, 16, ("model@tp_rank:0",)).keys_for(b"\xab\xcd") == ("model@tp_rank:0@abcd",)


@pytest.mark.parametrize(("num_tokens", "longest", "expected"), [
    (100, {96: 64}, 64),          # hit below the prompt end stands
    (96, {96: 96, 80: 80}, 80),   # a hit covering every token is recomputed one token short
    (16, {16: 16}, 0),            # nothing usable below one aligned block
])
def test_resolve_hit_keeps_the_last_token_for_sampling(num_tokens: int, longest: dict[int, int],
                                                       expected: int) -> None:
    def align(length: int) -> int:
        return length // 16 * 16

    assert resolve_hit(num_tokens, align(num_tokens), lambda n: longest.get(n, 0), align) == expected


def test_a_miss_with_error_codes_is_the_stores_failure() -> None:
    from moonlease_connector.core.lookup import MissReason, miss_reason_of

    assert miss_reason_of([0, 0, 0]) is MissReason.NOT_FOUND
    assert miss_reason_of([-900, -900]) is MissReason.STORE_ERROR  # master unreachable
    assert miss_reason_of([1, 0, -900]) is MissReason.STORE_ERROR


ONE_NAMESPACE = GroupNamespaces(0, 16, ("m@tp_rank:0@group:0",))


@given(st.lists(st.sampled_from([1, 0, -1]), min_size=0, max_size=8))
def test_a_leading_present_run_is_what_present_units_reads(answers: list[int]) -> None:
    """`leading_present_run` answers only when the present units are exactly a leading run,
    and then its slices are `present_units`' answer and those units' keys."""
    candidates = build_candidates([ONE_NAMESPACE], {0: H[:len(answers)]})
    run = leading_present_run(candidates, answers)
    present = present_units(candidates, answers)
    if run is None:
        assert present != frozenset(candidates.units[:len(present)])
    else:
        assert present == frozenset(candidates.units[:run])
        assert [key for key, answer in zip(candidates.keys, answers) if answer == 1] == \
            list(candidates.keys[:run])


def test_no_leading_run_over_several_namespaces_or_a_broken_reply() -> None:
    assert leading_present_run(build_candidates([FULL], {0: H[:2]}), [1, 1, 1, 1]) is None
    assert leading_present_run(build_candidates([ONE_NAMESPACE], {0: H[:2]}), [1]) is None
    assert leading_present_run(build_candidates([ONE_NAMESPACE], {0: H[:3]}), [1, 1, 0]) == 2
    assert leading_present_run(build_candidates([ONE_NAMESPACE], {0: H[:3]}), [1, 0, 1]) is None


def test_error_codes_are_told_apart_from_existence_answers() -> None:
    from moonlease_connector.core.lookup import has_error_code

    assert not has_error_code([])
    assert not has_error_code([1, 0, 1])
    assert not has_error_code((0, 0))
    assert not has_error_code([2, 1])  # not 0/1, but no error code: the scan decides
    assert has_error_code([1, -704, 0])
    assert has_error_code([-1])
