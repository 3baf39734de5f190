"""`moonlease status|plan|promote|abort|pause|resume|retry|approve`: driving a rollout from a
terminal or a script (also `kubectl moonlease ...`). Not pure: this is the commands' I/O.

Cluster access is the operator's own: its API client (`adapters.kube.KubeClient`) over a
`ClusterConnection` (no kopf: `pip install moonlease` without the operator extra runs these
commands), logged in as kubectl logs in — the kubeconfig (`--kubeconfig`,
`$KUBECONFIG`, `~/.kube/config`; `--context`, its namespace by default), else the in-cluster
service account. What the commands say is decided elsewhere: the status screen by
`moonlease.status_view`, the dry run by the operator's `plan_preview`, what a verb does by the
operator itself (`core.verbs`), whose answer the verb commands wait for in `status.lastVerb`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

from moonlease_operator.adapters.kube import ApiError, ClusterConnection, KubeClient
from moonlease_operator.adapters.workloads import WORKLOAD_KINDS, fetch_observed, object_path
from moonlease_operator.api import (
    APPROVE_MASTER_RESTART_ANNOTATION,
    KIND,
    VERB_ANNOTATION,
    PolicySpecError,
    PolicyStatus,
    Verb,
    VerbOutcome,
    VerbRecord,
    parse_spec,
    read_spec,
)
from moonlease_operator.core.rollout import PolicyRef, plan_fetch, plan_preview
from moonlease_operator.core.slots import POLICY_LABEL, policy_label_value
from moonlease_operator.core.status import read_status
from moonlease_operator.core.verbs import build_verb_value

#: Exit codes shared by the commands (docs/cli.md, "Driving a rollout", lists them).
EXIT_OK = 0            # status: Ready; a verb: applied; plan: nothing would change
EXIT_WORKING = 1       # status: the operator is working on it, or it failed (see the message)
EXIT_WAITING = 2       # status: it waits for a person (the screen says which command); plan: changes
EXIT_UNREADABLE = 3    # the cluster or the policy could not be read or written, or bad input
EXIT_IGNORED = 4       # a verb the operator ignored (the message says why); plan: refused
EXIT_NO_ANSWER = 5     # a verb written, but the operator did not answer within --timeout

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class CommandError(Exception):
    """A failure the command reports in one line, with EXIT_UNREADABLE."""


def login(kubeconfig: str | None, context: str | None) -> tuple[ClusterConnection, str]:
    """The connection and default namespace, found as kubectl finds them."""
    import kubernetes

    config_file = kubeconfig or os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
    namespace = "default"
    try:
        if kubeconfig or context or os.environ.get("KUBECONFIG") or Path(config_file).exists() \
                or not (SERVICE_ACCOUNT / "token").exists():
            kubernetes.config.load_kube_config(config_file=kubeconfig, context=context)
            _, current = kubernetes.config.list_kube_config_contexts(config_file=kubeconfig)
            chosen = current
            if context is not None:
                contexts, _ = kubernetes.config.list_kube_config_contexts(config_file=kubeconfig)
                chosen = next((c for c in contexts if c.get("name") == context), current)
            namespace = (chosen.get("context") or {}).get("namespace") or "default"
        else:
            kubernetes.config.load_incluster_config()
            namespace = (SERVICE_ACCOUNT / "namespace").read_text().strip() or "default"
    except Exception as exc:  # noqa: BLE001 - config errors come in many types; one line says why
        raise CommandError(f"cannot log in to the cluster: {exc}") from exc
    config = kubernetes.client.Configuration.get_default_copy()
    header = config.get_api_key_with_prefix("BearerToken") or config.get_api_key_with_prefix("authorization")
    parts = header.split(" ", 1) if header else []
    scheme, token = (None, None) if not parts else (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    info = ClusterConnection(server=config.host, ca_path=config.ssl_ca_cert, insecure=not config.verify_ssl,
                             username=config.username or None, password=config.password or None,
                             scheme=scheme, token=token, certificate_path=config.cert_file,
                             private_key_path=config.key_file, default_namespace=namespace)
    return info, namespace


async def _policy(client: KubeClient, namespace: str, name: str) -> dict[str, Any]:
    try:
        return dict(await client.get(object_path(KIND, namespace, name)))
    except ApiError as exc:
        raise CommandError(f"cannot read mooncakeleasepolicy {name}: {exc}") from exc


# ---- status ---------------------------------------------------------------------------------

def status_exit_code(phase: str, waiting_command: str | None) -> int:
    if phase == "Ready":
        return EXIT_OK
    return EXIT_WAITING if waiting_command else EXIT_WORKING


async def show_status(client: KubeClient, namespace: str, name: str, *, output: str, targets: bool,
                      out: TextIO) -> int:
    """One screen (or JSON object) about the policy; the exit code says whether it is done."""
    from moonlease.status_view import build_status_view, render_status

    policy = await _policy(client, namespace, name)
    workloads = None
    if targets:  # the full picture: every workload the policy manages, from its own annotations
        listed = {(t.get("kind"), t.get("name")) for t in (policy.get("status") or {}).get("targets") or []}
        selector = f"{POLICY_LABEL}={policy_label_value(name)}"
        try:
            workloads = {(kind, obj["metadata"]["name"]): obj for kind in WORKLOAD_KINDS
                         for obj in await client.list(object_path(kind, namespace), label_selector=selector)}
            for kind, target in listed - set(workloads):  # listed but not (or no longer) labelled
                with contextlib.suppress(ApiError):
                    workloads[(kind, target)] = await client.get(object_path(kind, namespace, target))
        except ApiError as exc:
            raise CommandError(f"cannot read the workloads of {name}: {exc}") from exc
    view = build_status_view(policy, workloads)
    if output == "text":
        out.write(render_status(view))
    elif output == "jsonl":  # --watch -o json: one object a line
        out.write(json.dumps(view.as_json(), separators=(",", ":")) + "\n")
    else:
        out.write(json.dumps(view.as_json(), indent=2) + "\n")
    out.flush()
    return status_exit_code(view.phase, view.waiting.command if view.waiting else None)


async def watch_status(client: KubeClient, namespace: str, name: str, *, output: str, targets: bool,
                       interval: float, count: int | None, out: TextIO) -> int:
    """`--watch`: the screen again every `interval` seconds (until Ctrl-C, or `count` screens);
    text clears the terminal between screens, json prints one object per line."""
    code, shown = EXIT_UNREADABLE, 0
    while count is None or shown < count:
        if shown and output == "text" and out.isatty():
            out.write("\x1b[H\x1b[2J")
        code = await show_status(client, namespace, name, output="jsonl" if output == "json" else output,
                                 targets=targets, out=out)
        shown += 1
        if count is None or shown < count:
            await asyncio.sleep(interval)
    return code


# ---- plan -----------------------------------------------------------------------------------

def read_policy_file(path: str) -> dict[str, Any]:
    """The MooncakeLeasePolicy in a YAML file (`-` for stdin); other documents are skipped."""
    import yaml

    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
        documents = [d for d in yaml.safe_load_all(text) if isinstance(d, dict)]
    except (OSError, yaml.YAMLError) as exc:
        raise CommandError(f"cannot read {path}: {exc}") from exc
    policies = [d for d in documents if d.get("kind") == KIND]
    if len(policies) != 1:
        raise CommandError(f"{path} holds {len(policies)} {KIND} objects; plan takes exactly one")
    if not (policies[0].get("metadata") or {}).get("name"):
        raise CommandError(f"{path}: the {KIND} has no metadata.name")
    return policies[0]


async def show_plan(client: KubeClient, policy: Mapping[str, Any], namespace: str, *, output: str,
                    now: Any, out: TextIO) -> int:
    """The dry run: the live cluster read as the operator reads it, the operator's planner asked."""
    from moonlease.plan_view import plan_exit_code, preview_json, render_preview

    meta = policy.get("metadata") or {}
    name = meta["name"]
    raw_spec = policy.get("spec") or {}
    try:
        policies = await client.list(object_path(KIND, namespace))
        live = next((p for p in policies if p["metadata"]["name"] == name), None)
        previous = read_status((live or {}).get("status"))
        observed = await fetch_observed(client, namespace, plan_fetch(read_spec(raw_spec), previous), policies=policies)
    except ApiError as exc:
        raise CommandError(f"cannot read the cluster: {exc}") from exc
    live_meta = (live or {}).get("metadata") or {}
    ref = PolicyRef(name=name, namespace=namespace, generation=live_meta.get("generation"),
                    created=live_meta.get("creationTimestamp") or now.strftime("%Y-%m-%dT%H:%M:%SZ"),
                    annotations={})  # a dry run hears no verbs
    preview = plan_preview(raw_spec=raw_spec, policy=ref, previous=previous, observed=observed, now=now)
    try:
        approval = parse_spec(raw_spec).master.require_approval_for_restart
    except PolicySpecError:
        approval = False
    if output == "json":
        out.write(json.dumps(preview_json(preview, name, namespace, approval=approval), indent=2) + "\n")
    else:
        out.write(render_preview(preview, name, namespace, approval=approval))
    return plan_exit_code(preview)


# ---- verbs ----------------------------------------------------------------------------------

def _last(status: PolicyStatus, verb: Verb) -> VerbRecord | None:
    return status.last_approval if verb is Verb.APPROVE else status.last_verb


async def give_verb(client: KubeClient, namespace: str, name: str, verb: Verb, *, output: str, wait: bool,
                    timeout: float, out: TextIO, sleep: Callable[[float], Any] = asyncio.sleep) -> int:
    """Write the verb keyed to the rollout the status shows (approve: the pending approval),
    then wait for the operator's answer in the status."""
    path = object_path(KIND, namespace, name)
    status = read_status((await _policy(client, namespace, name)).get("status"))
    if verb is Verb.APPROVE:
        if not status.pending_approval:
            return _say(out, output, verb, None, None, EXIT_IGNORED,
                        f"nothing waits for approval (phase {status.phase.value if status.phase else 'Pending'})")
        annotation, value = APPROVE_MASTER_RESTART_ANNOTATION, status.pending_approval
    else:
        annotation, value = VERB_ANNOTATION, build_verb_value(verb, status.revision, status.desired_config_hash)
    last = _last(status, verb)
    if last is not None and last.value == value:
        return _answer(out, output, verb, annotation, value, last, already=True)
    try:
        await client.merge_patch(path, {"metadata": {"annotations": {annotation: value}}})
    except ApiError as exc:
        raise CommandError(f"cannot annotate mooncakeleasepolicy {name}: {exc}") from exc
    if not wait:
        return _say(out, output, verb, annotation, value, EXIT_OK, f"written {annotation}={value}")
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        await sleep(0.3)
        last = _last(read_status((await _policy(client, namespace, name)).get("status")), verb)
        if last is not None and last.value == value:
            return _answer(out, output, verb, annotation, value, last)
    return _say(out, output, verb, annotation, value, EXIT_NO_ANSWER,
                f"written {annotation}={value}, but the operator did not answer within {timeout:g}s (is it running?)")


def _answer(out: TextIO, output: str, verb: Verb, annotation: str, value: str, record: VerbRecord, *,
            already: bool = False) -> int:
    code = EXIT_OK if record.outcome is VerbOutcome.APPLIED else EXIT_IGNORED
    when = "already handled" if already else "the operator"
    return _say(out, output, verb, annotation, value, code,
                f"{record.outcome.value.lower()} ({when}): {record.message}", outcome=record.outcome.value)


def _say(out: TextIO, output: str, verb: Verb, annotation: str | None, value: str | None, code: int,
         message: str, *, outcome: str | None = None) -> int:
    if output == "json":
        out.write(json.dumps({"verb": verb.value, "annotation": annotation, "value": value, "outcome": outcome,
                              "message": message, "exitCode": code}, indent=2) + "\n")
    else:
        out.write(f"{verb.value}: {message}\n")
    return code


async def with_client(connection: ClusterConnection, work: Callable[[KubeClient], Any]) -> int:
    """Run `work` with the operator's client, closed afterwards; a CommandError is one line."""
    client = KubeClient(connection, user_agent="moonlease-cli", retries=2, timeout=15.0)
    try:
        return int(await work(client))
    finally:
        await client.close()
