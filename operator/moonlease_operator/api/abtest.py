"""The `ABTest` rollout strategy's spec and status models (issue 8). Pure.

Not yet part of `PolicySpec`: `spec.rollout.abTest` and `strategy: ABTest` are wired in once the
handler drives it (until then the CRD does not accept a strategy nothing would act on).
`core.ab_plan.build_analysis_config` turns an `ABTestSpec` into the analysis core's config.
"""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Annotated, ClassVar

from pydantic import Field, model_validator

from moonlease_operator.api.common import ApiModel, CelRule, ObjectName, StatusModel

MetricName = Annotated[str, Field(min_length=1, max_length=63, pattern=r"^[A-Za-z][A-Za-z0-9_]*$")]


class ArmSpec(ApiModel):
    """The workloads of one arm, by name (each must also be one of `spec.targets`)."""

    workloads: Annotated[list[ObjectName], Field(min_length=1, max_length=16)] = Field(
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )


class SuccessAction(str, enum.Enum):
    PROMOTE = "promote"
    """Give the control the treatment's settings."""
    HOLD = "hold"
    """Keep both arms as they are and wait for a human."""


class FailureAction(str, enum.Enum):
    ROLLBACK = "rollback"
    """Return the treatment to the control's settings."""
    HOLD = "hold"


class MetricDirection(str, enum.Enum):
    HIGHER_IS_BETTER = "HigherIsBetter"
    LOWER_IS_BETTER = "LowerIsBetter"


class ConditionSpec(ApiModel):
    """Treatment vs control on one metric: built-in (prefixCacheHitRate, externalHitRate,
    ttftP50/P90/P99, putAllocFailures, evictions) or a name from `prometheus.customQueries`."""

    metric: MetricName
    direction: MetricDirection = MetricDirection.HIGHER_IS_BETTER
    min_effect: Annotated[float, Field(ge=0)] = 0.0
    """Improvement (metric units) the treatment must show, at the configured confidence."""
    max_regression: Annotated[float, Field(ge=0)] = 0.0
    """Worsening (metric units) beyond which, at the configured confidence, the treatment fails."""
    guardrail: bool = False
    """Only fails; not required to improve."""


class AbortSpec(ApiModel):
    """Early abort on a clear regression, over the latest `consecutiveIntervals` intervals."""

    consecutive_intervals: Annotated[int, Field(ge=1, le=20)] = 2
    put_failure_allowance: Annotated[float, Field(ge=0)] | None = 0.0
    """Treatment put-allocation failures above the control's per interval; null disables."""
    ttft_threshold_seconds: Annotated[float, Field(gt=0)] | None = None
    """Treatment TTFT quantile past this aborts; null disables."""
    ttft_quantile: Annotated[float, Field(gt=0, lt=1)] = 0.99


class PrometheusSpec(ApiModel):
    url: Annotated[str, Field(min_length=1, max_length=2048, pattern=r"^https?://")]
    arm_label: Annotated[str, Field(min_length=1, max_length=63)] = "moonlease_io_arm"
    """Prometheus label carrying the pods' `moonlease.io/arm` label (Kubernetes SD labelmap)."""
    custom_queries: Annotated[dict[MetricName, Annotated[str, Field(max_length=4096)]],
                              Field(max_length=16)] = Field(default_factory=dict)
    """{name: PromQL}; `$selector` is replaced by the arm's label matcher; must answer one number."""


class ScrapeSpec(ApiModel):
    """Direct scraping of the arms' pods when no Prometheus is configured."""

    port: Annotated[int, Field(ge=1, le=65535)] = 8000
    path: Annotated[str, Field(max_length=256, pattern=r"^/")] = "/metrics"


_DISJOINT_ARMS = CelRule(
    rule="!self.control.workloads.exists(w, w in self.treatment.workloads)",
    message="a workload cannot be in both arms",
    field_path=".treatment.workloads",
)
_MAX_AT_LEAST_MIN = CelRule(
    rule="!has(self.maxSamples) || self.maxSamples >= self.minSamples",
    message="maxSamples must be at least minSamples",
    field_path=".maxSamples",
)


def _default_conditions() -> list[ConditionSpec]:
    return [
        ConditionSpec(metric="externalHitRate", min_effect=0.02, max_regression=0.02),
        ConditionSpec(metric="ttftP90", direction=MetricDirection.LOWER_IS_BETTER, max_regression=0.05,
                      guardrail=True),
    ]


class ABTestSpec(ApiModel):
    """Measure a control and a treatment on live traffic, then promote, roll back or hold."""

    control: ArmSpec
    treatment: ArmSpec
    interval_seconds: Annotated[int, Field(ge=5, le=3600)] = 60
    min_samples: Annotated[int, Field(ge=2, le=1000)] = 5
    max_samples: Annotated[int, Field(ge=2, le=10000)] | None = 30
    """Intervals after which an undecided test ends Inconclusive; null: run until decided."""
    confidence: Annotated[float, Field(ge=0.5, lt=1)] = 0.95
    """Two-sided confidence of the effect's interval."""
    conditions: Annotated[list[ConditionSpec], Field(min_length=1, max_length=16)] = Field(
        default_factory=_default_conditions, json_schema_extra={"x-kubernetes-list-type": "atomic"},
    )
    consecutive_error_limit: Annotated[int, Field(ge=0, le=100)] = 4
    abort: AbortSpec = Field(default_factory=AbortSpec, json_schema_extra={"default": {}})
    prometheus: PrometheusSpec | None = None
    scrape: ScrapeSpec = Field(default_factory=ScrapeSpec, json_schema_extra={"default": {}})
    on_success: SuccessAction = SuccessAction.PROMOTE
    on_failure: FailureAction = FailureAction.ROLLBACK
    on_inconclusive: FailureAction = FailureAction.HOLD

    cel_rules: ClassVar[tuple[CelRule, ...]] = (_DISJOINT_ARMS, _MAX_AT_LEAST_MIN)

    @model_validator(mode="after")
    def _check(self) -> ABTestSpec:
        if set(self.control.workloads) & set(self.treatment.workloads):
            raise _DISJOINT_ARMS.violation()
        if self.max_samples is not None and self.max_samples < self.min_samples:
            raise _MAX_AT_LEAST_MIN.violation()
        return self


# ---- status ---------------------------------------------------------------------------------------

class ArmValues(StatusModel):
    """One arm's values over one interval (null: not measured)."""

    prefix_hit_rate: float | None = None
    external_hit_rate: float | None = None
    ttft_p90_seconds: float | None = None
    put_alloc_failures: float | None = None
    evictions: float | None = None


class IntervalRecord(StatusModel):
    end: datetime
    control: ArmValues | None = None
    treatment: ArmValues | None = None
    error: Annotated[str, Field(max_length=1024)] | None = None


class ABTestStatus(StatusModel):
    verdict: Annotated[str, Field(max_length=32)]
    """Success, Failure, Inconclusive, Abort, NoData or Error."""
    reason: Annotated[str, Field(max_length=4096)] = ""
    action: Annotated[str, Field(max_length=32)] = ""
    """What the operator did or does next: Continue, Promote, RollBack or Hold."""
    samples: Annotated[int, Field(ge=0)] = 0
    started_at: datetime | None = None
    last_measured_at: datetime | None = None
    history: Annotated[list[IntervalRecord], Field(max_length=50)] = Field(default_factory=list)
    """The latest intervals, newest last (bounded)."""
