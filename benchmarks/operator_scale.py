"""Operator at scale: one MooncakeLeasePolicy over N target workloads (default 200), to Ready.

Runs the local API server (kmock-based, with the rollout simulator playing the Deployment
controller) in this process and the operator as its own process (`python -m moonlease_operator`,
logged in through a kubeconfig, metrics served on a local port), so that the operator's memory is
its own. Measures: wall time from creating the policy to phase Ready, the operator's API requests
(from the server's request log) per reconcile while rolling out and at rest, its writes, the bytes
the server sent it at rest (the server's traffic counter), and its resident memory (sampled every
100 ms).

    .venv/bin/python benchmarks/operator_scale.py                       # 200 targets, print
    .venv/bin/python benchmarks/operator_scale.py --write benchmarks/results/operator_scale.md
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import copy
import json
import os
import platform
import signal
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from moonlease.testbed.connector_pods import ConnectorPods
from moonlease.testbed.kube import DEPLOYMENTS, deployment_manifest, is_rollout_complete, local_api_server

NS = "default"
AGENT = "moonlease-operator/"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _fleet(targets: int, replicas: int) -> list[dict[str, Any]]:
    master = deployment_manifest("mooncake-master", replicas=1, containers=[
        {"name": "master", "image": "registry.local/mooncake/mooncake-master:v0.3.14",
         "args": ["--rpc_port=50051", "--eviction_ratio=0.05"]}])
    workloads = [master]
    for i in range(targets):
        role = "prefill" if i % 2 == 0 else "decode"
        workloads.append(deployment_manifest(f"vllm-{role}-{i:03d}", replicas=replicas, labels={"fleet/role": role},
                                             containers=[{"name": "vllm", "image": "registry.local/vllm:0.9.1",
                                                          "args": ["serve", "/models/llama", "--port=8000"]}]))
    return workloads


POLICY = {
    "apiVersion": "moonlease.io/v1alpha1", "kind": "MooncakeLeasePolicy",
    "metadata": {"name": "fleet", "namespace": NS},
    "spec": {
        # The benchmark measures the rollout, not a human approving the master restart.
        "master": {"name": "mooncake-master", "version": "0.3.14", "evictionRatio": 0.1,
                   "requireApprovalForRestart": False},
        "connector": {"leaseMode": "selective"},
        "targets": [
            {"role": "prefill", "mooncakeVersion": "0.3.14", "selector": {"matchLabels": {"fleet/role": "prefill"}}},
            {"role": "decode", "mooncakeVersion": "0.3.14", "selector": {"matchLabels": {"fleet/role": "decode"}}},
        ],
        "rollout": {"stageTimeoutSeconds": 600},
    },
}


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for line in text.splitlines():
        if line.startswith("moonlease_operator_") and " " in line:
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


async def run(targets: int, replicas: int, interval: float, rest_seconds: float, tick: float) -> dict[str, Any]:
    async with local_api_server(tick_interval=tick) as kube:
        # Every vLLM pod runs the connector's settings watcher and endpoint (real code, loopback):
        # the operator verifies each stage against them.
        connectors = ConnectorPods(kube, Path(tempfile.mkdtemp(prefix="moonlease-bench-pods-")), interval=0.2)
        connectors.start()
        for manifest in _fleet(targets, replicas):
            await kube.create(manifest)
        await kube.wait_for(lambda: all(is_rollout_complete(d) for d in kube.list(DEPLOYMENTS, NS)),
                            timeout=120, interval=0.2, what="the fleet to settle")
        workdir = Path(tempfile.mkdtemp(prefix="moonlease-bench-"))
        kubeconfig = kube.write_kubeconfig(workdir / "kubeconfig")
        metrics_port = _free_port()
        env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        log = open(workdir / "operator.log", "wb")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "moonlease_operator", "--standalone", "--metrics-port", str(metrics_port),
            "--reconcile-interval", str(interval), env=env, stdout=log, stderr=asyncio.subprocess.STDOUT)
        rss: list[tuple[float, int]] = []
        sampling = True

        async def sample() -> None:
            process = psutil.Process(proc.pid)
            while sampling:
                try:
                    rss.append((time.monotonic(), process.memory_info().rss))
                except psutil.Error:
                    return
                await asyncio.sleep(0.1)

        sampler = asyncio.create_task(sample())
        try:
            await kube.wait_for(lambda: any((c.verb, c.resource) == ("watch", "mooncakeleasepolicies")
                                            for c in kube.api_calls()) or proc.returncode is not None,
                                timeout=60, interval=0.05, what="the operator to watch the policies")
            await asyncio.sleep(0.5)
            # Count from here: the operator is up and watching, no policy exists yet.
            started_calls = len(kube.api_calls())
            idle_rss = rss[-1][1] if rss else 0
            t0 = time.monotonic()
            await kube.create(copy.deepcopy(POLICY))

            def phase() -> str | None:
                return ((kube.get("mlp", NS, "fleet") or {}).get("status") or {}).get("phase")

            await kube.wait_for(lambda: phase() in ("Ready", "Degraded", "Invalid") or proc.returncode is not None,
                                timeout=900, interval=0.05, what="phase Ready")
            wall = time.monotonic() - t0
            status = (kube.get("mlp", NS, "fleet") or {}).get("status") or {}
            # The status says Ready first; the events announcing it follow in the same reconcile.
            await kube.wait_for(lambda: kube.events(NS, involved_name="fleet", reason="RolloutComplete")
                                or proc.returncode is not None, timeout=30, what="the RolloutComplete event")
            ready_calls = len(kube.api_calls())
            ready_traffic = kube.traffic.snapshot()
            rollout_rss = max((r for _, r in rss), default=0)
            await asyncio.sleep(rest_seconds)
            rest_calls = kube.api_calls()[ready_calls:]
            # Every HTTP client of the server here is the operator (its client and kopf's).
            rest_traffic = kube.traffic.since(ready_traffic)
            metrics = _scrape(metrics_port)
        finally:
            sampling = False
            await sampler
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
                await asyncio.wait_for(proc.wait(), 30)
            log.close()
            await connectors.stop()

        rollout_calls = [c for c in kube.api_calls()[started_calls:ready_calls] if c.user_agent.startswith(AGENT)]
        kopf_calls = [c for c in kube.api_calls()[started_calls:ready_calls] if c.user_agent.startswith("kopf/")]
        ours_at_rest = [c for c in rest_calls if c.user_agent.startswith(AGENT)]
        # Whole reconciles only: from the first policy LIST of the window to the last one.
        starts = [i for i, c in enumerate(ours_at_rest) if (c.verb, c.resource) == ("list", "mooncakeleasepolicies")]
        ours_at_rest = ours_at_rest[starts[0]:starts[-1]] if len(starts) >= 2 else []

        def reconciles(calls: list[Any]) -> int:
            return sum(1 for c in calls if (c.verb, c.resource) == ("list", "mooncakeleasepolicies"))

        def by_kind(calls: list[Any]) -> dict[str, int]:
            counter = collections.Counter(f"{c.verb} {c.rbac_resource}" for c in calls)
            return dict(sorted(counter.items(), key=lambda kv: (-kv[1], kv[0])))

        durations = metrics.get("moonlease_operator_reconcile_duration_seconds_sum", 0.0)
        count = metrics.get("moonlease_operator_reconcile_duration_seconds_count", 0.0)
        return {
            "targets": targets, "replicas": replicas, "reconcile_interval_s": interval, "simulator_tick_s": tick,
            "phase": status.get("phase"), "wall_s": round(wall, 2),
            "stages": {s["name"]: s["phase"] for s in status.get("stages", [])},
            "rollout": {"requests": len(rollout_calls), "reconciles": reconciles(rollout_calls),
                        "requests_per_reconcile": round(len(rollout_calls) / max(1, reconciles(rollout_calls)), 2),
                        "by_kind": by_kind(rollout_calls), "kopf_requests": len(kopf_calls),
                        "workload_patches": sum(1 for c in rollout_calls
                                                if (c.verb, c.resource) == ("patch", "deployments")),
                        "status_patches": sum(1 for c in rollout_calls
                                              if c.rbac_resource == "mooncakeleasepolicies/status"),
                        "events": sum(1 for c in rollout_calls if c.resource == "events")},
            "rest": {"seconds": rest_seconds, "requests": len(ours_at_rest), "reconciles": reconciles(ours_at_rest),
                     "requests_per_reconcile": round(len(ours_at_rest) / max(1, reconciles(ours_at_rest)), 2),
                     "writes": sum(1 for c in rest_calls if c.verb in ("create", "patch", "update", "delete")),
                     "bytes_served": rest_traffic.total_bytes,
                     "bytes_per_minute": round(rest_traffic.total_bytes * 60 / rest_seconds),
                     "bytes_by_kind": {f"{verb} {resource}": size for (verb, resource), size
                                       in sorted(rest_traffic.bytes_served.items(), key=lambda kv: -kv[1])},
                     "by_kind": by_kind(ours_at_rest)},
            "operator_rss_mib": {"idle_before_policy": round(idle_rss / 2**20, 1),
                                 "peak": round(rollout_rss / 2**20, 1)},
            "reconcile_seconds_mean": round(durations / count, 4) if count else None,
            "reconciles_total_by_metrics": count,
            "api_retries": {k.split("reason=")[1].strip('"}'): v for k, v in metrics.items()
                            if k.startswith("moonlease_operator_api_retries_total")},
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        }


def render_markdown(result: dict[str, Any], command: str) -> str:
    rollout, rest, rss = result["rollout"], result["rest"], result["operator_rss_mib"]
    lines = [
        "# Operator at scale: one policy over 200 target workloads",
        "",
        f"Reproduce: `{command}` (about 20 s per run on 2 cores).",
        "",
        "Setup: the local API server (kmock with this repository's emulation, in the benchmark process) with a",
        f"Mooncake master Deployment and {result['targets']} vLLM Deployments of {result['replicas']} replica(s),",
        "half labelled prefill and half decode; one `MooncakeLeasePolicy` selecting them by label (selective",
        "leasing, one master setting), stages master -> prefill -> decode. The operator runs as its own process",
        f"(`python -m moonlease_operator`, reconcile interval {result['reconcile_interval_s']} s); the simulated",
        f"controller moves one replica per workload every {result['simulator_tick_s']} s. Requests are counted from",
        "the server's request log (`LocalApiServer.api_calls()`), by User-Agent.",
        "",
        f"Machine: {result['machine']}.",
        "",
        "| measure | value |",
        "| --- | --- |",
        f"| result | phase {result['phase']}; stages {', '.join(f'{k} {v}' for k, v in result['stages'].items())} |",
        f"| wall time, policy created -> phase Ready | {result['wall_s']} s (all runs: "
        f"{', '.join(f'{w} s' for w in result['wall_s_all_runs'])}; load average "
        f"{result['load_average_1m_at_end']} on {os.cpu_count()} CPUs) |",
        f"| reconciles during the rollout | {rollout['reconciles']} |",
        f"| operator API requests during the rollout | {rollout['requests']} |",
        f"| **API requests per reconcile, rolling out** | **{rollout['requests_per_reconcile']}** |",
        f"| of which workload patches / status patches / events | {rollout['workload_patches']} / "
        f"{rollout['status_patches']} / {rollout['events']} |",
        f"| kopf's own requests during the rollout (watch, finalizer) | {rollout['kopf_requests']} |",
        f"| **API requests per reconcile, at rest** ({rest['seconds']} s after Ready) | "
        f"**{rest['requests_per_reconcile']}** ({rest['requests']} requests, {rest['reconciles']} reconciles) |",
        f"| writes at rest (anyone over HTTP) | {rest['writes']} |",
        f"| bytes the API server sent the operator at rest (response bodies and watch events) | "
        f"{rest['bytes_served']} in {rest['seconds']} s ({rest['bytes_per_minute']} per minute) |",
        f"| mean reconcile duration (operator metric) | {result['reconcile_seconds_mean']} s |",
        f"| operator RSS, idle before the policy / peak during the rollout | {rss['idle_before_policy']} MiB / "
        f"{rss['peak']} MiB (peak in all runs: {', '.join(map(str, result['peak_rss_mib_all_runs']))}) |",
        f"| API retries (operator metric) | {result['api_retries'] or 'none'} |",
        "",
        "Requests during the rollout, by verb and resource:",
        "",
        "```",
        *(f"{v:6d}  {k}" for k, v in rollout["by_kind"].items()),
        "```",
        "",
        "At rest, every reconcile is exactly: " + ", ".join(rest["by_kind"]) + ".",
        "",
        "Reading: a reconcile costs a fixed number of LISTs whatever the fleet size (policies, Deployments,",
        "StatefulSets, plus pods only while a stage is verifying), and each workload is patched exactly once;",
        "the other requests are status writes (only from reconciles that changed something) and one event per",
        "transition. At rest nothing is written. The request counts carry over to a real cluster; the times do",
        "not: here one single-threaded Python process serves the API, runs the simulated controllers and",
        "answers the 100 PATCHes of each stage start (8 in flight at a time), which is where most of the",
        "reconcile time goes, and the machine is shared (the wall time moves with its load).",
        "",
        "Raw result:",
        "",
        "```json",
        json.dumps(result, indent=2),
        "```",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", type=int, default=200)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--interval", type=float, default=1.0, help="operator reconcile interval (s)")
    parser.add_argument("--tick", type=float, default=0.05, help="simulated controller tick (s)")
    parser.add_argument("--rest", type=float, default=5.0, help="seconds to watch the policy at rest")
    parser.add_argument("--runs", type=int, default=1, help="repeat; the report shows every run's wall time")
    parser.add_argument("--write", type=Path, default=None, help="write the markdown report here")
    args = parser.parse_args(argv)
    results = [asyncio.run(run(args.targets, args.replicas, args.interval, args.rest, args.tick))
               for _ in range(args.runs)]
    result = results[-1]
    result["wall_s_all_runs"] = [r["wall_s"] for r in results]
    result["peak_rss_mib_all_runs"] = [r["operator_rss_mib"]["peak"] for r in results]
    result["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result, indent=2))
    if args.write is not None:
        command = f".venv/bin/python benchmarks/operator_scale.py --runs {args.runs} --write {args.write}"
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(render_markdown(result, command), encoding="utf-8")
    return 0 if result["phase"] == "Ready" else 1


if __name__ == "__main__":
    sys.exit(main())
