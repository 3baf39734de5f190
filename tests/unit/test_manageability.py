"""Workloads the operator refuses to manage, each with a message that says what to change.
Pure: plain dicts shaped as real charts write them (issue 15, item 3)."""

from __future__ import annotations

from typing import Any

import pytest

from moonlease_operator.api import MasterConfigMapSpec, MasterSpec, Reason
from moonlease_operator.core.manageability import evaluate_master, evaluate_target
from moonlease_operator.core.settings import build_master_settings

pytestmark = pytest.mark.unit

ARGS_MASTER = build_master_settings(MasterSpec(name="m", eviction_ratio=0.1))
FILE_MASTER = build_master_settings(MasterSpec(name="m", eviction_ratio=0.1,
                                               config_map=MasterConfigMapSpec(name="cfg", key="master.yaml")))


def workload(*containers: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "Deployment", "metadata": {"name": "w"},
            "spec": {"template": {"spec": {"containers": list(containers)}}}}


VLLM = {"name": "vllm", "image": "vllm/vllm-openai:v0.9.1", "args": ["meta-llama/Llama-3-8B"]}
SHELL_VLLM = {"name": "vllm", "image": "vllm/vllm-openai:v0.9.1", "command": ["sh", "-c"],
              "args": ["huggingface-cli download m && vllm serve m --kv-transfer-config '{\"kv_connector\":"
                       "\"MooncakeStoreConnector\"}'"]}
SIDECAR = {"name": "istio-proxy", "image": "istio/proxyv2:1.22", "args": ["proxy", "sidecar"]}
REDIS = {"name": "redis", "image": "redis:7", "args": ["--appendonly", "yes"]}
MASTER = {"name": "master", "image": "reg/mooncake:0.3.14", "command": ["mooncake_master"], "args": ["--rpc_port=50051"]}


@pytest.mark.parametrize("container", [
    VLLM,
    {"name": "vllm", "image": "reg/engine:1", "command": ["vllm", "serve", "m"]},
    {"name": "vllm", "image": "reg/engine:1", "command": ["/usr/local/bin/vllm"], "args": ["serve", "m"]},
    {"name": "vllm", "image": "reg/engine:1", "command": ["python3", "-m", "vllm.entrypoints.openai.api_server"]},
])
def test_vllm_is_recognised_from_command_args_or_image(container: dict[str, Any]) -> None:
    assert evaluate_target(workload(container), None) is None


@pytest.mark.parametrize(("containers", "named", "needle"), [
    # sh -c / bash -lc: settings appended after the script are ignored by the shell.
    ([SHELL_VLLM], None, "through a shell script"),
    ([SHELL_VLLM], "vllm", "through a shell script"),  # naming the container does not help
    ([{**VLLM, "command": ["/bin/bash", "-lc", "vllm serve m"], "args": []}], None, "through a shell script"),
    # A script string handed to an image whose entrypoint is a shell.
    ([{**VLLM, "args": ["vllm serve m --port 8000"]}], None, "through a shell script"),
    # A sidecar listed first, no container named: never the sidecar by accident.
    ([SIDECAR, VLLM], None, "has 2 containers (istio-proxy, vllm): set spec.targets[0].container"),
    ([VLLM, SIDECAR], None, "has 2 containers"),
    # A selector that also matches Redis.
    ([REDIS], None, "does not run vLLM"),
])
def test_unmanageable_targets(containers: list[dict[str, Any]], named: str | None, needle: str) -> None:
    problem = evaluate_target(workload(*containers), named, field="spec.targets[0].container")
    assert problem is not None and problem.reason is Reason.UNMANAGEABLE_WORKLOAD
    assert needle in problem.message, problem.message


def test_a_named_container_is_checked_like_any_other() -> None:
    """Naming a container says which one to manage, not that it runs vLLM: a sidecar named by
    mistake (`container: fluent-bit`) is refused, never given vLLM's flags (issue 27)."""
    wrapper = {"name": "engine", "image": "reg/serving:2", "command": ["python3", "/app/serve.py"]}
    fluent = {"name": "fluent-bit", "image": "fluent/fluent-bit:3", "args": ["-c", "/fluent-bit/etc/f.conf"]}
    for named, containers in (("engine", (SIDECAR, wrapper)), ("fluent-bit", (VLLM, fluent))):
        problem = evaluate_target(workload(*containers), named, field="spec.targets[0].container")
        assert problem is not None and f"container {named!r} does not run vLLM" in problem.message
    assert evaluate_target(workload(SIDECAR, VLLM), "vllm") is None


@pytest.mark.parametrize("container", [
    # A token ending in vllm is not vLLM: Redis keeping its data under /data/vllm.
    {"name": "redis", "image": "redis:7", "command": ["redis-server"], "args": ["--dir", "/data/vllm"]},
    {"name": "redis", "image": "redis:7", "args": ["--dir", "/data/vllm"]},
    # Neither is an image whose name contains it.
    {"name": "router", "image": "ghcr.io/vllm-project/vllm-router:0.1", "args": ["--port", "8000"]},
    {"name": "router", "image": "reg/vllm-router:1", "command": ["vllm-router"], "args": ["--backend", "vllm"]},
    # A script that installs vLLM but runs something else.
    {"name": "x", "image": "python:3.12", "command": ["sh", "-c"], "args": ["pip install vllm && python /app/x.py"]},
])
def test_only_a_command_that_starts_vllm_is_vllm(container: dict[str, Any]) -> None:
    problem = evaluate_target(workload(container), None)
    assert problem is not None and "does not run vLLM" in problem.message, problem


def test_a_script_that_starts_vllm_twice_is_refused() -> None:
    twice = {"name": "vllm", "image": "reg/e:1", "command": ["sh", "-c"],
             "args": ["vllm serve a --port 8000 & vllm serve b --port 8001; wait"]}
    problem = evaluate_target(workload(twice), None)
    assert problem is not None and "starts vLLM 2 times" in problem.message


@pytest.mark.parametrize(("containers", "settings", "needle"), [
    ([VLLM], ARGS_MASTER, "does not run mooncake_master"),  # master.name pointing at vLLM
    ([REDIS], ARGS_MASTER, "does not run mooncake_master"),
    ([MASTER, SIDECAR], ARGS_MASTER, "set spec.master.container"),
    ([{**MASTER, "command": ["sh", "-c", "mooncake_master --rpc_port=50051"], "args": []}], ARGS_MASTER,
     "through a shell script"),
])
def test_unmanageable_masters(containers: list[dict[str, Any]], settings: Any, needle: str) -> None:
    problem = evaluate_master(workload(*containers), None, settings)
    assert problem is not None and problem.reason is Reason.UNMANAGEABLE_WORKLOAD
    assert needle in problem.message, problem.message


def test_masters_that_can_be_managed() -> None:
    assert evaluate_master(workload(MASTER), None, ARGS_MASTER) is None
    image_only = {"name": "m", "image": "reg/mooncake-master:v0.3.14", "args": ["--rpc_port=50051"]}
    assert evaluate_master(workload(image_only), None, ARGS_MASTER) is None
    # Through a shell is fine when the settings go to the config file the script's master reads.
    shell = {**MASTER, "command": ["sh", "-c", "mooncake_master --config_path=/etc/m/master.yaml"], "args": []}
    assert evaluate_master(workload(shell), None, FILE_MASTER) is None
