"""The connector-cpu image serves a tiny model with our connector against the mooncake image's
master and store pool, all in containers as the chart runs them (read-only roots; tmpfs where the
chart mounts emptyDirs: HOME, /tmp, /dev/shm; the vLLM user 10001; the model mounted read-only):
a prompt served by one engine is stored, and a second, fresh engine serving the same model loads
the prompt's prefix from the store (its metrics count the external hit) and answers the same.

The engines get the `--kv-transfer-config` and connector environment the chart renders for its
default prefill Deployment, and a store config like the chart's (standalone-store, no segment of
their own), pointing at the master container.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from moonlease_dev.testbed.processes import http_get
from moonlease_dev.testbed.tiny_models import build_tiny_model
from tests.chart.rendering import container, kv_transfer_config, load_chart, one, render_objects
from tests.images.conftest import Images
from tests.images.podman import Container, Network, podman, run_detached, wait_until
from tests.images.store import start_store

pytestmark = pytest.mark.images

PORT = 8000
MODEL = "/models/llama"
PROMPT = [4 + (i * 37) % 1000 for i in range(200)]  # token ids: six whole 32-token blocks and a tail


def _chart_connector_settings() -> tuple[dict[str, Any], dict[str, str]]:
    """The default prefill Deployment's --kv-transfer-config and the connector's env switch."""
    with load_chart() as chart:
        prefill = one(render_objects(chart, {}), "Deployment", "moonlease-prefill")
    env = {e["name"]: e["value"] for e in container(prefill, "vllm")["env"] if e["name"].startswith("VLLM_MOONCAKE")}
    return kv_transfer_config(prefill), env


def _start_engine(network: Network, image: str, name: str, model: Path, store_config: Path) -> Container:
    kv_config, env = _chart_connector_settings()
    address = network.address()
    network._next -= 1  # run_detached hands out this address next
    engine = run_detached(network, image, [
        "serve", MODEL, f"--port={PORT}", "--enforce-eager", "--max-model-len=2048", "--block-size=32",
        f"--kv-cache-memory-bytes={64 << 20}", "--seed=0", "--kv-transfer-config", json.dumps(kv_config)],
        name=name, tmpfs=("/tmp", "/home/vllm"),
        env={**env, "MOONCAKE_CONFIG_PATH": "/etc/mooncake/mooncake.json", "VLLM_HOST_IP": address,
             "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"},
        volumes=[f"{model}:{MODEL}:ro", f"{store_config}:/etc/mooncake/mooncake.json:ro"],
        extra=["--shm-size=1g"])
    assert engine.address == address
    return engine


def _complete(engine: Container) -> dict[str, Any]:
    import urllib.request

    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://{engine.address}:{PORT}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _counter(engine: Container, name: str, **labels: str) -> float:
    status, text = http_get(f"http://{engine.address}:{PORT}/metrics", timeout=5)
    assert status == 200, text
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})?\s+(\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


def test_a_fresh_engine_loads_a_prefix_another_engine_stored(images: Images, network: Network,
                                                             tmp_path: Path) -> None:
    image, store_image = images["connector-cpu"], images["mooncake"]
    assert podman("run", "--rm", "--read-only", "--entrypoint", "id", image, "-u").stdout.strip() == "10001"
    # A world-readable copy: the cached model's weights are private to this machine's root, and
    # the engines run as uid 10001 (in a cluster the model cache volume gets the pod's fsGroup).
    model = Path(shutil.copytree(build_tiny_model("llama"), tmp_path / "llama"))
    for path in (model, *model.iterdir()):
        path.chmod(0o755 if path.is_dir() else 0o644)
    store = start_store(network, store_image)
    store_config = tmp_path / "mooncake.json"
    store_config.write_text(json.dumps({
        "metadata_server": "P2PHANDSHAKE", "master_server_address": store.master_address, "protocol": "tcp",
        "device_name": "", "mode": "standalone-store", "global_segment_size": 0, "local_buffer_size": "64MB"}))
    store_config.chmod(0o644)

    # Both engines start at once (minutes on a loaded CPU); the second serves only after the first
    # has stored the prompt.
    first = _start_engine(network, image, "engine-a", model, store_config)
    second = _start_engine(network, image, "engine-b", model, store_config)
    for engine in (first, second):
        wait_until(lambda e=engine: http_get(f"http://{e.address}:{PORT}/health", timeout=2)[0] == 200,
                   timeout=900, interval=2, what=f"{engine.name} serving", container=engine)

    answer_a = _complete(first)
    keys = wait_until(lambda: store.master_metrics().get("master_key_count", 0), timeout=60,
                      what="the first engine's KV in the store", container=first)
    assert keys > 0
    assert _counter(second, "vllm:external_prefix_cache_hits_total") == 0

    answer_b = _complete(second)
    hits = _counter(second, "vllm:external_prefix_cache_hits_total")
    assert hits >= 32, (hits, second.logs())  # at least one whole block came from the store
    assert _counter(second, "vllm:moonlease_lookups_total", result="hit") >= 1
    assert answer_b["choices"][0]["text"] == answer_a["choices"][0]["text"]


def test_the_fleet_order_service_runs_from_the_connector_image_as_the_chart_starts_it(
        images: Images, network: Network) -> None:
    """The chart's fleet order Deployment runs `python3 -m moonlease_connector.fleet_order` in the
    connector image (read-only root, /tmp a tmpfs as its emptyDir): it answers /healthz, applies
    a batch of operations and counts them in /metrics."""
    import urllib.request

    with load_chart() as chart:
        deployment = one(render_objects(chart, {"fleetOrder": {"enabled": True}}), "Deployment", "moonlease-fleet-order")
    spec = container(deployment, "fleet-order")
    port = spec["ports"][0]["containerPort"]
    # podman's --entrypoint takes the program; the rest of the chart's command comes before its args.
    service = run_detached(network, images["connector-cpu"], [*spec["command"][1:], *spec["args"]],
                           name="fleet-order", entrypoint=spec["command"][0], tmpfs=("/tmp",),
                           extra=["--user", str(deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"])])
    url = f"http://{service.address}:{port}"
    wait_until(lambda: http_get(url + "/healthz", timeout=2)[0] == 200, timeout=60,
               what="the fleet order service", container=service)
    body = json.dumps({"ops": [{"op": "touch", "keys": ["a", "b"], "sizes": [10, 10]},
                               {"op": "take", "free_bytes": 5}]}).encode()
    request = urllib.request.Request(url + "/v1/ops", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert json.loads(response.read())["results"][1]["taken"] == [["b", 10]]
    status, metrics = http_get(url + "/metrics", timeout=5)
    assert status == 200 and "moonlease_fleet_order_keys_taken_total 1.0" in metrics
