"""Why an A/B spec cannot run as written, or runs with a warning. Pure.

The checks read only the spec (and, for the arm mix, the arms' replicas): arms holding
different roles, custom queries whose ranges overlap consecutive intervals or that read raw
counters, arm selectors that pick the same series, and prefill/decode mixes far apart.
`core.rollout.admission` turns a refusal into a condition and an Event; `core.rollout.ab_test`
warns about the mix.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from moonlease_operator.api.abtest import ABTestSpec
from moonlease_operator.api.policy import PolicySpec


def evaluate_arm_roles(spec: PolicySpec) -> str | None:
    """Why the A/B arms cannot be compared, or None: both arms must hold the same roles (a
    prefill-only control against a decode-only treatment compares roles, not lease modes)."""
    ab = spec.rollout.ab_test
    if ab is None:
        return None
    roles = {t.name: t.role.value for t in spec.targets if t.name is not None}
    control = sorted({roles[n] for n in ab.control.workloads if n in roles})
    treatment = sorted({roles[n] for n in ab.treatment.workloads if n in roles})
    if control == treatment:
        return None
    return (f"the A/B arms must hold the same roles: control has {', '.join(control) or 'none'}, "
            f"treatment has {', '.join(treatment) or 'none'}")


_RANGE = re.compile(r"\[\s*((?:\d+(?:\.\d+)?(?:ms|[smhdwy]))+)\s*(?::[^\]]*)?\]")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|[smhdwy])")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def promql_range_seconds(query: str) -> list[float]:
    """The ranges (`[5m]`, a subquery's `[1h:1m]`) a PromQL query reads over, in seconds."""
    return [sum(float(number) * _UNIT_SECONDS[unit] for number, unit in _DURATION_PART.findall(found))
            for found in _RANGE.findall(query)]


def evaluate_custom_query_windows(spec: PolicySpec) -> str | None:
    """Why a custom query cannot be an A/B metric, or None: one that reads over a range longer
    than `intervalSeconds` (`rate(x[5m])` read every 60 s) makes consecutive intervals share
    most of their data, so the analysis would count the same traffic several times over (40 %
    false decisions on A/A data: benchmarks/results/ab_calibration.md). A range at most the interval (`increase(x[60s])`,
    or `[$__interval]`-free `rate(x[1m])` at intervalSeconds 60) keeps the windows apart."""
    ab = spec.rollout.ab_test
    if ab is None or ab.prometheus is None:
        return None
    for name, query in sorted(ab.prometheus.custom_queries.items()):
        longest = max(promql_range_seconds(query), default=0.0)
        if longest > ab.interval_seconds:
            return (f"prometheus.customQueries.{name} reads a {longest:g}s range, longer than intervalSeconds "
                    f"({ab.interval_seconds}s): consecutive intervals would overlap and count the same traffic "
                    f"twice; use a range of at most {ab.interval_seconds}s (e.g. increase(...[{ab.interval_seconds}s]))")
    return None


MIX_RATIO_LIMIT = 2.0
"""How far apart the arms' prefill:decode replica ratios may be before `UnbalancedArms` warns."""


def evaluate_arm_mix(spec: ABTestSpec, replicas: Mapping[str, tuple[str, int]]) -> str | None:
    """A warning when the arms' prefill/decode mixes differ by more than `MIX_RATIO_LIMIT`, or
    None. `replicas`: {workload: (role, replicas)}. An arm with more prefill per decode engine
    stores and loads a different share of the KV cache, so its hit rate and TTFT move for that
    reason alone: the test would measure the mix, not the lease settings. Warned, not refused:
    a mix may be deliberate (arms sized to their traffic)."""
    def mix(workloads: list[str]) -> tuple[int, int]:
        counted = [replicas[n] for n in workloads if n in replicas]
        return (sum(r for role, r in counted if role == "prefill"), sum(r for role, r in counted if role == "decode"))

    (cp, cd), (tp, td) = mix(spec.control.workloads), mix(spec.treatment.workloads)
    if not (cp and cd and tp and td):
        return None  # a one-role arm (both arms hold the same roles: MismatchedArms refuses otherwise)
    ratio = (cp / cd) / (tp / td)
    if max(ratio, 1 / ratio) <= MIX_RATIO_LIMIT:
        return None
    return (f"the arms' prefill/decode mixes differ: control {cp} prefill : {cd} decode replicas, treatment "
            f"{tp} : {td}; the effect would include the mix, not only the settings: give both arms about the "
            f"same prefill:decode ratio (within {MIX_RATIO_LIMIT:g}x)")


# PromQL, coarsely: enough to tell a metric name from a function, a label, a string or a range.
_PROMQL_TOKEN = re.compile(r"""
    (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<number>[0-9][A-Za-z0-9_.]*)
  | (?P<name>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<range>\[[^\]]*\])
  | (?P<punct>[(){}])
  | (?P<other>.)""", re.VERBOSE | re.DOTALL)
# `_count` and `_sum` are left out: gauges carry them too (Mooncake's `master_key_count`).
_COUNTER_SUFFIXES = ("_total", "_bucket")
_COUNTER_FUNCTIONS = frozenset({"rate", "irate", "increase", "resets"})
_LABEL_LISTS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})


def raw_counters(query: str) -> list[str]:
    """The counters (`*_total`, and a histogram's `*_bucket`) a PromQL query reads outside
    rate(), irate(), increase() and resets(): their values are totals since each process
    started. A name picked by a `__name__` matcher counts too."""
    found: list[str] = []
    calls: list[str] = []  # per open parenthesis: the function it calls ("" for a group)
    braces = 0
    previous = ""  # the last name token
    tokens = [(m.lastgroup, m.group()) for m in _PROMQL_TOKEN.finditer(query)]
    significant = [(kind, text) for kind, text in tokens if not (kind == "other" and text.isspace())]
    for i, (kind, text) in enumerate(significant):
        following = significant[i + 1][1] if i + 1 < len(significant) else ""
        rated = any(c in _COUNTER_FUNCTIONS for c in calls)
        if kind == "punct":
            if text == "(":
                calls.append(previous if significant[i - 1:i] and significant[i - 1][0] == "name" else "")
            elif text == ")" and calls:
                calls.pop()
            elif text == "{":
                braces += 1
            elif text == "}":
                braces = max(0, braces - 1)
        elif kind == "string" and braces and previous == "__name__" and not rated:
            name = text[1:-1]
            if any(suffix in name for suffix in _COUNTER_SUFFIXES):
                found.append(name)
        elif kind == "name":
            in_label_list = bool(calls) and calls[-1] in _LABEL_LISTS
            if (not braces and not in_label_list and following != "(" and not rated
                    and text.endswith(_COUNTER_SUFFIXES)):
                found.append(text)
            previous = text
        if kind in ("punct", "number", "range"):
            previous = ""
    return found


def evaluate_custom_query_counters(spec: PolicySpec) -> str | None:
    """Why a custom query cannot be an A/B metric, or None: one that reads a raw counter
    (`sum(x_total{$selector})`) compares the arms' totals since their engines started, i.e.
    their uptime and past traffic, not this interval's behaviour."""
    ab = spec.rollout.ab_test
    if ab is None or ab.prometheus is None:
        return None
    for name, query in sorted(ab.prometheus.custom_queries.items()):
        counters = raw_counters(query)
        if counters:
            return (f"prometheus.customQueries.{name} reads the counter {counters[0]} without rate(), irate() or "
                    f"increase(): its value is the total since each engine started, so the arms would be compared "
                    f"on their uptime; wrap it, e.g. increase({counters[0]}{{$selector}}[{ab.interval_seconds}s])")
    return None


_MATCHER = re.compile(r"""\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*("(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)\s*(?:,|$)""")


def _matcher_set(matchers: str) -> frozenset[tuple[str, str, str]] | str:
    """Label matchers as a set of (label, operator, value): the same matchers in any order or
    spacing compare equal. Text that does not parse compares as itself, spaces removed."""
    parsed = list(_MATCHER.finditer(matchers.strip()))
    if not parsed or "".join(m.group() for m in parsed).strip() != matchers.strip():
        return "".join(matchers.split())
    return frozenset((m.group(1), m.group(2), m.group(3)[1:-1]) for m in parsed)


def evaluate_arm_selectors(spec: PolicySpec) -> str | None:
    """Why the arms' Prometheus selectors cannot tell them apart, or None: the same matchers
    (in any order or spacing; the API server refuses only the identical text) make both arms
    read the same series, so every effect is 0 and no condition can fail."""
    ab = spec.rollout.ab_test
    prometheus = ab.prometheus if ab is not None else None
    if prometheus is None:
        return None
    for field, pair in (("selectors", prometheus.selectors), ("storeSelectors", prometheus.store_selectors)):
        if pair is not None and _matcher_set(pair.control) == _matcher_set(pair.treatment):
            return (f"prometheus.{field}.control ({pair.control}) and .treatment ({pair.treatment}) pick the same "
                    f"series: both arms would read the same numbers; give each arm its own matchers "
                    f"(e.g. its workloads' pod names)")
    return None
