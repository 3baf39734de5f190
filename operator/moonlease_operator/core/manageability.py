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
from moonlease_operator.core.settings import CONNECTOR_CLASS, MasterSettings
from moonlease_operator.core.workload_args import (
    CONNECTOR_MODULE,
    EXTRA_CONFIG_KEY,
    KV_TRANSFER_CONFIG_OPTIONS,
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


def evaluate_target(obj: Mapping[str, Any], container: str | None) -> WorkloadProblem | None:
    """Refuse a vLLM workload whose connector is not ours, or whose arguments we cannot edit."""
    name = describe_object(obj)
    found = find_container(obj, container)
    if found is None:
        return WorkloadProblem(Reason.UNMANAGEABLE_WORKLOAD, f"{name}: container {container or '(first)'} not found")
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
        return WorkloadProblem(Reason.FOREIGN_CONNECTOR,
                               f"{name} uses kv_connector {connector!r}; the policy manages only Moonlease's"
                               f" {CONNECTOR_CLASS} and will not replace another connector")
    if (connector is not None or module is not None) and not is_our_module(module):
        return WorkloadProblem(Reason.FOREIGN_CONNECTOR,
                               f"{name} uses {CONNECTOR_CLASS} from {module or 'vLLM itself'!r}, which ignores"
                               f" lease modes: set kv_connector_module_path to {CONNECTOR_MODULE!r}")
    return None


def evaluate_master(obj: Mapping[str, Any], container: str | None, settings: MasterSettings) -> WorkloadProblem | None:
    """Refuse a master whose container is missing, or whose args set a flag the policy writes to
    its config file (which of the two would win is Mooncake's business, not ours to guess)."""
    name = describe_object(obj)
    found = find_container(obj, container)
    if found is None:
        return WorkloadProblem(Reason.UNMANAGEABLE_WORKLOAD, f"{name}: container {container or '(first)'} not found")
    if settings.config_map is not None:
        in_args = sorted(flag for flag in settings.flags if find_flag(found, flag) is not None)
        if in_args:
            return WorkloadProblem(Reason.UNMANAGEABLE_WORKLOAD,
                                   f"{name} sets {', '.join('--' + f for f in in_args)} in its args, but the policy"
                                   f" writes them to ConfigMap {settings.config_map.name}: remove them from the args")
    return None


def evaluate_config_map(obj: Mapping[str, Any], key: str) -> WorkloadProblem | None:
    """Refuse a master ConfigMap whose config file we cannot parse as a mapping."""
    doc = parse_doc(key, (obj.get("data") or {}).get(key))
    if not isinstance(doc, dict):
        return WorkloadProblem(Reason.UNMANAGEABLE_WORKLOAD,
                               f"ConfigMap/{(obj.get('metadata') or {}).get('name')}: {key} is not a"
                               f" {'YAML' if is_yaml(key) else 'JSON'} mapping")
    return None

