"""The A/A battery (issue 26): identical arms on the data a cache produces never decide more often
than the test's level, and a real effect of the documented size is found.

Each cell (`moonlease_dev.bench.ab_cells`) draws its per-interval data for every run at once (numpy,
seeded); every run then goes through the operator's own per-interval path — `fold_interval` then
`decide`, what `core.ab_plan.record_measurement` calls — looking after every interval up to
maxSamples and stopping at the first final verdict, as the operator does. A false decision is
Success, Failure or Abort on identical arms. Each cell must stay within alpha plus two Monte
Carlo standard errors. Thresholds are 0 (minEffect, maxRegression): the strictest case, where
any decision on identical arms is false; the cold-treatment cell uses the default spec's.
Few runs, to stay fast: `benchmarks/ab_calibration.py` runs the same cells with many more,
beside a fixed-horizon t-test and the rule before issue 26.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from moonlease_dev.bench.ab_cells import (
    ALPHA,
    CELLS,
    FALSE,
    MAX_SAMPLES,
    cold_cell,
    config_for,
    effect_cell,
    first_decisions,
    power_config,
    runs_of,
)
from moonlease_operator.core.analysis import Outcome
from moonlease_operator.core.sequential import minimum_detectable_effect

pytestmark = pytest.mark.unit

RUNS = 100
LIMIT = ALPHA + 2 * math.sqrt(ALPHA * (1 - ALPHA) / RUNS)


@pytest.mark.parametrize("conditions", [1, 3])
@pytest.mark.parametrize("name", CELLS)
def test_identical_arms_decide_falsely_at_most_alpha(name: str, conditions: int) -> None:
    cell, custom = CELLS[name]
    rng = np.random.default_rng(list(CELLS).index(name) * 10 + conditions)
    outcomes = first_decisions(config_for(conditions, custom=custom),
                               runs_of(cell(rng, RUNS), RUNS, with_ttft=conditions == 3))
    false = sum(outcomes.get(o, 0) for o in FALSE)
    assert false / RUNS <= LIMIT, (name, conditions, outcomes)


@pytest.mark.parametrize("conditions", [1, 3])
def test_a_cold_treatment_is_not_failed_under_the_default_thresholds(conditions: int) -> None:
    rng = np.random.default_rng(90 + conditions)
    config = config_for(conditions, min_effect=0.02, max_regression=0.02, ttft_regression=0.05)
    outcomes = first_decisions(config, runs_of(cold_cell(rng, RUNS), RUNS, with_ttft=conditions == 3))
    false = sum(outcomes.get(o, 0) for o in FALSE)
    assert false / RUNS <= LIMIT, outcomes


@pytest.mark.parametrize("drift", [0.0, 3.0])
def test_the_documented_effect_is_found_in_80_percent_of_runs(drift: float) -> None:
    """One condition, the table's detectable effect at 30 intervals (in units of the standard
    deviation of the per-interval difference), i.i.d. arms and arms under a drift common to both
    three times their own noise: Success by interval 30 in at least 80 % of runs."""
    runs = RUNS
    rng = np.random.default_rng(70 + int(drift))
    effect = minimum_detectable_effect(MAX_SAMPLES, conditions=1, tuned_at=12) * math.sqrt(2.0)
    outcomes = first_decisions(power_config(), runs_of(effect_cell(effect, drift)(rng, runs), runs))
    assert outcomes.get(Outcome.SUCCESS, 0) / runs >= 0.8, (effect, outcomes)
