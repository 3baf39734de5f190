"""Live connector settings, operator side: the ConfigMap each vLLM workload reads, the one-time
adoption of the workload, and whether its pods run what the policy asks. Pure.

Delivery (issue 15): every target workload reads its Moonlease settings from a file mounted
from a ConfigMap of its own, `<workload>-moonlease` (per workload, so the two arms of an A/B
test, or one workload of a stage, can run different settings). The workload is *adopted* once:
its pod template gains the volume, the mount in the vLLM container and the
`mooncake_settings_file` key in its `--kv-transfer-config` (one rolling restart, announced).
From then on a connector change edits only the ConfigMap: the kubelet swaps the file, the
running connector applies it between two lookups, no pod restarts.

Verification: a pod counts only when its running connector reports, on its settings endpoint
(`moonlease_settings.settings_file`), the hash of the settings the file gives it — computed here
with the connector's own parser over the workload's start-up defaults, so both sides agree.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moonlease_settings.config import ConnectorConfigError, MoonleaseConnectorConfig
from moonlease_settings.lease_modes import ALIAS_KEYS
from moonlease_settings.settings_file import (
    DEFAULT_SETTINGS_METRICS_PORT,
    SETTINGS_FILE_ENV,
    SETTINGS_FILE_NAME,
    SETTINGS_FILE_KEY,
    SETTINGS_FILE_PATH,
    SETTINGS_METRICS_PORT_ENV,
    SETTINGS_METRICS_PORT_KEY,
    SETTINGS_MOUNT_DIR,
    parse_settings_file,
    settings_hash,
)
from moonlease_operator.api import GROUP
from moonlease_operator.core.changes import Wrapped
from moonlease_operator.core.config_hash import build_config_hash
from moonlease_operator.core.health import current_ready_pods
from moonlease_operator.core.pod_set import PodSet
from moonlease_operator.core.command_line import Invocation, shell_script, vllm_invocations
from moonlease_operator.core.workload_args import (
    CONNECTOR_CLASS,
    EXTRA_CONFIG_KEY,
    find_container,
    is_our_module,
    kv_doc,
)

SETTINGS_VOLUME = "moonlease-connector-settings"
#: Label of every connector-settings ConfigMap, value "true" (for people and GitOps tools: the
#: operator reads each by name, `<workload>-moonlease`).
SETTINGS_CONFIG_MAP_LABEL = f"{GROUP}/connector-settings"
#: Pod annotation overriding the settings endpoint's port (like `prometheus.io/port`).
SETTINGS_PORT_ANNOTATION = f"{GROUP}/settings-metrics-port"
CONFIG_MAP_SUFFIX = "-moonlease"


def settings_config_map_name(workload: str) -> str:
    """The ConfigMap a workload reads its connector settings from (a valid object name: a
    workload name has at most 253 characters, and ours fits after truncation)."""
    return workload[:253 - len(CONFIG_MAP_SUFFIX)] + CONFIG_MAP_SUFFIX


def settings_config_map_stub(name: str, namespace: str | None) -> dict[str, Any]:
    """A ConfigMap to create when the workload's does not exist yet (no data: the policy's
    keys are then written into it like into any other owned file)."""
    meta: dict[str, Any] = {"name": name, "labels": {SETTINGS_CONFIG_MAP_LABEL: "true"}}
    if namespace:
        meta["namespace"] = namespace
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta}


def build_settings_file_desired(file: Mapping[str, Any]) -> dict[str, Wrapped]:
    """The owned keys of the settings file (typed values, the connector's key names).

    The lease mode's deprecated aliases are owned too, as absent: a file an operator of an
    earlier release wrote them into loses them when `mooncake_lease_mode` arrives (a rollback
    restores them), so the file never says the mode twice.
    """
    desired: dict[str, Wrapped] = {f"doc:{key}": None for key in ALIAS_KEYS if key not in file}
    desired.update({f"doc:{key}": {"v": value} for key, value in file.items()})
    return desired


def adoption_hash(config_map: str) -> str:
    """The pod template's configuration hash once adopted: it names the delivery, not the
    settings, so a settings change leaves the template (and the pods) alone."""
    return build_config_hash({"delivery": "settings-file", "configMap": config_map, "path": SETTINGS_FILE_PATH})


def build_adoption_desired(config_map: str, *, in_args: bool = True) -> dict[str, Wrapped]:
    """The slots that make a workload read its settings file: the volume, the mount in the vLLM
    container and (`in_args`) the file's path in `kv_connector_extra_config`. A container that
    runs vLLM through a shell script names the file in its script itself (`script_loads_settings`)."""
    desired: dict[str, Wrapped] = {
        f"volume:{SETTINGS_VOLUME}": {"v": {"name": SETTINGS_VOLUME, "configMap": {"name": config_map}}},
        f"mount:{SETTINGS_VOLUME}": {"v": {"name": SETTINGS_VOLUME, "mountPath": SETTINGS_MOUNT_DIR,
                                           "readOnly": True}},
    }
    if in_args:
        desired[f"kv:{EXTRA_CONFIG_KEY}.{SETTINGS_FILE_KEY}"] = {"v": SETTINGS_FILE_PATH}
    return desired


#: What a shell script must pass to `vllm serve` for the operator to manage it (the operator
#: cannot edit a script; with this in it, it only adds the volume and the mount).
SCRIPT_KV_TRANSFER_CONFIG = ('--kv-transfer-config \'{"kv_connector":"MooncakeStoreConnector",'
                             '"kv_connector_module_path":"moonlease_connector","kv_role":"kv_both",'
                             '"kv_load_failure_policy":"recompute",'
                             f'"kv_connector_extra_config":{{"{SETTINGS_FILE_KEY}":"{SETTINGS_FILE_PATH}"}}}}\'')


def connector_invocation(container: Mapping[str, Any]) -> Invocation | None:
    """The container's one vLLM invocation (None: it starts vLLM nowhere, or more than once)."""
    found = vllm_invocations(container)
    return found[0] if len(found) == 1 else None


def startup_sources(container: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """What the connector starts on: the `--kv-transfer-config` the vLLM command really passes
    (in a script: the script's own words) and the environment (the container's literal values,
    then the script's assignments before the command)."""
    invocation = connector_invocation(container)
    doc = invocation.kv_doc() if invocation is not None else kv_doc(container)
    env = {e["name"]: e["value"] for e in container.get("env") or [] if "value" in e and "name" in e}
    if invocation is not None:
        env.update(invocation.env)
    return (doc or {}), env


def loads_our_settings(container: Mapping[str, Any]) -> bool:
    """Whether the container's vLLM command loads our connector (`kv_connector` ours, from our
    module) and names the settings file (in its extra config, or `MOONLEASE_SETTINGS_FILE`)."""
    if connector_invocation(container) is None:
        return False
    doc, env = startup_sources(container)
    extra = doc.get(EXTRA_CONFIG_KEY)
    names_file = (isinstance(extra, dict) and extra.get(SETTINGS_FILE_KEY) == SETTINGS_FILE_PATH) \
        or env.get(SETTINGS_FILE_ENV) == SETTINGS_FILE_PATH
    return doc.get("kv_connector") == CONNECTOR_CLASS and is_our_module(doc.get("kv_connector_module_path")) \
        and names_file


def script_loads_settings(container: Mapping[str, Any]) -> bool | None:
    """None when the container runs no shell script; else whether the script's one vLLM command
    loads our connector and names the settings file — read from the command's own words, so a
    script that merely mentions the connector (`pip install moonlease_connector`, an `echo` of
    the path) does not count."""
    if shell_script(container) is None:
        return None
    return loads_our_settings(container)


def startup_defaults(obj: Mapping[str, Any], container: str | None) -> MoonleaseConnectorConfig | None:
    """The connector's start-up settings as the workload's pod template gives them (what its
    vLLM command passes in `kv_connector_extra_config`, and the literal env values); None when
    the connector would refuse them (it would not start)."""
    extra_doc, env = startup_sources(find_container(obj, container) or {})
    extra = extra_doc.get(EXTRA_CONFIG_KEY) or {}
    try:
        return MoonleaseConnectorConfig.from_sources(extra if isinstance(extra, dict) else {}, env)
    except ConnectorConfigError:
        return None


def expected_settings_hash(obj: Mapping[str, Any], container: str | None, file: Mapping[str, Any]) -> str | None:
    """The hash a pod of `obj` reports once it runs the file holding `file` (None: cannot run)."""
    return file_settings_hash(obj, container, json.dumps(dict(file)))


def file_settings_hash(obj: Mapping[str, Any], container: str | None, text: str | None) -> str | None:
    """The hash a pod of `obj` reports once it runs a settings file of this text (None: no file,
    or one its connector would refuse — it then keeps whatever it ran before)."""
    defaults = startup_defaults(obj, container)
    if defaults is None or text is None:
        return None
    try:
        return settings_hash(parse_settings_file(text, defaults))
    except ConnectorConfigError:
        return None


def settings_file_text(config_map: Mapping[str, Any] | None) -> str | None:
    """The settings file a ConfigMap holds (None: no such key, so no file in the pods)."""
    return ((config_map or {}).get("data") or {}).get(SETTINGS_FILE_NAME)


def template_reads_settings_file(obj: Mapping[str, Any]) -> bool:
    """Whether a workload's pod template mounts a connector settings volume (adopted)."""
    spec = ((obj.get("spec") or {}).get("template") or {}).get("spec") or {}
    return reads_settings_file({"spec": spec})


def settings_endpoint(pod: Mapping[str, Any]) -> str | None:
    """`ip:port` of a pod's settings endpoint: the pod annotation, else the port its connector
    container (the one mounting the settings volume) sets (`mooncake_settings_metrics_port` in
    the kv-transfer-config, then the env var), else the default port."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    port: Any = annotations.get(SETTINGS_PORT_ANNOTATION)
    if port is None:
        containers = (pod.get("spec") or {}).get("containers") or []
        found: Mapping[str, Any] = next((c for c in containers
                      if any(m.get("name") == SETTINGS_VOLUME for m in c.get("volumeMounts") or [])), {})
        doc, env = startup_sources(found)
        extra = doc.get(EXTRA_CONFIG_KEY) or {}
        extra = extra if isinstance(extra, dict) else {}
        port = extra.get(SETTINGS_METRICS_PORT_KEY, env.get(SETTINGS_METRICS_PORT_ENV) or DEFAULT_SETTINGS_METRICS_PORT)
    try:
        return f"{ip}:{int(port)}"
    except (TypeError, ValueError):
        return None


def reads_settings_file(pod: Mapping[str, Any]) -> bool:
    """Whether a pod mounts a connector settings volume (the pods worth scraping)."""
    return any(v.get("name") == SETTINGS_VOLUME for v in (pod.get("spec") or {}).get("volumes") or [])


@dataclass(frozen=True)
class SettingsPods:
    """One workload's pods as settings verification sees them: the one rule for which pods
    must report and which are contacted (`settings_pods`)."""

    report: tuple[Mapping[str, Any], ...]
    """Ready pods of the current pod template that mount the settings volume: each must report
    the expected settings, and these (and only these) are contacted."""
    unmounted: tuple[Mapping[str, Any], ...]
    """Ready pods of the current pod template of a workload whose template mounts the settings
    volume, that do not mount it themselves (a mutating webhook dropped it, a pod made by hand
    with the template's labels and hash): they can never read the file, so they are reported at
    once, with the fix, instead of being waited for until the stage times out."""


def settings_pods(obj: Mapping[str, Any], pods: Sequence[Mapping[str, Any]] | PodSet) -> SettingsPods:
    """Which of `obj`'s pods must report their connector settings (see `SettingsPods`)."""
    current = current_ready_pods(obj, pods)
    if not template_reads_settings_file(obj):
        return SettingsPods(report=(), unmounted=())
    return SettingsPods(report=tuple(p for p in current if reads_settings_file(p)),
                        unmounted=tuple(p for p in current if not reads_settings_file(p)))


def pods_to_contact(workloads: Iterable[Mapping[str, Any]],
                    pods: Sequence[Mapping[str, Any]] | PodSet) -> list[Mapping[str, Any]]:
    """Every pod whose settings endpoint a reconcile reads: the pods that must report, of every
    workload given (`settings_pods`), each once."""
    chosen: dict[tuple[str | None, str], Mapping[str, Any]] = {}
    for obj in workloads:
        for pod in settings_pods(obj, pods).report:
            meta = pod.get("metadata") or {}
            chosen.setdefault((meta.get("namespace"), str(meta.get("name"))), pod)
    return list(chosen.values())


def unmounted_pod_problem(pod: Mapping[str, Any]) -> str:
    """Why a Ready pod without the settings volume fails its stage at once, and the fix."""
    name = str((pod.get("metadata") or {}).get("name"))
    return (f"pod {name}: runs without the settings volume {SETTINGS_VOLUME} its pod template mounts (dropped by"
            f" a mutating webhook, or a pod made by hand), so its connector can never read the settings; delete"
            f" it (kubectl delete pod {name}) so that its controller recreates it from the template, and let"
            f" no webhook remove the volume")


@dataclass(frozen=True)
class SettingsReport:
    """What one pod's settings endpoint said (or why it could not be read: `error`)."""

    settings_hash: str | None = None
    lease_mode: str | None = None
    refused_hash: str | None = None
    refused_reason: str | None = None
    error: str | None = None


#: Metric families of the connector's settings endpoint (its names, from the connector).
INFO_FAMILY = "moonlease_connector_settings_info"
REFUSED_FAMILY = "moonlease_connector_settings_refused_info"


def read_settings_report(samples: Sequence[tuple[str, Mapping[str, str], float]]) -> SettingsReport:
    """A report from scraped samples `(name, labels, value)`; pure so both ends are testable."""
    info = [labels for name, labels, value in samples if name == INFO_FAMILY and value == 1]
    refused = [labels for name, labels, value in samples if name == REFUSED_FAMILY and value == 1]
    if len(info) != 1:
        return SettingsReport(error=f"{len(info)} {INFO_FAMILY} series with value 1 (expected one)")
    return SettingsReport(settings_hash=info[0].get("settings_hash"), lease_mode=info[0].get("lease_mode"),
                          refused_hash=refused[0].get("settings_hash") if refused else None,
                          refused_reason=refused[0].get("reason") if refused else None)


def refused_expected(report: SettingsReport | None, expected: str | None) -> bool:
    """Whether the pod's connector read exactly the expected settings and refused them (a client
    or model that cannot serve the mode): waiting longer cannot change its answer."""
    return report is not None and expected is not None and report.refused_hash == expected \
        and report.settings_hash != expected


def evaluate_pod_settings(pod_name: str, report: SettingsReport | None, expected: str | None) -> str | None:
    """None when the pod runs `expected`; otherwise the per-pod reason (for status and events)."""
    if expected is None:
        return (f"pod {pod_name}: the connector would refuse the workload's start-up settings "
                "(kv_connector_extra_config / environment), so no settings can be verified")
    if report is None:
        return f"pod {pod_name}: settings endpoint not read yet"
    if report.error is not None:
        return f"pod {pod_name}: settings endpoint unreadable: {report.error}"
    if report.settings_hash == expected:
        return None
    why = (f"; it refused them ({report.refused_reason})" if report.refused_hash == expected
           and report.refused_reason else "")
    return (f"pod {pod_name}: connector runs settings {report.settings_hash} (lease mode {report.lease_mode}),"
            f" expected {expected}{why}")

