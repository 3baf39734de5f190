"""The chart grants the operator exactly the API calls it makes: nothing missing, nothing unused.

The calls are the ones the local API server recorded (method, path, RBAC verb and resource,
namespace) from two sources:

* every operator test of this session (tests/operator/; tests/fixtures/kube.py records them),
  when they ran — this module runs after them whatever the collection order
  (tests/chart/conftest.py);
* a scenario run here, so that the test means the same when it runs alone: the chart installed
  by Helm, plus the operator driven through every request it makes
  (operator_scenario.drive_every_call), cluster-wide (`operator.watchNamespaces: ["*"]`) and
  with named namespaces; the rules compared are those the install created.

The chart's Roles and ClusterRoles are evaluated as the API server's RBAC authorizer would for
the operator's ServiceAccount: a ClusterRoleBinding grants everywhere, a RoleBinding only in its
namespace. Requests for non-resource URLs (API discovery: /api, /apis/...) are left out: every
authenticated user may make them (the built-in system:discovery role).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
import helm_python as helm
import pytest

from moonlease_dev.testbed.kube import ApiCall, LocalApiServer
from tests.chart.operator_scenario import OTHER_NAMESPACE, drive_every_call
from tests.chart.rendering import NAMESPACE, JsonObj, find, one, render_objects
from tests.fixtures.kube import OPERATOR_API_CALLS, OPERATOR_USER_AGENTS

pytestmark = [pytest.mark.chart, pytest.mark.operator]
RUN_AFTER_OPERATOR_TESTS = True  # see tests/chart/conftest.py


@dataclass(frozen=True)
class Need:
    """What one request needs from RBAC: verb on group/resource, in a namespace or cluster-wide."""

    verb: str
    group: str
    resource: str  # resource or resource/subresource, as rules spell it
    namespace: str | None  # None: a cluster-scoped request (or across all namespaces)

    def __str__(self) -> str:
        where = f"in namespace {self.namespace}" if self.namespace else "cluster-wide"
        return f"{self.verb} {self.resource}{'.' + self.group if self.group else ''} {where}"


@dataclass(frozen=True)
class Grant:
    """One verb on one resource of one group, granted by a rule through a binding."""

    verb: str
    group: str
    resource: str
    scope: str | None  # None: everywhere (ClusterRoleBinding); else the RoleBinding's namespace
    role: str  # "Role name" or "ClusterRole name": one rendered rule set (a Role per namespace)
    binding: str

    def allows(self, need: Need) -> bool:
        return (self.verb in (need.verb, "*") and self.group in (need.group, "*")
                and self.resource in (need.resource, "*")
                and (self.scope is None or self.scope == need.namespace))

    @property
    def rule(self) -> str:
        """The rule this grant comes from, whichever namespace it is bound in."""
        where = "cluster-wide" if self.scope is None else "in its namespaces"
        return f"{self.verb} {self.resource}{'.' + self.group if self.group else ''} {where} ({self.role})"


def needs(calls: Iterable[ApiCall]) -> set[Need]:
    return {Need(c.verb, c.group or "", c.rbac_resource, c.namespace) for c in calls
            if c.verb is not None and c.rbac_resource is not None}


def grants(objects: Sequence[JsonObj], service_account: str, namespace: str) -> list[Grant]:
    """What the chart grants the operator's ServiceAccount, rule by rule."""
    roles = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]): o
             for o in objects if o["kind"] in ("ClusterRole", "Role")}
    found: list[Grant] = []
    for binding in (o for o in objects if o["kind"] in ("ClusterRoleBinding", "RoleBinding")):
        if {"kind": "ServiceAccount", "name": service_account, "namespace": namespace} not in binding["subjects"]:
            continue
        scope = binding["metadata"].get("namespace") if binding["kind"] == "RoleBinding" else None
        ref = binding["roleRef"]
        role = roles[(ref["kind"], scope if ref["kind"] == "Role" else None, ref["name"])]
        for rule in role["rules"]:
            found += [Grant(verb, group, resource, scope, f"{ref['kind']} {ref['name']}",
                            f"{binding['kind']} {binding['metadata']['name']}")
                      for group in rule["apiGroups"] for resource in rule["resources"] for verb in rule["verbs"]]
    return found


def compare(chart_grants: list[Grant], seen: set[Need]) -> tuple[list[str], list[str]]:
    """(needs no grant allows, rules no need uses). A Role rendered into several namespaces is
    one rule set: its rule is used when a call in any of those namespaces uses it."""
    missing = sorted(str(n) for n in seen if not any(g.allows(n) for g in chart_grants))
    used = {g.rule for g in chart_grants if any(g.allows(n) for n in seen)}
    unused = sorted({g.rule for g in chart_grants} - used)
    return missing, unused


def operator_identity(objects: Sequence[JsonObj]) -> tuple[str, str]:
    """The ServiceAccount the operator's pods run as (the one the rules must be bound to)."""
    deployment = one(objects, "Deployment", "moonlease-operator")
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert one(objects, "ServiceAccount", account)["metadata"]["namespace"] == NAMESPACE
    return account, NAMESPACE


async def scenario_calls(kube: LocalApiServer, values: JsonObj,
                         namespaces: Sequence[str]) -> tuple[list[JsonObj], list[ApiCall]]:
    """What the release installed with `values`, and the operator's calls over it."""
    objects = await drive_every_call(kube, values, namespaces=namespaces)
    return objects, [c for c in kube.api_calls() if c.user_agent.startswith(OPERATOR_USER_AGENTS)]


def report(missing: list[str], unused: list[str], origin: dict[Need, str] | None = None) -> str:
    lines = ["the chart's RBAC does not match the operator's API calls"]
    lines += [f"  missing: {m}" for m in missing]
    lines += [f"  unused:  {u}" for u in unused]
    if origin:
        lines += [f"  first needed by {test}: {need}" for need, test in sorted(origin.items(), key=str)
                  if str(need) in missing]
    return "\n".join(lines)


async def test_cluster_wide_rules_are_exactly_the_operators_calls(release_kube: LocalApiServer) -> None:
    objects, calls = await scenario_calls(release_kube, {"operator": {"watchNamespaces": ["*"]}}, namespaces=())
    assert not find(objects, "Role") and not find(objects, "RoleBinding")
    chart_grants = grants(objects, *operator_identity(objects))

    # The operator tests of this session (cluster-wide operators, like the chart's default).
    origin: dict[Need, str] = {}
    for test, call in OPERATOR_API_CALLS:
        for need in needs([call]):
            origin.setdefault(need, test)
    seen = needs(calls) | set(origin)

    missing, unused = compare(chart_grants, seen)
    assert (missing, unused) == ([], []), report(missing, unused, origin)


async def test_namespaced_rules_are_exactly_the_operators_calls(release_kube: LocalApiServer) -> None:
    watched = [NAMESPACE, OTHER_NAMESPACE]
    objects, calls = await scenario_calls(release_kube, {"operator": {"watchNamespaces": watched}}, namespaces=watched)
    assert sorted(o["metadata"]["namespace"] for o in find(objects, "Role")) == sorted(watched)
    chart_grants = grants(objects, *operator_identity(objects))
    seen = needs(calls)
    # Namespaced resources are only ever requested inside a watched namespace.
    assert {n.resource for n in seen if n.namespace is None} == {"customresourcedefinitions", "namespaces"}

    missing, unused = compare(chart_grants, seen)
    assert (missing, unused) == ([], []), report(missing, unused)


def test_the_comparison_finds_missing_and_unused_rules(chart: helm.Chart) -> None:
    """The check can fail both ways: a call no rule allows, a rule no call uses."""
    objects = render_objects(chart, {"operator": {"watchNamespaces": ["*"]}})
    chart_grants = grants(objects, *operator_identity(objects))
    everything_needed = {Need(g.verb, g.group, g.resource, "inference") for g in chart_grants}
    assert compare(chart_grants, everything_needed) == ([], [])
    extra = Need("delete", "apps", "deployments", "inference")
    missing, unused = compare(chart_grants, everything_needed | {extra})
    assert missing == [str(extra)] and unused == []
    dropped = Need("create", "", "events", "inference")
    missing, unused = compare(chart_grants, everything_needed - {dropped})
    assert (missing, unused) == ([], ["create events cluster-wide (ClusterRole moonlease-operator)"])
    # A RoleBinding grants only in its own namespace.
    namespaced = render_objects(chart, {"operator": {"watchNamespaces": ["inference"]}})
    role_grants = grants(namespaced, *operator_identity(namespaced))
    assert compare(role_grants, {Need("list", "apps", "deployments", "elsewhere")})[0] == \
        ["list deployments.apps in namespace elsewhere"]
