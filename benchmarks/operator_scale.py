"""Operator at fleet scale: many realistic Deployments and many policies, the watch-driven
operator as it ships (the operator's caches serve every reconcile; no LIST per reconcile).

Runs the local API server (kmock-based, with the rollout simulator playing the Deployment
controller) in this process and the operator as its own process (`moonlease
operator`, logged in through a kubeconfig, cluster-wide), so that the operator's
memory is its own. Against that server:

* **at rest**: `--policies` policies, each over its own master and its share of the
  Deployments, every one waiting for approval of its master restart (nothing to do until a
  person acts). Measured over `--rest` seconds: the operator's requests and the bytes the server sent it, per minute.
* **rollout**: one more policy over `--rollout-targets` Deployments of their own (no approval
  needed): requests until Ready, seconds from creating the policy to the operator's first
  workload PATCH, and the status size.

and throughout: the operator's peak RSS (sampled every 100 ms). Deployments are realistic in
size (`managedFields` of two managers, 36 env vars: about 7 KiB of JSON each).

The committed report also holds rows of the design the operator had before its watches (every
reconcile listed the namespace), recorded by an earlier version of this benchmark; `--render`
keeps them, labelled as recorded, and no run measures that design any more.

    .venv/bin/python benchmarks/operator_scale.py --deployments 1000 --namespaces 1   # print
    .venv/bin/python benchmarks/operator_scale.py --write benchmarks/results/operator_scale.md
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import copy
import json
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from moonlease_dev.testbed.connector_pods import ConnectorPods
from moonlease_dev.testbed.kube import deployment_manifest, local_api_server
from moonlease_dev.testbed.processes import free_port

AGENT = "moonlease-operator/"
DESIGN = "watch"  # the operator as it ships; "polling" rows of earlier results are recorded only
ENV = [{"name": f"VLLM_SETTING_{i:02d}", "value": f"value-{i:02d}-" + "x" * 24} for i in range(36)]


def _managed_fields(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """What a real API server keeps beside a kubectl-applied Deployment: one entry per manager,
    each a tree of the fields it set (the bulk of a real object's size)."""
    def tree(node: Any) -> Any:
        if isinstance(node, dict):
            return {f"f:{k}": tree(v) for k, v in node.items()}
        if isinstance(node, list):
            return {f'k:{{"name":"{item.get("name", i)}"}}': tree(item) if isinstance(item, dict) else {}
                    for i, item in enumerate(node) if isinstance(item, dict)} or {}
        return {}

    stamp = "2026-01-01T00:00:00Z"
    return [
        {"manager": "kubectl-client-side-apply", "operation": "Update", "apiVersion": "apps/v1", "time": stamp,
         "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": tree(obj["metadata"]), "f:spec": tree(obj["spec"])}},
        {"manager": "kube-controller-manager", "operation": "Update", "apiVersion": "apps/v1", "time": stamp,
         "fieldsType": "FieldsV1", "subresource": "status",
         "fieldsV1": {"f:status": {f"f:{k}": {} for k in ("availableReplicas", "conditions", "observedGeneration",
                                                          "readyReplicas", "replicas", "updatedReplicas")},
                      "f:metadata": {"f:annotations": {"f:deployment.kubernetes.io/revision": {}}}}},
    ]


def realistic_deployment(name: str, namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    obj = deployment_manifest(name, namespace=namespace, replicas=1, labels=labels, containers=[
        {"name": "vllm", "image": "registry.local/vllm:0.9.1", "args": ["serve", "/models/llama", "--port=8000"],
         "env": copy.deepcopy(ENV), "resources": {"limits": {"cpu": "8", "memory": "64Gi"}},
         "ports": [{"name": "http", "containerPort": 8000}]}])
    obj["metadata"]["annotations"] = {"team.example.com/owner": "inference", "deployment.kubernetes.io/revision": "1"}
    obj["metadata"]["managedFields"] = _managed_fields(obj)
    return obj


def master_deployment(name: str, namespace: str) -> dict[str, Any]:
    return deployment_manifest(name, namespace=namespace, replicas=1, containers=[
        {"name": "master", "image": "registry.local/mooncake/mooncake-master:v0.3.14",
         "args": ["--rpc_port=50051", "--eviction_ratio=0.05"]}])


def policy(name: str, namespace: str, group: str, *, approval: bool) -> dict[str, Any]:
    return {
        "apiVersion": "moonlease.io/v1alpha1", "kind": "MooncakeLeasePolicy",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "master": {"name": f"master-{group}", "version": "0.3.14", "evictionRatio": 0.1,
                       "requireApprovalForRestart": approval},
            "connector": {"leaseMode": "selective"},
            "targets": [{"role": role, "mooncakeVersion": "0.3.14", "container": "vllm",
                         "selector": {"matchLabels": {"fleet/group": group, "fleet/role": role}}}
                        for role in ("prefill", "decode")],
            "rollout": {"stageTimeoutSeconds": 600},
        },
    }


def _phase(kube: Any, namespace: str, name: str) -> str | None:
    # Read as stored, not copied: the driver polls 51 policies and must not load the test bed.
    return ((kube.emulator.stored_object("mlp", namespace, name) or {}).get("status") or {}).get("phase")


class LoopLag:
    """The worst lateness of this process's event loop since `reset()`: how long a request to
    the in-process API server could have waited for the test bed (simulator, connectors,
    this driver) to let it in."""

    def __init__(self, period: float = 0.05) -> None:
        self.period = period
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._probe())

    async def _probe(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(self.period)
            self.worst = max(self.worst, loop.time() - before - self.period)

    def reset(self) -> float:
        worst, self.worst = self.worst, 0.0
        return round(worst, 2)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def _testbed_idle(kube: Any, connectors: Any) -> bool:
    """No simulated controller or connector work pending (every Deployment observed, its pods
    Ready, every settings file delivered)."""
    return bool(kube.simulator.idle and connectors.idle)


async def _populate(kube: Any, deployments: int, policies: int, namespaces: int, rollout_targets: int,
                    ) -> tuple[list[tuple[str, str]], str, int]:
    """Namespaces, masters, Deployments; returns the resting policies (namespace, name) to
    create, the rollout policy's namespace, and the mean Deployment size in bytes."""
    names = [f"fleet-{i:02d}" for i in range(namespaces)]
    for ns in names:
        await kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    groups = [f"g{i:02d}" for i in range(policies)] + ["rollout"]
    masters = len(groups)
    bulk = deployments - masters - rollout_targets
    if bulk < policies:
        raise SystemExit(f"--deployments {deployments} is too few for {policies} policies")
    sizes = []
    for index, group in enumerate(groups):
        ns = names[index % namespaces]
        await kube.create(master_deployment(f"master-{group}", ns))
        count = rollout_targets if group == "rollout" else bulk // policies + (1 if index < bulk % policies else 0)
        for i in range(count):
            role = "prefill" if i % 2 == 0 else "decode"
            obj = realistic_deployment(f"vllm-{group}-{role}-{i:04d}", ns, {"fleet/group": group, "fleet/role": role})
            if len(sizes) < 50:
                sizes.append(len(json.dumps(obj)))
            await kube.create(obj)
    resting = [(names[i % namespaces], f"policy-{group}") for i, group in enumerate(groups[:-1])]
    return resting, names[(masters - 1) % namespaces], round(sum(sizes) / len(sizes))


async def _operator(kube: Any, interval: float, workdir: Path, profile: Path | None = None) -> tuple[Any, Any]:
    kubeconfig = kube.write_kubeconfig(workdir / "kubeconfig")
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    log = open(workdir / "operator.log", "wb")
    # --profile: cProfile the whole operator process (written when it stops on SIGTERM).
    profiler = ["-m", "cProfile", "-o", str(profile / "operator.prof")] if profile is not None else []
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *profiler, "-m", "moonlease", "operator", "--standalone", "--reconcile-interval", str(interval),
        f"--metrics-port={free_port()}", f"--liveness=http://127.0.0.1:{free_port()}/healthz", env=env, stdout=log, stderr=asyncio.subprocess.STDOUT)
    return proc, log


async def measure_operator(kube: Any, *, resting: list[tuple[str, str]], rollout_ns: str,
                         interval: float, rest_seconds: float, settle_timeout: float, rollout_timeout: float,
                         workdir: Path, connectors: Any, lag: LoopLag,
                         profile: Path | None = None) -> dict[str, Any]:
    proc, log = await _operator(kube, interval, workdir, profile)
    rss: list[int] = []
    sampling = True

    async def sample() -> None:
        process = psutil.Process(proc.pid)
        while sampling:
            try:
                rss.append(process.memory_info().rss)
            except psutil.Error:
                return
            await asyncio.sleep(0.1)

    sampler = asyncio.create_task(sample())

    def cpu_seconds() -> float:
        """The operator process's CPU time so far (user + system): what it cost, whatever else
        loads this shared machine (wall-clock times here are the machine's)."""
        try:
            times = psutil.Process(proc.pid).cpu_times()
        except psutil.Error:
            return float("nan")
        return float(times.user + times.system)
    result: dict[str, Any] = {"design": DESIGN}
    try:
        # Every resting policy reaches its resting phase (created before this operator started).
        t0, bed0 = time.monotonic(), time.process_time()
        lag.reset()
        settled = await _wait(lambda: all(_phase(kube, ns, n) == "AwaitingApproval" for ns, n in resting)
                              or proc.returncode is not None, settle_timeout)
        result["settle_s"] = round(time.monotonic() - t0, 1) if settled else None
        result["settle_cpu_s"] = round(cpu_seconds(), 1)  # start-up listing and every first reconcile
        result["settle_testbed"] = {"cpu_s": round(time.process_time() - bed0, 1), "worst_loop_lag_s": lag.reset()}
        await asyncio.sleep(2.0)  # the last status writes' own watch events
        mark, traffic = len(kube.api_calls()), kube.traffic.snapshot()
        rss_before_rest = len(rss)
        cpu_before_rest, bed0 = cpu_seconds(), time.process_time()
        lag.reset()
        await asyncio.sleep(rest_seconds)
        calls = [c for c in kube.api_calls(mark) if c.user_agent.startswith(AGENT)]
        served = kube.traffic.since(traffic)
        per_minute = 60.0 / rest_seconds
        result["rest"] = {
            "seconds": rest_seconds, "settled": settled,
            "requests_per_minute": round(len(calls) * per_minute, 1),
            "lists_per_minute": round(sum(1 for c in calls if c.verb == "list") * per_minute, 1),
            "bytes_per_minute": round(served.total_bytes * per_minute),
            "by_kind": _by_kind(calls),
            "rss_mib_peak": round(max(rss[rss_before_rest:], default=0) / 2**20, 1),
            "cpu_s": round(cpu_seconds() - cpu_before_rest, 2),
            "testbed": {"cpu_s": round(time.process_time() - bed0, 2), "worst_loop_lag_s": lag.reset()},
        }

        # The test bed has nothing pending before the edit: what follows is the rollout's.
        t0 = time.monotonic()
        idle = await _wait(lambda: _testbed_idle(kube, connectors), settle_timeout)
        result["testbed_idle_wait_s"] = round(time.monotonic() - t0, 1) if idle else None

        # One rollout: a new policy over its own Deployments.
        mark = len(kube.api_calls())
        name = f"rollout-{DESIGN}"
        body = policy(name, rollout_ns, "rollout", approval=False)
        lag.reset()
        t0, cpu_before_rollout, bed0 = time.monotonic(), cpu_seconds(), time.process_time()
        await kube.create(body)
        first_patch = first_patch_cpu = first_patch_lag = None
        seen = mark
        deadline = time.monotonic() + rollout_timeout
        while time.monotonic() < deadline and proc.returncode is None:
            calls = kube.api_calls(seen) if first_patch is None else []
            seen += len(calls)
            if first_patch is None and any(c.user_agent.startswith(AGENT) and (c.verb, c.resource) ==
                                           ("patch", "deployments") for c in calls):
                first_patch, first_patch_cpu = time.monotonic() - t0, cpu_seconds() - cpu_before_rollout
                first_patch_lag = lag.reset()
            if _phase(kube, rollout_ns, name) in ("Ready", "Degraded", "Invalid"):
                break
            await asyncio.sleep(0.05)
        wall = time.monotonic() - t0
        status = (kube.get("mlp", rollout_ns, name) or {}).get("status") or {}
        calls = [c for c in kube.api_calls(mark) if c.user_agent.startswith(AGENT)]
        result["rollout"] = {
            "phase": status.get("phase"), "seconds": round(wall, 1), "finished": status.get("phase") == "Ready",
            "first_patch_s": round(first_patch, 2) if first_patch is not None else None,
            "first_patch_cpu_s": round(first_patch_cpu, 2) if first_patch_cpu is not None else None,
            "requests": len(calls), "by_kind": _by_kind(calls),
            "workload_patches": sum(1 for c in calls if (c.verb, c.resource) == ("patch", "deployments")),
            "status_patches": sum(1 for c in calls if c.rbac_resource == "mooncakeleasepolicies/status"),
            "events": sum(1 for c in calls if c.resource == "events"),
            "status_bytes": len(json.dumps(status)),
            "cpu_s": round(cpu_seconds() - cpu_before_rollout, 1),
            "testbed": {"cpu_s": round(time.process_time() - bed0, 1),
                        "worst_loop_lag_before_first_patch_s": first_patch_lag,
                        "worst_loop_lag_s": max(lag.reset(), first_patch_lag or 0.0)},
        }
        # Deleting the policy gives the rollout's workloads back (measured as part of the run).
        await kube.delete("mlp", rollout_ns, name)
        await _wait(lambda: kube.get("mlp", rollout_ns, name) is None or proc.returncode is not None, rollout_timeout)
    finally:
        sampling = False
        await sampler
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 60)
            except TimeoutError:
                proc.kill()
        log.close()
    result["rss_mib_peak"] = round(max(rss, default=0) / 2**20, 1)
    result["exit_code"] = proc.returncode
    return result


async def _wait(check: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        await asyncio.sleep(0.2)
    return bool(check())


def _by_kind(calls: list[Any]) -> dict[str, int]:
    counter = collections.Counter(f"{c.verb} {c.rbac_resource}" for c in calls)
    return dict(sorted(counter.items(), key=lambda kv: (-kv[1], kv[0])))


async def run(*, deployments: int, policies: int, namespaces: int, rollout_targets: int, interval: float,
              rest_seconds: float, tick: float, settle_timeout: float, rollout_timeout: float,
              profile: Path | None = None) -> dict[str, Any]:
    """One fleet, then the operator against it (see the module docstring)."""
    workdir = Path(tempfile.mkdtemp(prefix="moonlease-bench-"))
    async with local_api_server(tick_interval=tick) as kube:
        # A pass every 50 ms (one over nothing written costs nothing): a new pod's connector
        # announces its endpoint before the operator, told of the pod over HTTP, comes to read it.
        connectors = ConnectorPods(kube, Path(tempfile.mkdtemp(prefix="moonlease-bench-pods-")), interval=0.05)
        connectors.start()
        lag = LoopLag()
        lag.start()
        try:
            t0 = time.monotonic()
            resting, rollout_ns, size = await _populate(kube, deployments, policies, namespaces, rollout_targets)
            for ns, name in resting:
                group = name.removeprefix("policy-")
                await kube.create(policy(name, ns, group, approval=True))
            setup = time.monotonic() - t0
            # The simulated controller creates every pod before any operator starts: what the
            # operator meets is a settled fleet, and this settle is the test bed's, not its.
            t0, bed0 = time.monotonic(), time.process_time()
            idle = await _wait(lambda: _testbed_idle(kube, connectors), settle_timeout)
            testbed_settle = {"seconds": round(time.monotonic() - t0, 1) if idle else None,
                              "cpu_s": round(time.process_time() - bed0, 1)}
            measured = await measure_operator(kube, resting=resting, rollout_ns=rollout_ns, interval=interval,
                                              rest_seconds=rest_seconds, settle_timeout=settle_timeout,
                                              rollout_timeout=rollout_timeout, workdir=workdir, connectors=connectors,
                                              lag=lag, profile=profile)
        finally:
            await lag.stop()
            await connectors.stop()
    return {"deployments": deployments, "policies": policies + 1, "resting_policies": policies,
            "namespaces": namespaces, "rollout_targets": rollout_targets, "deployment_bytes_mean": size,
            "reconcile_interval_s": interval, "simulator_tick_s": tick, "setup_s": round(setup, 1),
            "testbed_settle": testbed_settle,
            "designs": {DESIGN: measured}, "workdir": str(workdir),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
            "load_average_1m_at_end": round(os.getloadavg()[0], 2)}


def render_markdown(results: list[dict[str, Any]], command: str, notes: list[str] | None = None) -> str:
    notes = notes or []
    lines = [
        "# Operator at fleet scale: the watch-driven operator",
        "",
        f"Reproduce: `{command}`.",
        "",
        "Setup (`benchmarks/operator_scale.py`): the local API server (kmock with this repository's emulation,",
        "in the benchmark process; the rollout simulator plays the Deployment controller) holding realistic",
        f"Deployments (about {results[0]['deployment_bytes_mean']} bytes of JSON each: `managedFields` of two "
        "managers, 36 env vars), one replica each;",
        "policies that each select a master and their share of the Deployments by label, every one waiting",
        "for approval of its master restart (at rest: nothing to do until a person acts); then one more policy",
        "rolling out over Deployments of its own. The operator runs as its own process (`moonlease",
        "operator`, cluster-wide, reconcile interval "
        f"{results[0]['reconcile_interval_s']} s; a reconcile reads the operator's watch caches). Rows of design",
        "*polling (recorded)* are recorded results, not measured by this version of the benchmark: an earlier",
        "version ran the design the operator had before its watches (every reconcile LISTed the namespace's",
        "policies, Deployments and StatefulSets) against the same server in the same run as the watch row",
        "above it; that design is no longer in the operator. Requests are counted from the server's request",
        "log by User-Agent (the operator's own client; kopf's watches are open throughout), bytes from its",
        "traffic counter (every byte served: only the operator talks to it meanwhile).",
        "",
        f"Machine: {results[0]['machine']}, shared with other work (load average at the end of the last run: "
        f"{results[-1]['load_average_1m_at_end']}).",
        "",
        "| fleet | design | at rest: requests / min | LISTs / min | bytes read / min | peak RSS | "
        "rollout: requests | first PATCH after create (operator CPU meanwhile) | to Ready | status size | "
        "operator CPU: settle / rest / rollout |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for result in results:
        fleet = (f"{result['deployments']} Deployments, {result['policies']} policies, "
                 f"{result['namespaces']} namespace{'s' if result['namespaces'] > 1 else ''}")
        for name, run in result["designs"].items():
            design = _label(name)
            rest, rollout = run["rest"], run["rollout"]
            first = f"{rollout['first_patch_s']} s" if rollout["first_patch_s"] is not None else "none"
            if rollout.get("first_patch_cpu_s") is not None:
                first += f" ({rollout['first_patch_cpu_s']} s)"
            cpu = " / ".join("n/a" if v is None else f"{v} s" for v in
                             (run.get("settle_cpu_s"), rest.get("cpu_s"), rollout.get("cpu_s")))
            ready = f"{rollout['seconds']} s" if rollout["finished"] else f"not Ready in {rollout['seconds']} s"
            unsettled = "" if rest["settled"] else " (not all settled)"
            lines.append(
                f"| {fleet} | {design} | {rest['requests_per_minute']}{unsettled} | {rest['lists_per_minute']} | "
                f"{rest['bytes_per_minute'] / 2**20:.2f} MiB | {run['rss_mib_peak']} MiB | {rollout['requests']} "
                f"({rollout['workload_patches']} workload PATCHes, {rollout['status_patches']} status, "
                f"{rollout['events']} events) | {first} | {ready} | {rollout['status_bytes']} B | {cpu} |")
    bed_rows = [r for r in results if r.get("testbed_settle")]
    if bed_rows:
        lines += [
            "",
            "The test bed in the same runs (the benchmark process: API server, simulated Deployment controller,",
            "simulated connectors, this driver): how long it took to settle the fleet before any operator started,",
            "its CPU seconds per phase, and the worst lateness of its event loop (how long a request could wait",
            "to be answered) during the operator's settle / at rest / until the first PATCH / the whole rollout.",
            "",
            "| fleet | design | test bed settle (CPU) | CPU: settle / rest / rollout | worst loop lag: settle / rest / "
            "to first PATCH / rollout |",
            "| --- | --- | --- | --- | --- |",
        ]
        for result in bed_rows:
            fleet = (f"{result['deployments']} Deployments, {result['policies']} policies, "
                     f"{result['namespaces']} namespace{'s' if result['namespaces'] > 1 else ''}")
            bed = result["testbed_settle"]
            for name, run in result["designs"].items():
                design = _label(name)
                settle, rest, rollout = (run.get("settle_testbed") or {}, run["rest"].get("testbed") or {},
                                         run["rollout"].get("testbed") or {})
                lines.append(
                    f"| {fleet} | {design} | {bed['seconds']} s ({bed['cpu_s']} s) | {settle.get('cpu_s')} / "
                    f"{rest.get('cpu_s')} / {rollout.get('cpu_s')} s | {settle.get('worst_loop_lag_s')} / "
                    f"{rest.get('worst_loop_lag_s')} / {rollout.get('worst_loop_lag_before_first_patch_s')} / "
                    f"{rollout.get('worst_loop_lag_s')} s |")
    lines += [
        "",
        "Goals: at rest 0 requests beyond the open watches; first workload PATCH < 2 s after the",
        "edit; peak RSS < 256 MiB (the chart's limit); a bounded status.",
        "",
        "How to read it: in the watch design a reconcile reads the operator's caches, so at rest its requests",
        "are only what is left over from settling (Events posted after the status said the phase) and the",
        "renewal of each watch after its `timeoutSeconds` (300 s); the recorded polling design read every",
        "Deployment of a namespace once per policy per interval, so its bytes grew with Deployments x policies /",
        "namespaces. Peak RSS includes the start-up listing (paginated, trimmed of `managedFields` as it",
        "arrives). The times are this shared machine's, with the API server, the simulated controllers and",
        "the operator on the same 2 cores; the request and byte counts carry over to a real cluster. Operator CPU:",
        "the operator process's user + system CPU seconds in each phase (and up to the first PATCH), which",
        "say what the operator itself cost whatever else loads the machine (n/a: not recorded in that run).",
        "",
        *notes,
        "",
        "Raw results:",
        "",
        "```json",
        json.dumps(results, indent=2),
        "```",
        "",
    ]
    return "\n".join(lines)


def _label(design: str) -> str:
    """How a row's design reads in the report: the watch design is measured, any other recorded."""
    return design if design == DESIGN else f"{design} (recorded)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deployments", type=int, action="append", default=None,
                        help="Deployments in all (masters included; repeatable: one fleet each; default 1000)")
    parser.add_argument("--namespaces", type=int, action="append", default=None,
                        help="spread over this many namespaces (repeatable; default 1)")
    parser.add_argument("--policies", type=int, default=50, help="resting policies (default 50)")
    parser.add_argument("--rollout-targets", type=int, default=100, help="Deployments of the rollout policy")
    parser.add_argument("--interval", type=float, default=5.0, help="operator reconcile interval (s; default 5)")
    parser.add_argument("--tick", type=float, default=0.5, help="simulated controller tick (s)")
    parser.add_argument("--rest", type=float, default=60.0, help="seconds measured at rest (default 60)")
    parser.add_argument("--settle-timeout", type=float, default=600.0)
    parser.add_argument("--rollout-timeout", type=float, default=300.0)
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help="cProfile the operator process: DIR/operator.prof (slows it down)")
    parser.add_argument("--write", type=Path, default=None, help="write the markdown report here")
    parser.add_argument("--json", type=Path, default=None, help="also save the raw results here")
    parser.add_argument("--render", type=Path, nargs="+", default=None, metavar="JSON",
                        help="no run: write the report (--write) from earlier --json files, in order")
    parser.add_argument("--command", default=None, help="with --render: the commands that made them")
    parser.add_argument("--notes", type=Path, default=None, help="with --render: markdown about this run, added as is")
    args = parser.parse_args(argv)
    if args.render:
        rendered = [r for path in args.render for r in json.loads(path.read_text())]
        if args.write is not None:
            notes = args.notes.read_text(encoding="utf-8").splitlines() if args.notes else []
            args.write.write_text(render_markdown(rendered, args.command or "see the raw results", notes),
                                  encoding="utf-8")
        return 0
    results = []
    for deployments in args.deployments or [1000]:
        for namespaces in args.namespaces or [1]:
            results.append(asyncio.run(run(
                deployments=deployments, policies=args.policies, namespaces=namespaces,
                rollout_targets=args.rollout_targets, interval=args.interval, rest_seconds=args.rest,
                tick=args.tick, settle_timeout=args.settle_timeout, rollout_timeout=args.rollout_timeout,
                profile=args.profile)))
            print(json.dumps(results[-1], indent=2), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2), encoding="utf-8")
    if args.write is not None:
        command = " ".join([".venv/bin/python benchmarks/operator_scale.py", *(argv or sys.argv[1:])])
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(render_markdown(results, command), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
