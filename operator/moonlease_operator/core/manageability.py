"""Whether a workload can be managed at all: the refusals checked before any change. Pure.

Each check returns a `WorkloadProblem` (the condition reason and a message saying what to
change) or None; the rollout planner (`core.rollout`) reports them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moonlease_operator.api import Reason
from moonlease_operator.core.command_line import (
    KV_TRANSFER_CONFIG_OPTIONS,
    runs_mooncake_master,
    script_commands,
    shell_script,
    vllm_invocations,
)
from moonlease_operator.core.connector_delivery import SCRIPT_KV_TRANSFER_CONFIG, script_loads_settings
from moonlease_operator.core.settings import MasterSettings
from moonlease_operator.core.workload_args import (
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    EXTRA_CONFIG_KEY,
    container_names,
    describe_object,
    find_container,
    find_flag,
    find_option,
    is_our_module,
    is_yaml,
    parse_doc,
)


@dataclass(frozen=True)
class WorkloadProblem:
    reason: Reason
    message: str


def evaluate_target(obj: Mapping[str, Any], container: str | None, *,
                    field: str = "spec.targets[].container") -> WorkloadProblem | None:
    """Refuse a vLLM workload the policy cannot manage: the container is ambiguous (several and
    none named), does not start vLLM (a named container is checked like any other: naming a
    sidecar by mistake must not give it vLLM's flags), starts it more than once, runs it through
    a shell script that does not load our connector with its settings file (the operator cannot
    edit a script), or its connector is not ours, or its `--kv-transfer-config` cannot be edited.

    What the container runs is read as the kubelet runs it (`core.command_line`).
    `field`: where in the policy the container is named, for the message."""
    name = describe_object(obj)
    found, problem = _pick_container(obj, container, field, "vLLM")
    if problem is not None:
        return problem
    assert found is not None
    label = f"{name} container {found.get('name')!r}"
    script = shell_script(found)
    if script is not None and script_commands(script) is None:
        return WorkloadProblem(Reason.UNMANAGEABLE_WORKLOAD,
                               f"{label} runs a shell script the operator cannot read (an unclosed quote?):"
                               " fix the script, or run vLLM without a shell")
    invocations = vllm_invocations(found)
    if not invocations:
        return WorkloadProblem(
            Reason.UNMANAGEABLE_WORKLOAD,
            f"{label} does not run vLLM (no command it runs starts `vllm serve` or `python -m vllm...`, and"
            f" it is not a vLLM image run without a command): point the target at a vLLM workload, or set"
            f" {field} to the container that runs vLLM")
    if len(invocations) > 1:
        return WorkloadProblem(Reason.UNMANAGEABLE_WORKLOAD,
                               f"{label} starts vLLM {len(invocations)} times: the operator manages one vLLM"
                               " per container")
    if script is not None:
        doc = invocations[0].kv_doc() or {}
        connector = doc.get("kv_connector")
        if connector is not None and connector != CONNECTOR_CLASS:
            return _foreign(name, connector)
        if script_loads_settings(found):
            return None  # the script loads the connector and names its settings file itself
        return WorkloadProblem(
            Reason.UNMANAGEABLE_WORKLOAD,
            f"{label} runs its command through a shell script, which the operator cannot edit: add"
            f" {SCRIPT_KV_TRANSFER_CONFIG} to the vllm serve command in the script (the operator then adds"
            f" only the settings volume and mount), or run vLLM without a shell"
            f" (command: [\"vllm\", \"serve\"], args: [MODEL, ...]; setup steps in an initContainer)")
    hit = find_option(found, KV_TRANSFER_CONFIG_OPTIONS)
    if hit is None:
        return None
    if hit.value is None:
        return WorkloadProblem(Reason.UNMANAGEABLE_WORKLOAD, f"{name}: {hit.spelled} has no value")
    try:
        doc = json.loads(hit.value)
    except ValueError:
        return WorkloadProblem(Reason.UNMANAGEABLE_WORKLOAD, f"{name}: {hit.spelled} is not valid JSON")
    if not isinstance(doc, dict) or not isinstance(doc.get(EXTRA_CONFIG_KEY, {}), dict):
        return WorkloadProblem(Reason.UNMANAGEABLE_WORKLOAD,
                               f"{name}: {hit.spelled} must be a JSON object with an object {EXTRA_CONFIG_KEY}")
    connector, module = doc.get("kv_connector"), doc.get("kv_connector_module_path")
    if connector is not None and connector != CONNECTOR_CLASS:
        return _foreign(name, connector)
    if (connector is not None or module is not None) and not is_our_module(module):
        return WorkloadProblem(Reason.FOREIGN_CONNECTOR,
                               f"{name} uses {CONNECTOR_CLASS} from {module or 'vLLM itself'!r}, which ignores"
                               f" lease modes: set kv_connector_module_path to {CONNECTOR_MODULE!r}")
    return None


def _foreign(name: str, connector: Any) -> WorkloadProblem:
    return WorkloadProblem(Reason.FOREIGN_CONNECTOR,
                           f"{name} uses kv_connector {connector!r}; the policy manages only Moonlease's"
                           f" {CONNECTOR_CLASS} and will not replace another connector")


def evaluate_master(obj: Mapping[str, Any], container: str | None, settings: MasterSettings) -> WorkloadProblem | None:
    """Refuse a master the policy cannot manage: the container is ambiguous (several and none
    named), does not run `mooncake_master`, runs it through a shell while the flags go into the
    args, or sets in its args a flag the policy writes to its config file (which of the two
    would win is Mooncake's business, not ours to guess)."""
    name = describe_object(obj)
    found, problem = _pick_container(obj, container, "spec.master.container", "mooncake_master")
    if problem is not None:
        return problem
    assert found is not None
    label = f"{name} container {found.get('name')!r}"
    if not runs_mooncake_master(found):
        return WorkloadProblem(
            Reason.UNMANAGEABLE_WORKLOAD,
            f"{label} does not run mooncake_master (neither command, args nor image show it): point"
            f" spec.master.name at the Mooncake master workload (command: [\"mooncake_master\"])")
    if settings.config_map is None and shell_script(found) is not None:
        return WorkloadProblem(
            Reason.UNMANAGEABLE_WORKLOAD,
            f"{label} runs mooncake_master through a shell script, where the operator cannot set its"
            f" flags: run it without a shell (command: [\"mooncake_master\"], args: [\"--rpc_port=50051\", ...]),"
            f" or set spec.master.configMap to the config file it reads with --config_path")
    if settings.config_map is not None:
        in_args = sorted(flag for flag in settings.flags if find_flag(found, flag) is not None)
        if in_args:
            return WorkloadProblem(Reason.UNMANAGEABLE_WORKLOAD,
                                   f"{name} sets {', '.join('--' + f for f in in_args)} in its args, but the policy"
                                   f" writes them to ConfigMap {settings.config_map.name}: remove them from the args")
    return None


def _pick_container(obj: Mapping[str, Any], container: str | None, field: str,
                    runs: str) -> tuple[dict[str, Any] | None, WorkloadProblem | None]:
    """The container the policy manages, or why there is none to pick."""
    name = describe_object(obj)
    names = container_names(obj)
    if container is None and len(names) > 1:
        return None, WorkloadProblem(
            Reason.UNMANAGEABLE_WORKLOAD,
            f"{name} has {len(names)} containers ({', '.join(names)}): set {field} to the one that runs {runs}")
    found = find_container(obj, container)
    if found is None:
        return None, WorkloadProblem(Reason.UNMANAGEABLE_WORKLOAD,
                                     f"{name}: container {container or '(first)'} not found")
    return found, None


def evaluate_config_map(obj: Mapping[str, Any], key: str) -> WorkloadProblem | None:
    """Refuse a master ConfigMap whose config file we cannot parse as a mapping."""
    doc = parse_doc(key, (obj.get("data") or {}).get(key))
    if not isinstance(doc, dict):
        return WorkloadProblem(Reason.UNMANAGEABLE_WORKLOAD,
                               f"ConfigMap/{(obj.get('metadata') or {}).get('name')}: {key} is not a"
                               f" {'YAML' if is_yaml(key) else 'JSON'} mapping")
    return None

