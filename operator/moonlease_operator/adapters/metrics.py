"""The operator's Prometheus metrics (prometheus-client). Not pure: it holds collectors.

One `OperatorMetrics` per operator, on a registry of its choosing (the process default for
`moonlease operator`, a private one per operator in tests, so two operators in one process do
not collide). Names follow Prometheus conventions:

* `moonlease_operator_reconciles_total{result}`: reconciles by outcome (`success`, `invalid`,
  `error`);
* `moonlease_operator_reconcile_errors_total{kind}`: errors by kind (`api_<status>`, `other`);
* `moonlease_operator_api_retries_total{reason}`: requests retried (`conflict`, `status_<code>`);
* `moonlease_operator_reconcile_duration_seconds`: reconcile wall time (histogram);
* `moonlease_operator_current_stage{namespace,policy,stage}`: 1 for the stage a policy is at,
  0 for its other stages;
* `moonlease_operator_targets{namespace,policy,state}`: a policy's workloads per state
  (Pending, Updating, Ready, Failed, RollingBack, RolledBack);
* `moonlease_operator_policy_phase{namespace,policy,phase}`: 1 for the policy's phase;
* `moonlease_operator_ab_test_verdict{namespace,policy,verdict}`: 1 for an A/B test's final
  verdict (all 0 while it measures);
* `moonlease_operator_ab_test_effect{namespace,policy,metric,bound}`: each condition's effect
  (treatment - control, positive is better) as `estimate`, `lower` and `upper` bound.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from moonlease_operator.api import ABTestPhase, Phase, PolicyStatus, StageName, TargetPhase
from moonlease_operator.core.analysis import Outcome

VERDICTS = tuple(outcome.value for outcome in Outcome)
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        kwargs: dict[str, Any] = {"registry": registry} if registry is not None else {}
        self.registry = registry
        self.reconciles = Counter("moonlease_operator_reconciles", "Reconciles of MooncakeLeasePolicies by result",
                                  ["result"], **kwargs)
        self.errors = Counter("moonlease_operator_reconcile_errors", "Reconcile errors by kind", ["kind"], **kwargs)
        self.retries = Counter("moonlease_operator_api_retries", "Kubernetes API requests retried, by reason",
                               ["reason"], **kwargs)
        self.duration = Histogram("moonlease_operator_reconcile_duration_seconds", "Reconcile wall time",
                                  buckets=_BUCKETS, **kwargs)
        self.current_stage = Gauge("moonlease_operator_current_stage",
                                   "1 for the rollout stage a policy is at, 0 for its other stages",
                                   ["namespace", "policy", "stage"], **kwargs)
        self.targets = Gauge("moonlease_operator_targets", "Workloads of a policy per state",
                             ["namespace", "policy", "state"], **kwargs)
        self.phase = Gauge("moonlease_operator_policy_phase", "1 for the phase a policy is in",
                           ["namespace", "policy", "phase"], **kwargs)
        self.ab_phase = Gauge("moonlease_operator_ab_test_phase", "1 for the phase a policy's A/B test is in",
                              ["namespace", "policy", "phase"], **kwargs)
        self.ab_samples = Gauge("moonlease_operator_ab_test_samples", "Intervals an A/B test has measured",
                                ["namespace", "policy"], **kwargs)
        self.ab_errors = Gauge("moonlease_operator_ab_test_consecutive_errors",
                               "Failed A/B measurements in a row (source down, an arm without series)",
                               ["namespace", "policy"], **kwargs)

        self.ab_verdict = Gauge("moonlease_operator_ab_test_verdict",
                                "1 for the final verdict of a policy's A/B test (0 while measuring)",
                                ["namespace", "policy", "verdict"], **kwargs)
        self.ab_effect = Gauge("moonlease_operator_ab_test_effect",
                               "A/B effect per condition (treatment - control, positive is better) and its bounds",
                               ["namespace", "policy", "metric", "bound"], **kwargs)
        self._effect_series: dict[tuple[str, str], set[tuple[str, str]]] = {}

    def observe_reconcile(self, result: str, seconds: float | None) -> None:
        """Count a reconcile; `seconds` (None for one that failed midway) goes to the histogram."""
        self.reconciles.labels(result=result).inc()
        if seconds is not None:
            self.duration.observe(seconds)

    def observe_error(self, kind: str) -> None:
        self.errors.labels(kind=kind).inc()

    def observe_retry(self, reason: str) -> None:
        self.retries.labels(reason=reason).inc()

    def observe_status(self, namespace: str, policy: str, status: PolicyStatus) -> None:
        for stage in StageName:
            self.current_stage.labels(namespace, policy, stage.value).set(
                1 if status.current_stage is stage else 0)
        for state in TargetPhase:
            self.targets.labels(namespace, policy, state.value).set(
                sum(c.count for c in status.target_counts if c.phase is state))
        for phase in Phase:
            self.phase.labels(namespace, policy, phase.value).set(1 if status.phase is phase else 0)
        ab = status.ab_test
        for ab_phase in ABTestPhase:
            self.ab_phase.labels(namespace, policy, ab_phase.value).set(
                1 if ab is not None and ab.phase is ab_phase else 0)
        self.ab_samples.labels(namespace, policy).set(ab.samples if ab is not None else 0)
        for verdict in VERDICTS:
            self.ab_verdict.labels(namespace, policy, verdict).set(
                1 if ab is not None and ab.final_verdict == verdict else 0)
        series = set()
        for result in ab.conditions if ab is not None else ():
            for bound, value in (("estimate", result.effect), ("lower", result.lower), ("upper", result.upper)):
                if value is not None:
                    self.ab_effect.labels(namespace, policy, result.metric, bound).set(value)
                    series.add((result.metric, bound))
        self._forget_effects(namespace, policy, keep=series)
        self.ab_errors.labels(namespace, policy).set(ab.consecutive_errors if ab is not None else 0)

    def _forget_effects(self, namespace: str, policy: str, keep: set[tuple[str, str]]) -> None:
        """Drop effect series no longer measured (a removed condition, a bound gone unbounded)."""
        for metric, bound in self._effect_series.get((namespace, policy), set()) - keep:
            try:
                self.ab_effect.remove(namespace, policy, metric, bound)
            except KeyError:
                pass
        self._effect_series[(namespace, policy)] = keep

    def forget(self, namespace: str, policy: str) -> None:
        """Drop a deleted policy's series."""
        self._forget_effects(namespace, policy, keep=set())
        for verdict in VERDICTS:
            try:
                self.ab_verdict.remove(namespace, policy, verdict)
            except KeyError:
                pass
        for gauge, values in ((self.current_stage, StageName), (self.targets, TargetPhase), (self.phase, Phase),
                              (self.ab_phase, ABTestPhase)):
            for value in values:
                try:
                    gauge.remove(namespace, policy, value.value)
                except KeyError:
                    pass
        for gauge in (self.ab_samples, self.ab_errors):
            try:
                gauge.remove(namespace, policy)
            except KeyError:
                pass
