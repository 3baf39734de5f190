"""The `ABTest` rollout strategy's status: `status.abTest` of a MooncakeLeasePolicy. Pure.

What the operator measured (each arm's values per interval and over the test), the running sums
the analysis resumes from after a restart (`core.analysis`), each condition's verdict and the
test's phase. The spec it runs is `api.abtest`.
"""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Annotated

from pydantic import Field

from moonlease_operator.api.common import StatusModel


class ArmValues(StatusModel):
    """One arm's values over one interval, or over the whole test (unset: not measured)."""

    prefix_hit_rate: float | None = None
    """Prefix-cache hit rate (hit tokens / queried tokens, local and store)."""
    external_hit_rate: float | None = None
    """Store (external prefix cache) hit rate, in tokens."""
    ttft_p90_seconds: float | None = None
    """90th percentile of time to first token."""
    put_failed_keys: float | None = None
    """Keys the arm's engines failed to put into the store (per interval)."""
    put_alloc_failures: float | None = None
    """Mooncake put-allocation failures (per interval)."""
    evictions: float | None = None
    """Keys the Mooncake master evicted (per interval)."""


class IntervalRecord(StatusModel):
    end: datetime
    control: ArmValues | None = None
    treatment: ArmValues | None = None
    error: Annotated[str, Field(max_length=1024)] | None = None


class RatioSumsStatus(StatusModel):
    """Running moments of one arm's (hits, queries) per interval (`core.analysis.RatioSums`)."""

    n: Annotated[int, Field(ge=0)] = 0
    mean_hits: float = 0.0
    mean_queries: float = 0.0
    c_hh: float = 0.0
    c_qq: float = 0.0
    c_hq: float = 0.0


class MeanSumsStatus(StatusModel):
    """Running mean and centred sum of squares (`core.analysis.MeanSums`)."""

    n: Annotated[int, Field(ge=0)] = 0
    mean: float = 0.0
    m2: float = 0.0


class BucketStatus(StatusModel):
    """One cumulative histogram bucket; `le` as Prometheus spells it (+Inf for the last)."""

    le: Annotated[str, Field(max_length=32)]
    count: float


class QuantileSumsStatus(StatusModel):
    """Pooled TTFT buckets and batch means of per-interval quantiles (`core.analysis.QuantileSums`)."""

    quantiles: Annotated[list[float], Field(max_length=8)] = Field(default_factory=list)
    intervals: Annotated[int, Field(ge=0)] = 0
    pooled: Annotated[list[BucketStatus], Field(max_length=128)] = Field(default_factory=list)
    batches: Annotated[list[MeanSumsStatus], Field(max_length=8)] = Field(default_factory=list)


class ArmTotalsStatus(StatusModel):
    """One arm's running sums (`core.analysis.ArmTotals`)."""

    prefix: RatioSumsStatus = Field(default_factory=RatioSumsStatus)
    external: RatioSumsStatus = Field(default_factory=RatioSumsStatus)
    ttft: QuantileSumsStatus = Field(default_factory=QuantileSumsStatus)
    put_alloc_failures: MeanSumsStatus = Field(default_factory=MeanSumsStatus)
    put_failed_keys: MeanSumsStatus = Field(default_factory=MeanSumsStatus)
    evictions: MeanSumsStatus = Field(default_factory=MeanSumsStatus)
    custom: Annotated[dict[str, MeanSumsStatus], Field(max_length=16)] = Field(default_factory=dict)


class GuardPointStatus(StatusModel):
    """What the abort guard reads of one measured interval."""

    put_excess: float | None = None
    treatment_ttft_s: float | None = None


class SeriesSumsStatus(StatusModel):
    """Running sums of one condition's paired per-interval vectors (`core.analysis.SeriesSums`):
    k values per interval, k x k cross products (row-major) at lags 0 and 1."""

    n: Annotated[int, Field(ge=0)] = 0
    origin: Annotated[list[float], Field(max_length=4)] = Field(default_factory=list)
    total: Annotated[list[float], Field(max_length=4)] = Field(default_factory=list)
    lag0: Annotated[list[float], Field(max_length=16)] = Field(default_factory=list)
    lag1: Annotated[list[float], Field(max_length=16)] = Field(default_factory=list)
    last: Annotated[list[float], Field(max_length=4)] = Field(default_factory=list)


class AnalysisStateStatus(StatusModel):
    """The analysis' state (`core.analysis.AnalysisState`): constant size, whatever the number
    of intervals."""

    format: Annotated[int, Field(ge=1)] = 1
    samples: Annotated[int, Field(ge=0)] = 0
    consecutive_errors: Annotated[int, Field(ge=0)] = 0
    last_error: Annotated[str, Field(max_length=4096)] | None = None
    control: ArmTotalsStatus = Field(default_factory=ArmTotalsStatus)
    treatment: ArmTotalsStatus = Field(default_factory=ArmTotalsStatus)
    recent: Annotated[list[GuardPointStatus], Field(max_length=20)] = Field(default_factory=list)
    paired: Annotated[dict[str, SeriesSumsStatus], Field(max_length=16)] = Field(default_factory=dict)
    """Per condition's metric: the paired series of the intervals both arms measured it in."""


class ConditionResultStatus(StatusModel):
    """One condition's result: both arms' estimates, the effect with its always-valid bounds,
    and what Holm's step-down made of it (`core.analysis.ConditionResult`)."""

    metric: Annotated[str, Field(max_length=63)]
    outcome: Annotated[str, Field(max_length=32)]
    """Success (a guardrail: within tolerance), Failure, Inconclusive or NoData."""
    control: float | None = None
    """The control's estimate over the whole test."""
    treatment: float | None = None
    """The treatment's estimate over the whole test."""
    effect: float | None = None
    """Treatment - control, signed so that positive is better."""
    lower: float | None = None
    """Lower bound of the effect's confidence sequence at `level` (unset: unbounded yet)."""
    upper: float | None = None
    """Upper bound of the effect's confidence sequence at `level` (unset: unbounded yet)."""
    p_value: float | None = None
    """Always-valid p-value of "no difference"."""
    level: float | None = None
    """The level Holm's step-down tested this condition at."""
    threshold: float | None = None
    """The effect the decision is made against: minEffect (a primary's Success), -maxRegression
    (Failure, and a guardrail's non-inferiority)."""
    autocorrelation: float | None = None
    """Lag-1 autocorrelation of the per-interval series the standard error came from."""
    paired: bool | None = None
    """Whether the arms were compared interval by interval (false: the unpaired fallback)."""
    samples: Annotated[int, Field(ge=0)] | None = None
    """Intervals behind the effect."""
    guardrail: bool | None = None
    """A guardrail (non-inferiority only): Inconclusive means Pending, not yet shown within tolerance."""


class ABTestPhase(str, enum.Enum):
    """Where an A/B test is.

    Deploying: the treatment is rolling out. Measuring: both arms run, intervals are measured.
    Promoting / Promoted: the control is getting / has the treatment's settings. RollingBack /
    RolledBack: the treatment is returning / has returned to what it ran before the test.
    AwaitingDecision: the test ended without an action (hold): annotate the policy to decide.
    """

    DEPLOYING = "Deploying"
    MEASURING = "Measuring"
    PROMOTING = "Promoting"
    PROMOTED = "Promoted"
    ROLLING_BACK = "RollingBack"
    ROLLED_BACK = "RolledBack"
    AWAITING_DECISION = "AwaitingDecision"


class ABTestStatus(StatusModel):
    """The A/B test of the current configuration: its phase, verdict, evidence and state."""

    phase: ABTestPhase = ABTestPhase.DEPLOYING
    """Deploying, Measuring, Promoting, Promoted, RollingBack, RolledBack or AwaitingDecision."""
    config_hash: Annotated[str, Field(max_length=128)] = ""
    """The configuration under test (status.desiredConfigHash when the test started)."""
    verdict: Annotated[str, Field(max_length=32)] | None = None
    """The verdict so far: Success, Failure, Inconclusive, Abort, NoData or Error."""
    final_verdict: Annotated[str, Field(max_length=32)] | None = None
    """The verdict once the test is final (decided, or held at maxSamples); unset while measuring."""
    progress: Annotated[str, Field(max_length=32)] = ""
    """Measured intervals / maxSamples, e.g. 7/30."""
    conditions: Annotated[list[ConditionResultStatus], Field(max_length=16)] = Field(default_factory=list)
    """Per condition: values, effect, bounds and outcome (latest measurement)."""
    reason: Annotated[str, Field(max_length=4096)] = ""
    """Why: per condition, treatment vs control with the effect and its uncertainty."""
    action: Annotated[str, Field(max_length=32)] = ""
    """What the verdict calls for: Continue, Promote, RollBack or Hold."""
    samples: Annotated[int, Field(ge=0)] = 0
    """Measured intervals (both arms measured)."""
    consecutive_errors: Annotated[int, Field(ge=0)] = 0
    """Failed measurements in a row (source down, an arm without series)."""
    started_at: datetime | None = None
    """When measuring started (the treatment was rolled out and verified)."""
    last_measured_at: datetime | None = None
    """When the arms were last read (the baseline, then the end of each interval)."""
    decided_at: datetime | None = None
    """When the test reached its outcome."""
    decision_annotation: Annotated[str, Field(max_length=256)] | None = None
    """The last `moonlease.io/ab-decision` value the operator handled (applied, or ignored with
    a VerbIgnored event saying why): each value is acted on, or refused, once."""
    control: ArmValues | None = None
    """The control's estimates over every measured interval."""
    treatment: ArmValues | None = None
    """The treatment's estimates over every measured interval."""
    history: Annotated[list[IntervalRecord], Field(max_length=50)] = Field(default_factory=list)
    """The latest intervals, newest last (bounded)."""
    analysis: AnalysisStateStatus | None = None
    """The analysis' running sums, so that a restarted operator decides as the one before it
    would have. Written and read by the operator."""
