"""Reading and editing a pod template's containers, their command-line options, and the
config files in ConfigMaps. Pure: plain dicts in, plain dicts out.

Shared by the settings renderer (`core.settings`), the slot editor (`core.slots`) and the
manageability checks (`core.manageability`), so that all three find an option the same way.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from moonlease_operator.api.policy import BOOLEAN_MASTER_FLAGS
from moonlease_operator.core.command_line import KV_TRANSFER_CONFIG_OPTIONS

EXTRA_CONFIG_KEY = "kv_connector_extra_config"
CONNECTOR_MODULE = "moonlease_connector"
CONNECTOR_CLASS = "MooncakeStoreConnector"


def describe_object(obj: Mapping[str, Any]) -> str:
    return f"{obj.get('kind', 'Workload')}/{(obj.get('metadata') or {}).get('name', '?')}"


def find_container(obj: Mapping[str, Any], name: str | None) -> dict[str, Any] | None:
    containers = ((obj.get("spec") or {}).get("template") or {}).get("spec", {}).get("containers") or []
    if name is None:
        return containers[0] if containers else None
    return next((c for c in containers if c.get("name") == name), None)


@dataclass(frozen=True)
class OptionHit:
    """Where an option sits in a container's args or command."""

    field: str
    index: int
    length: int
    spelled: str
    value: str | None


def find_option(container: Mapping[str, Any], names: tuple[str, ...], *, boolean: bool = False) -> OptionHit | None:
    # args come after command on the command line, and argparse keeps the last occurrence.
    for where in ("args", "command"):
        tokens = container.get(where) or []
        for i in range(len(tokens) - 1, -1, -1):
            token = tokens[i]
            if not isinstance(token, str):
                continue
            for name in names:
                if token == name:
                    if boolean or i + 1 >= len(tokens):
                        return OptionHit(where, i, 1, name, "true" if boolean else None)
                    return OptionHit(where, i, 2, name, tokens[i + 1])
                if token.startswith(name + "="):
                    return OptionHit(where, i, 1, name, token[len(name) + 1:])
    return None


def find_flag(container: Mapping[str, Any], flag: str) -> OptionHit | None:
    """A gflags flag: `--f=v`, `-f=v`, `--f v`, and for booleans `--f` and `--nof`."""
    boolean = flag in BOOLEAN_MASTER_FLAGS
    hit = find_option(container, (f"--{flag}", f"-{flag}"), boolean=boolean)
    if hit is None and boolean:
        negated = find_option(container, (f"--no{flag}", f"-no{flag}"), boolean=True)
        if negated is not None:
            return OptionHit(negated.field, negated.index, 1, negated.spelled, "false")
    return hit


def flag_value(tokens: list[str], flag: str) -> str | None:
    hit = find_flag({"args": tokens}, flag)
    return None if hit is None else hit.value


def option_tokens(container: Mapping[str, Any], hit: OptionHit) -> list[str]:
    return list(container[hit.field][hit.index:hit.index + hit.length])


def replace_tokens(container: dict[str, Any], hit: OptionHit | None, tokens: list[str] | None) -> None:
    if hit is None:
        if tokens is not None:
            container.setdefault("args", []).extend(tokens)
        return
    container[hit.field][hit.index:hit.index + hit.length] = tokens or []


def kv_doc(container: Mapping[str, Any] | None) -> dict[str, Any] | None:
    hit = None if container is None else find_option(container, KV_TRANSFER_CONFIG_OPTIONS)
    if hit is None or hit.value is None:
        return None
    try:
        doc = json.loads(hit.value)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def set_kv_doc(container: dict[str, Any], doc: Mapping[str, Any]) -> None:
    text = json.dumps(doc, separators=(",", ":"))
    hit = find_option(container, KV_TRANSFER_CONFIG_OPTIONS)
    if hit is None:
        container.setdefault("args", []).extend([KV_TRANSFER_CONFIG_OPTIONS[0], text])
    elif hit.length == 2:
        container[hit.field][hit.index + 1] = text
    else:
        container[hit.field][hit.index] = f"{hit.spelled}={text}"


def is_our_module(module: Any) -> bool:
    return isinstance(module, str) and (module == CONNECTOR_MODULE or module.startswith(CONNECTOR_MODULE + "."))


def is_yaml(key: str | None) -> bool:
    return bool(key) and str(key).endswith((".yaml", ".yml"))


def parse_doc(key: str | None, text: str | None) -> Any:
    if text is None:
        return {}
    try:
        return yaml.safe_load(text) if is_yaml(key) else json.loads(text)
    except (ValueError, yaml.YAMLError):
        return None


def format_doc(key: str | None, doc: Mapping[str, Any]) -> str:
    if is_yaml(key):
        return yaml.safe_dump(dict(doc), sort_keys=False)
    return json.dumps(doc, indent=2) + "\n"



def container_names(obj: Mapping[str, Any]) -> list[str]:
    """The names of the pod template's (main) containers, in order."""
    containers = ((obj.get("spec") or {}).get("template") or {}).get("spec", {}).get("containers") or []
    return [str(c.get("name", "?")) for c in containers]
