"""The save guard's view of a step: its own exception, not whatever is in flight around it.

Plays vLLM's call order (`KVConnectorModelRunnerMixin._get_kv_connector_output`: bind before
the forward, the save from a `finally` after it) with a plain context manager of the same shape;
the engine tests (tests/connector/test_connector_engine.py) run it inside vLLM for real.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from moonlease_connector.adapters.vllm_step_outcome import StepOutcomeWatch

pytestmark = pytest.mark.unit


@contextmanager
def step(watch: StepOutcomeWatch, seen: list):
    watch.begin()  # bind_connector_metadata
    try:
        yield
    finally:
        seen.append(watch.failure())  # wait_for_save


def test_a_clean_step_has_no_failure() -> None:
    watch, seen = StepOutcomeWatch(), []
    with step(watch, seen):
        pass
    assert seen == [None]


def test_a_raising_step_fails_with_its_own_exception() -> None:
    watch, seen = StepOutcomeWatch(), []
    with pytest.raises(ZeroDivisionError), step(watch, seen):
        1 / 0  # noqa: B018
    assert isinstance(seen[0], ZeroDivisionError)


def test_a_clean_step_inside_an_unrelated_except_block_succeeds() -> None:
    watch, seen = StepOutcomeWatch(), []
    try:
        raise KeyError("unrelated")
    except KeyError:
        with step(watch, seen):
            pass
    assert seen == [None]


def test_a_raising_step_inside_an_unrelated_except_block_still_fails() -> None:
    watch, seen = StepOutcomeWatch(), []
    try:
        raise KeyError("unrelated")
    except KeyError:
        with pytest.raises(ValueError), step(watch, seen):
            raise ValueError("the step's own")  # noqa: B904 - raised inside the unrelated except on purpose
    assert isinstance(seen[0], ValueError)


def test_an_exception_the_step_handles_itself_is_no_failure() -> None:
    watch, seen = StepOutcomeWatch(), []
    with step(watch, seen):
        try:
            raise OSError("retried inside the forward")
        except OSError:
            pass
    assert seen == [None]
