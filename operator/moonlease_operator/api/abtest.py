"""The `ABTest` rollout strategy's spec: `spec.rollout.abTest` of a MooncakeLeasePolicy. Pure.

Its status, `status.abTest`, is `api.abtest_status`.

The treatment workloads get the policy's connector (and master) settings through the staged
rollout; the control workloads keep what they run; the operator measures both arms every
`intervalSeconds` and promotes the treatment's settings to the control, rolls the treatment back,
or holds for a human. `core.ab_plan` plans it; `core.analysis` decides.
"""

from __future__ import annotations

import enum
import json
import re
from typing import Annotated, ClassVar

from pydantic import Field, model_validator

from moonlease_operator.api.common import ApiModel, CelRule, ObjectName

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


class BuiltinMetric(str, enum.Enum):
    """The metrics a condition can name without a custom query (`core.analysis` estimates them)."""

    PREFIX_HIT_RATE = "prefixCacheHitRate"
    EXTERNAL_HIT_RATE = "externalHitRate"
    TTFT_P50 = "ttftP50"
    TTFT_P90 = "ttftP90"
    TTFT_P99 = "ttftP99"
    PUT_FAILED_KEYS = "putFailedKeys"
    PUT_FAILURES = "putAllocFailures"
    EVICTIONS = "evictions"


class ConditionSpec(ApiModel):
    """Treatment vs control on one metric: built-in (prefixCacheHitRate, externalHitRate,
    ttftP50/P90/P99, putFailedKeys, putAllocFailures, evictions) or a name from
    `prometheus.customQueries`."""

    metric: MetricName
    direction: MetricDirection = MetricDirection.HIGHER_IS_BETTER
    """Which way is better. A built-in metric's is fixed: ttftP50/P90/P99, putFailedKeys,
    putAllocFailures and evictions need LowerIsBetter (refused otherwise)."""
    min_effect: Annotated[float, Field(ge=0)] = 0.0
    """Improvement (metric units) the treatment must show, at the configured confidence."""
    max_regression: Annotated[float, Field(ge=0)] = 0.0
    """Worsening (metric units) beyond which, at the configured confidence, the treatment fails."""
    guardrail: bool = False
    """Only fails; not required to improve."""


class AbortSpec(ApiModel):
    """Early abort on a clear regression."""

    consecutive_intervals: Annotated[int, Field(ge=1, le=20)] = 2
    """Intervals in a row the TTFT guard needs past `ttftThresholdSeconds`."""
    put_failure_guard: bool = True
    """Abort when the treatment's failed-put rate (its engines' failed put keys per put key
    attempted) exceeds the control's by more than `putFailureRateAllowance`, at the test's
    confidence (an always-valid test on the paired interval series, in the conditions' Holm
    family): arms that fail puts alike under store pressure do not abort."""
    put_failure_rate_allowance: Annotated[float, Field(ge=0, le=1)] = 0.01
    """Failed-put fraction the treatment may have above the control's (0.01: one put in a hundred)."""
    put_failure_allowance: Annotated[float, Field(ge=0)] = 0.0
    """Without the attempted-put counts (the engines export only failures, or only the masters'
    allocation failures are read): put failures per interval the treatment may have above the
    control's, tested the same way."""
    ttft_threshold_seconds: Annotated[float, Field(gt=0)] | None = None
    """Abort when the treatment's TTFT at `ttftQuantile` is past this in each of the intervals;
    unset: no TTFT guard."""
    ttft_quantile: Annotated[float, Field(gt=0, lt=1)] = 0.99


PromMatchers = Annotated[str, Field(min_length=1, max_length=1024)]


class ArmSelectorsSpec(ApiModel):
    """PromQL label matchers (the part inside `{...}`) picking each arm's series; they must
    differ (the operator also refuses the same matchers written in another order or spacing)."""

    control: PromMatchers
    treatment: PromMatchers


_DISTINCT_SELECTORS = CelRule(
    rule="!has(self.selectors) || self.selectors.control != self.selectors.treatment",
    message="selectors.control and selectors.treatment must differ: with the same matchers both arms read "
            "the same series and no condition can ever fail",
    field_path=".selectors",
)
_DISTINCT_STORE_SELECTORS = CelRule(
    rule="!has(self.storeSelectors) || self.storeSelectors.control != self.storeSelectors.treatment",
    message="storeSelectors.control and storeSelectors.treatment must differ (one master per arm); "
            "for one master shared by both arms use storeSelector",
    field_path=".storeSelectors",
)


# A CRD schema cannot constrain map keys (no patternProperties): a CEL rule does.
_METRIC_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,62}")
_QUERY_NAMES = CelRule(
    rule="!has(self.customQueries) || self.customQueries.all(name, name.matches('^[A-Za-z][A-Za-z0-9_]{0,62}$'))",
    message="customQueries names start with a letter and hold only letters, digits and underscores (at most 63)",
    field_path=".customQueries",
)


# A custom query may hold `$selector` (or `${selector}`) and `$$` (a literal `$`), nothing else
# after a `$`: PromQL's own `$` (a regex anchor, Grafana's `$__rate_interval`) must be written `$$`.
# ASCII only: the API server's RE2 reads `\b` (and every class) as ASCII where Python's `re` reads
# Unicode, so `$selectorø` would pass the CRD and be refused here; with ASCII text both engines
# give the same answer (tests/unit/test_policy_api checks it under both readings).
QUERY_TEMPLATE_PATTERN = r"^([\t\n\r -#%-~]|[$][$]|[$]selector\b|[$][{]selector[}])*$"
_QUERY_TEMPLATE = re.compile(QUERY_TEMPLATE_PATTERN, re.ASCII)
_PLACEHOLDER = re.compile(r"[$]([$]|selector\b|[{]selector[}])", re.ASCII)


def _every_query_matches(pattern: str, message: str) -> CelRule:
    """A rule that every custom query matches `pattern` (RE2 in the API server, `re` here)."""
    return CelRule(rule="!has(self.customQueries) || self.customQueries.all(name, self.customQueries[name].matches("
                   + json.dumps(pattern) + "))", message=message, field_path=".customQueries")


_QUERY_PLACEHOLDERS = _every_query_matches(
    QUERY_TEMPLATE_PATTERN, "customQueries are ASCII text that may use only the placeholder $selector (or ${selector});"
                            " write $$ for a literal $")


# A template uses the placeholder: `$selector` after any run of non-`$` text and `$$` pairs (so
# that `$$selector`, a literal "$selector", does not count).
QUERY_SELECTOR_PATTERN = r"^([^$]|[$][$])*[$]([{]selector[}]|selector\b)"
_QUERY_SELECTOR = re.compile(QUERY_SELECTOR_PATTERN, re.ASCII)
_QUERY_USES_SELECTOR = _every_query_matches(
    QUERY_SELECTOR_PATTERN, "every customQueries entry must use $selector (or ${selector}) to pick the arm's series:"
                            " without it both arms read the same number and the condition can never fail")


def render_custom_query(template: str, selector: str) -> str:
    """A custom query with `$selector` replaced by an arm's matchers and `$$` by `$`. The one
    substitution the operator does; templates are validated (`_QUERY_PLACEHOLDERS`) before."""
    if not _QUERY_TEMPLATE.match(template):
        raise ValueError(_QUERY_PLACEHOLDERS.message)
    return _PLACEHOLDER.sub(lambda m: "$" if m.group(1) == "$" else selector, template)


class PrometheusSpec(ApiModel):
    """Read the arms' metrics from a Prometheus server's HTTP API."""

    url: Annotated[str, Field(min_length=1, max_length=2048, pattern=r"^https?://")]
    """Base URL of the Prometheus server, e.g. http://prometheus-operated.monitoring:9090."""
    selectors: ArmSelectorsSpec | None = None
    """Label matchers per arm, e.g. `job="vllm-a"`; default: the pods of the arm's workloads, by
    `podLabel` and `namespaceLabel` (as kube-prometheus' PodMonitors and ServiceMonitors label
    them)."""
    store_selector: PromMatchers | None = None
    """Label matchers picking the Mooncake master's series (both arms share it); default: the
    master workload's pods, by `podLabel` and `namespaceLabel`."""
    store_selectors: ArmSelectorsSpec | None = None
    """Label matchers picking each arm's own Mooncake master, when the arms have separate masters
    (then master-level metrics, `evictions` and `putAllocFailures`, may be A/B conditions);
    overrides `storeSelector`."""
    pod_label: Annotated[str, Field(min_length=1, max_length=63)] = "pod"
    """Prometheus label holding the pod name."""
    namespace_label: Annotated[str, Field(min_length=1, max_length=63)] = "namespace"
    """Prometheus label holding the pod's namespace."""
    custom_queries: Annotated[dict[str, Annotated[str, Field(max_length=4096)]],
                              Field(max_length=16)] = Field(default_factory=dict)
    """{name: PromQL}; `$selector` is replaced by the arm's label matchers; must answer one number.
    Names start with a letter and hold letters, digits and underscores. A range (`[5m]`) longer
    than `intervalSeconds` is refused (OverlappingQueryWindows): overlapping windows would count
    the same traffic in several intervals."""

    cel_rules: ClassVar[tuple[CelRule, ...]] = (_QUERY_NAMES, _QUERY_PLACEHOLDERS, _QUERY_USES_SELECTOR,
                                                _DISTINCT_SELECTORS, _DISTINCT_STORE_SELECTORS)

    @model_validator(mode="after")
    def _check_names(self) -> PrometheusSpec:
        if not all(_METRIC_NAME.fullmatch(name) for name in self.custom_queries):
            raise _QUERY_NAMES.violation()
        if not all(_QUERY_TEMPLATE.match(query) for query in self.custom_queries.values()):
            raise _QUERY_PLACEHOLDERS.violation()
        if not all(_QUERY_SELECTOR.match(query) for query in self.custom_queries.values()):
            raise _QUERY_USES_SELECTOR.violation()
        if self.selectors is not None and self.selectors.control == self.selectors.treatment:
            raise _DISTINCT_SELECTORS.violation()
        if self.store_selectors is not None and self.store_selectors.control == self.store_selectors.treatment:
            raise _DISTINCT_STORE_SELECTORS.violation()
        return self


class ScrapeSpec(ApiModel):
    """Direct scraping of the arms' running pods when no Prometheus is configured."""

    port: Annotated[int, Field(ge=1, le=65535)] = 8000
    """Port of vLLM's /metrics; a pod's `prometheus.io/port` annotation overrides it."""
    path: Annotated[str, Field(max_length=256, pattern=r"^/")] = "/metrics"
    """Path of the metrics endpoint."""


_DISJOINT_ARMS = CelRule(
    rule="!self.control.workloads.exists(w, w in self.treatment.workloads)",
    message="a workload cannot be in both arms",
    field_path=".treatment.workloads",
)
BUILTIN_METRICS = tuple(m.value for m in BuiltinMetric)
_KNOWN_METRICS = CelRule(
    rule="!has(self.conditions) || self.conditions.all(c, c.metric in " + json.dumps(list(BUILTIN_METRICS))
    + " || (has(self.prometheus) && has(self.prometheus.customQueries) && c.metric in self.prometheus.customQueries))",
    message="each condition's metric must be built in or named in prometheus.customQueries",
    field_path=".conditions",
)
MASTER_METRICS = (BuiltinMetric.EVICTIONS.value, BuiltinMetric.PUT_FAILURES.value)
_MASTER_METRICS_NEED_MASTERS = CelRule(
    rule="!has(self.conditions) || !self.conditions.exists(c, c.metric in " + json.dumps(list(MASTER_METRICS))
    + ") || (has(self.prometheus) && has(self.prometheus.storeSelectors))",
    message="evictions and putAllocFailures compare the arms' masters: they need prometheus.storeSelectors "
            "(one master per arm); with one shared master both arms read the same series",
    field_path=".conditions",
)
_A_PRIMARY_CONDITION = CelRule(
    rule="!has(self.conditions) || self.conditions.exists(c, !has(c.guardrail) || !c.guardrail)",
    message="at least one condition must be primary (not a guardrail): guardrails alone would promote "
            "any treatment that is merely no worse",
    field_path=".conditions",
)
#: The direction of each built-in metric: fixed by what it measures (a reversed one would promote
#: a worse treatment).
BUILTIN_DIRECTIONS: dict[str, MetricDirection] = {
    m.value: MetricDirection.HIGHER_IS_BETTER if m in (BuiltinMetric.PREFIX_HIT_RATE, BuiltinMetric.EXTERNAL_HIT_RATE)
    else MetricDirection.LOWER_IS_BETTER for m in BuiltinMetric
}
_LOWER_BUILTINS = [m for m, d in BUILTIN_DIRECTIONS.items() if d is MetricDirection.LOWER_IS_BETTER]
_HIGHER_BUILTINS = [m for m, d in BUILTIN_DIRECTIONS.items() if d is MetricDirection.HIGHER_IS_BETTER]
_BUILTIN_DIRECTION = CelRule(
    rule="!has(self.conditions) || self.conditions.all(c, c.metric in " + json.dumps(_LOWER_BUILTINS)
    + " ? (has(c.direction) && c.direction == 'LowerIsBetter')"
    + " : (!(c.metric in " + json.dumps(_HIGHER_BUILTINS) + ") || !has(c.direction) || c.direction == 'HigherIsBetter'))",
    message="a built-in metric's direction is fixed: set direction: LowerIsBetter for " + ", ".join(_LOWER_BUILTINS)
            + " (the default, HigherIsBetter, would promote a slower or failing treatment); "
            + " and ".join(_HIGHER_BUILTINS) + " are HigherIsBetter",
    field_path=".conditions",
)
_MAX_AT_LEAST_MIN = CelRule(
    rule="self.maxSamples >= self.minSamples",
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
    warmup_seconds: Annotated[int, Field(ge=0, le=86400)] = 60
    """Seconds after the treatment is verified before the baseline is read: both arms' caches
    (the treatment's restarted engines start cold) fill before anything counts."""
    min_samples: Annotated[int, Field(ge=2, le=1000)] = 5
    max_samples: Annotated[int, Field(ge=2, le=10000)] = 30
    """Measured intervals after which an undecided test ends Inconclusive."""
    confidence: Annotated[float, Field(ge=0.5, lt=1)] = 0.95
    """1 - the family-wise error rate of the whole test, however often it is looked at: always-valid
    p-values (normal-mixture confidence sequences) with Holm's correction across conditions."""
    conditions: Annotated[list[ConditionSpec], Field(min_length=1, max_length=16)] = Field(
        default_factory=_default_conditions, json_schema_extra={"x-kubernetes-list-type": "atomic"},
    )
    consecutive_error_limit: Annotated[int, Field(ge=0, le=100)] = 4
    """Failed measurements in a row tolerated; one more makes the verdict Error (never final:
    measuring goes on and resumes with the next good measurement)."""
    abort: AbortSpec = Field(default_factory=AbortSpec, json_schema_extra={"default": {}})
    prometheus: PrometheusSpec | None = None
    scrape: ScrapeSpec = Field(default_factory=ScrapeSpec, json_schema_extra={"default": {}})
    on_success: SuccessAction = SuccessAction.PROMOTE
    on_failure: FailureAction = FailureAction.ROLLBACK
    on_inconclusive: FailureAction = FailureAction.HOLD

    cel_rules: ClassVar[tuple[CelRule, ...]] = (_DISJOINT_ARMS, _MAX_AT_LEAST_MIN, _KNOWN_METRICS,
                                                _MASTER_METRICS_NEED_MASTERS, _A_PRIMARY_CONDITION, _BUILTIN_DIRECTION)

    @model_validator(mode="after")
    def _check(self) -> ABTestSpec:
        if set(self.control.workloads) & set(self.treatment.workloads):
            raise _DISJOINT_ARMS.violation()
        if self.max_samples < self.min_samples:
            raise _MAX_AT_LEAST_MIN.violation()
        custom = self.prometheus.custom_queries if self.prometheus is not None else {}
        if any(c.metric not in BUILTIN_METRICS and c.metric not in custom for c in self.conditions):
            raise _KNOWN_METRICS.violation()
        if any(c.metric in MASTER_METRICS for c in self.conditions) and (
                self.prometheus is None or self.prometheus.store_selectors is None):
            raise _MASTER_METRICS_NEED_MASTERS.violation()
        if all(c.guardrail for c in self.conditions):
            raise _A_PRIMARY_CONDITION.violation()
        if any(BUILTIN_DIRECTIONS.get(c.metric, c.direction) is not c.direction for c in self.conditions):
            raise _BUILTIN_DIRECTION.violation()
        return self
