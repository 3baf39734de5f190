"""The engine tests' logprob bound (`tests.support.numerics`) follows the dtype, not one CPU."""

from __future__ import annotations

import pytest

from tests.support.numerics import assert_same_logprobs, logprob_tolerance

pytestmark = pytest.mark.unit


def test_the_float32_bound_is_gamma_n_for_the_vocabulary_softmax():
    assert logprob_tolerance("float32") == pytest.approx(1024 * 2.0**-24)
    assert logprob_tolerance("bfloat16") == pytest.approx(1024 * 2.0**-8)  # > 1: no bound at all


def test_float32_reordering_passes_and_an_amx_bf16_difference_does_not():
    reference = [-6.5, -6.44, -6.39]
    one_float32_spacing = [value - 4.77e-7 for value in reference]
    assert_same_logprobs(one_float32_spacing, reference)
    amx_bf16 = [reference[0] + 0.0019, *reference[1:]]  # what a bf16 engine did on an AMX CPU
    with pytest.raises(AssertionError, match="token 0"):
        assert_same_logprobs(amx_bf16, reference)


def test_lengths_and_missing_logprobs_are_reported():
    with pytest.raises(AssertionError):
        assert_same_logprobs([-1.0], [-1.0, -2.0])
    with pytest.raises(AssertionError):
        assert_same_logprobs(None, [-1.0])
