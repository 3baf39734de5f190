"""What a container runs, read as the kubelet runs it (issue 27): `sh -c` scripts split with
shlex, the one vLLM invocation located, the connector counted as loaded only when that command
loads it, and the expected settings hash computed from what the command really passes."""

from __future__ import annotations

import json
from typing import Any

import pytest

from moonlease_settings.config import MoonleaseConnectorConfig
from moonlease_settings.settings_file import SETTINGS_FILE_PATH, parse_settings_file, settings_hash
from moonlease_operator.api import ConnectorSpec, LeaseMode, Reason
from moonlease_operator.core.command_line import script_commands, starts_vllm, vllm_invocations
from moonlease_operator.core.connector_delivery import (
    SCRIPT_KV_TRANSFER_CONFIG,
    expected_settings_hash,
    script_loads_settings,
    startup_defaults,
)
from moonlease_operator.core.manageability import evaluate_target
from moonlease_operator.core.settings import build_connector_settings

pytestmark = pytest.mark.unit

OURS = {"kv_connector": "MooncakeStoreConnector", "kv_connector_module_path": "moonlease_connector",
        "kv_role": "kv_both"}


def script_workload(script: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    container: dict[str, Any] = {"name": "vllm", "image": "reg/engine:1", "command": ["/bin/sh", "-c"], "args": [script]}
    if env:
        container["env"] = [{"name": k, "value": v} for k, v in env.items()]
    return {"kind": "Deployment", "metadata": {"name": "w"}, "spec": {"template": {"spec": {"containers": [container]}}}}


def kv(extra: dict[str, Any] | None = None, **fields: Any) -> str:
    doc = {**OURS, **fields, "kv_connector_extra_config": {"mooncake_settings_file": SETTINGS_FILE_PATH, **(extra or {})}}
    return "--kv-transfer-config '" + json.dumps(doc) + "'"


def the_container(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize(("argv", "vllm"), [
    (["vllm", "serve", "m"], True),
    (["/usr/local/bin/vllm", "serve"], True),
    (["python3", "-m", "vllm.entrypoints.openai.api_server"], True),
    (["python3.12", "-u", "-m", "vllm.entrypoints.cli.main", "serve"], True),
    (["vllm", "--version"], False),
    (["python3", "/app/vllm_wrapper.py"], False),
    (["redis-server", "--dir", "/data/vllm"], False),
    (["vllm-router", "--port", "8000"], False),
])
def test_a_command_is_vllm_only_when_it_starts_vllm(argv: list[str], vllm: bool) -> None:
    assert starts_vllm(argv) is vllm


def test_scripts_are_split_as_a_shell_splits_them() -> None:
    commands = script_commands("set -e\nexport HF_HOME=/cache\npip install 'moonlease_connector>=1' && "
                               "MOONLEASE_X=1 exec vllm serve m --port 8000 \\\n --max-model-len 4096 | tee log")
    assert commands is not None
    assert [c.argv[0] for c in commands] == ["set", "pip", "vllm", "tee"]
    serve = commands[2]
    assert serve.argv == ("vllm", "serve", "m", "--port", "8000", "--max-model-len", "4096")
    assert serve.env == {"HF_HOME": "/cache", "MOONLEASE_X": "1"}
    assert script_commands("echo 'unclosed") is None
    problem = evaluate_target(script_workload("vllm serve 'm"), None)
    assert problem is not None and "cannot read" in problem.message


def test_a_script_that_merely_mentions_the_connector_does_not_load_it() -> None:
    mention = script_workload(f"pip install moonlease_connector && echo {SETTINGS_FILE_PATH} && vllm serve m")
    assert script_loads_settings(the_container(mention)) is False
    problem = evaluate_target(mention, None)
    assert problem is not None and problem.reason is Reason.UNMANAGEABLE_WORKLOAD
    assert SCRIPT_KV_TRANSFER_CONFIG in problem.message
    # The connector named only in a comment, or loaded by another command than vLLM's: no.
    assert script_loads_settings(the_container(script_workload(f"true {kv()} # \nvllm serve m"))) is False
    assert script_loads_settings(the_container(script_workload(f"vllm serve m {kv()}"))) is True


def test_a_foreign_connector_in_a_script_is_refused_even_when_ours_is_mentioned() -> None:
    lmcache = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    script = (f"pip install moonlease_connector && echo {SETTINGS_FILE_PATH} && "
              f"vllm serve m --kv-transfer-config '{json.dumps(lmcache)}'")
    problem = evaluate_target(script_workload(script), None)
    assert problem is not None and problem.reason is Reason.FOREIGN_CONNECTOR


def test_the_expected_hash_counts_the_keys_the_script_passes() -> None:
    """A script passing one extra Moonlease key: the connector starts on it, so the hash the
    operator expects includes it (else a working rollout would fail verification)."""
    obj = script_workload(f"vllm serve m {kv({'mooncake_max_lease_rounds': 7})}")
    assert evaluate_target(obj, None) is None
    defaults = startup_defaults(obj, None)
    assert defaults is not None and defaults.mooncake_max_lease_rounds == 7
    file = build_connector_settings(ConnectorSpec(lease_mode=LeaseMode.SELECTIVE)).file
    running = parse_settings_file(json.dumps(dict(file)),
                                  MoonleaseConnectorConfig(mooncake_max_lease_rounds=7))
    assert expected_settings_hash(obj, None, file) == settings_hash(running)
    # The settings file named by an assignment in the script counts like the container's env.
    by_assignment = script_workload(f"MOONLEASE_SETTINGS_FILE={SETTINGS_FILE_PATH} vllm serve m "
                                    f"--kv-transfer-config '{json.dumps(OURS)}'")
    assert script_loads_settings(the_container(by_assignment)) is True


def test_vllm_images_run_without_a_command_are_vllm_by_their_exact_name() -> None:
    assert vllm_invocations({"image": "vllm/vllm-openai:v0.9.1", "args": ["m"]})
    assert vllm_invocations({"image": "registry.local/vllm:0.9.1", "args": ["serve", "m"]})
    assert not vllm_invocations({"image": "ghcr.io/vllm-project/vllm-router:0.1", "args": ["--port", "8000"]})
    assert not vllm_invocations({"image": "vllm/vllm-openai:v0.9.1", "command": ["redis-server"]})
    assert len(vllm_invocations({"image": "vllm/vllm-openai:v0.9.1", "args": ["m"]})) == 1


def test_moonleases_own_connector_image_runs_vllm_without_a_command() -> None:
    """The Dockerfile's connector stage has ENTRYPOINT ["vllm"]: args `serve MODEL` start vLLM."""
    assert vllm_invocations({"image": "registry.local/moonlease/vllm-connector:0.1.0", "args": ["serve", "/models/m"]})
