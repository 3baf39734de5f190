"""A/B test calibration (issue 26): false decisions on identical arms, and power, per data shape.

Every cell of `moonlease_dev.bench.ab_cells` (the unit tier's A/A battery, with many more runs) is
decided three ways, each looking as stated:

* `current`: the operator's rule, through `fold_interval` / `decide`, after every interval up to
  maxSamples (30), stopping at the first final verdict;
* `previous`: the rule before issue 26 (unpaired, independent intervals, point-estimate
  thresholds, the put guard on counts), loaded from `git show <ref>:.../core/analysis.py`,
  through its own `fold_interval` / `decide`, looked at the same way;
* `t-test`: a fixed-horizon test, one look at interval 30: per condition Welch's t on the arms'
  per-interval values (unpaired, intervals taken as independent), Bonferroni across conditions.

Thresholds 0 (any decision on identical arms is false), except the cold-treatment cell (the
default spec's). Power cells: one custom condition, the README's detectable effect at 30
intervals, i.i.d. and under a drift common to both arms (AR(1) 0.95, three times the arms' own
noise).

    .venv/bin/python benchmarks/ab_calibration.py --runs 500      # ~10 min on 2 busy cores
    .venv/bin/python benchmarks/ab_calibration.py --runs 100      # quick look

Writes benchmarks/results/ab_calibration.md (and prints it).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import math
import platform
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

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
from moonlease_operator.core.analysis import AnalysisConfig, IntervalSample, Outcome, TTFT_QUANTILES, histogram_quantile
from moonlease_operator.core.sequential import minimum_detectable_effect, t_two_sided_tail

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "ab_calibration.md"
ANALYSIS = "operator/moonlease_operator/core/analysis.py"


def load_previous(ref: str) -> ModuleType:
    """The analysis module as it was at `ref` (it imports today's `core.sequential`, whose
    functions it calls with the same arguments as then)."""
    source = subprocess.run(["git", "show", f"{ref}:{ANALYSIS}"], cwd=REPO, check=True, capture_output=True,
                            text=True).stdout
    spec = importlib.util.spec_from_loader("previous_analysis", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["previous_analysis"] = module
    exec(compile(source, f"{ref}:{ANALYSIS}", "exec"), module.__dict__)  # noqa: S102 - our own file, from git
    return module


def to_previous(old: ModuleType, interval: IntervalSample) -> Any:
    def arm(sample: Any) -> Any:
        if sample is None:
            return None
        fields = {f.name for f in dataclasses.fields(old.ArmSample)}
        return old.ArmSample(**{k: v for k, v in dataclasses.asdict(sample).items() if k in fields and k != "ttft"},
                             ttft=old.Histogram(sample.ttft.buckets) if sample.ttft is not None else None)

    return old.IntervalSample(interval.start, interval.end, arm(interval.control), arm(interval.treatment),
                              interval.error)


def previous_config(old: ModuleType, config: AnalysisConfig) -> Any:
    return old.AnalysisConfig(
        conditions=tuple(old.Condition(c.metric, c.direction, c.min_effect, c.max_regression, c.guardrail)
                         for c in config.conditions),
        min_samples=config.min_samples, max_samples=config.max_samples, confidence=config.confidence,
        consecutive_error_limit=config.consecutive_error_limit,
        guard=old.AbortGuard() if config.guard.put_failure_allowance is not None
        else old.AbortGuard(put_failure_allowance=None))


def previous_decisions(old: ModuleType, config: AnalysisConfig, runs: list[list[IntervalSample]]) -> dict[str, int]:
    cfg = previous_config(old, config)
    outcomes: dict[str, int] = {}
    for intervals in runs:
        state = old.AnalysisState()
        for interval in intervals:
            state = old.fold_interval(state, to_previous(old, interval), cfg)
            if state.samples < 1:
                continue
            verdict = old.decide(state, cfg)
            if verdict.final:
                outcomes[verdict.outcome.value] = outcomes.get(verdict.outcome.value, 0) + 1
                break
    return outcomes


def _value(metric: str, sample: Any) -> float | None:
    if metric in ("externalHitRate", "prefixCacheHitRate"):
        hits, queries = ((sample.external_hits, sample.external_queries) if metric == "externalHitRate"
                         else (sample.prefix_hits, sample.prefix_queries))
        return hits / queries if hits is not None and queries else None
    if metric in TTFT_QUANTILES:
        return histogram_quantile(TTFT_QUANTILES[metric], sample.ttft) if sample.ttft is not None else None
    return sample.custom.get(metric)


def t_test_decisions(config: AnalysisConfig, runs: list[list[IntervalSample]]) -> dict[str, int]:
    """One look at the last interval: Welch's t per condition at alpha / m, thresholds as the
    conditions state them (a decision is a significant difference beyond them)."""
    m = len(config.conditions)
    decided = 0
    for intervals in runs:
        measured = [i for i in intervals if not i.failed]
        for condition in config.conditions:
            c = [v for i in measured if (v := _value(condition.metric, i.control)) is not None]
            t = [v for i in measured if (v := _value(condition.metric, i.treatment)) is not None]
            if len(c) < 2 or len(t) < 2:
                continue
            sign = 1.0 if condition.direction.value == "HigherIsBetter" else -1.0
            effect = sign * (float(np.mean(t)) - float(np.mean(c)))
            vc, vt = float(np.var(c, ddof=1)) / len(c), float(np.var(t, ddof=1)) / len(t)
            se = math.sqrt(vc + vt)
            if se == 0:
                continue
            df = (vc + vt) ** 2 / ((vc ** 2 / (len(c) - 1)) + (vt ** 2 / (len(t) - 1)) or 1e-300)
            threshold = condition.min_effect if effect > 0 and not condition.guardrail else -condition.max_regression
            if (effect > 0 and condition.guardrail) or (not condition.guardrail and -condition.max_regression < effect < condition.min_effect):
                continue
            if t_two_sided_tail((effect - threshold) / se, max(1, math.floor(df))) <= ALPHA / m:
                decided += 1
                break
    return {"decided": decided}


def false_count(outcomes: dict[Any, int]) -> int:
    names = {o.value for o in FALSE}
    return sum(n for k, n in outcomes.items() if (k.value if isinstance(k, Outcome) else k) in names | {"decided"})


def rate(k: int, n: int) -> str:
    return f"{100 * k / n:.1f} % ± {100 * 2 * math.sqrt(max(k, 0.5) / n * (1 - k / n) / n):.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=500, help="runs per cell (default 500)")
    parser.add_argument("--previous", default="6303228", help="git ref of the rule before issue 26")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    old = load_previous(args.previous)
    runs = args.runs
    started = time.monotonic()
    rows = []
    cells: list[tuple[str, int, Any, AnalysisConfig]] = []
    for name, (cell, custom) in CELLS.items():
        for conditions in (1, 3):
            cells.append((name, conditions, lambda rng, n, cell=cell: cell(rng, n), config_for(conditions, custom=custom)))
    for conditions in (1, 3):
        cells.append(("cold-treatment (default thresholds)", conditions, cold_cell,
                      config_for(conditions, min_effect=0.02, max_regression=0.02, ttft_regression=0.05)))
    for seed, (name, conditions, make, config) in enumerate(cells):
        data = runs_of(make(np.random.default_rng(1000 + seed), runs), runs, with_ttft=conditions == 3)
        current = false_count(first_decisions(config, data))
        previous = false_count(previous_decisions(old, config, data))
        fixed = false_count(t_test_decisions(config, data))
        rows.append(f"| {name} | {conditions} | {rate(current, runs)} | {rate(fixed, runs)} | {rate(previous, runs)} |")
        print(rows[-1], flush=True)
    effect = minimum_detectable_effect(MAX_SAMPLES, conditions=1, tuned_at=12) * math.sqrt(2.0)
    power_rows = []
    for drift in (0.0, 3.0):
        data = runs_of(effect_cell(effect, drift)(np.random.default_rng(2000 + int(drift)), runs), runs)
        current = first_decisions(power_config(), data).get(Outcome.SUCCESS, 0)
        previous = previous_decisions(old, power_config(), data).get("Success", 0)
        fixed = false_count(t_test_decisions(power_config(), data))
        label = "i.i.d." if not drift else f"common drift (σ {drift:g})"
        power_rows.append(f"| {label} | {rate(current, runs)} | {rate(fixed, runs)} | {rate(previous, runs)} |")
        print(power_rows[-1], flush=True)
    elapsed = time.monotonic() - started
    limit = ALPHA + 2 * math.sqrt(ALPHA * (1 - ALPHA) / runs)
    report = f"""# A/B test calibration

Written by `benchmarks/ab_calibration.py --runs {runs}` on {datetime.date.today().isoformat()}
({platform.machine()}, Python {platform.python_version()}, {elapsed / 60:.1f} min). Reproduce with

    .venv/bin/python benchmarks/ab_calibration.py --runs {runs}

{runs} seeded runs per cell; each rate ± two Monte Carlo standard errors. Nominal α {ALPHA:g};
the unit tier's battery asserts `current` ≤ α + 2 MC SE ({100 * limit:.1f} % at this many runs)
in every A/A cell, with fewer runs. Cells and rules: see the script's docstring. `current`
and `previous` look after every interval up to 30 and stop at the first final verdict (the
operator's loop); `t-test` looks once, at 30.

## False decisions on identical arms (Success, Failure or Abort)

| cell | conditions | current | fixed-horizon t-test | previous rule |
| --- | ---: | ---: | ---: | ---: |
""" + "\n".join(rows) + f"""

## Power: Success by interval 30 at the README's detectable effect

One condition, effect {effect:.3f} (1 σ of each arm = 1; the table's 30-interval figure times √2).

| data | current | fixed-horizon t-test | previous rule |
| --- | ---: | ---: | ---: |
""" + "\n".join(power_rows) + "\n"
    args.output.write_text(report)
    print(report)


if __name__ == "__main__":
    main()
