"""`moonlease`: the command line. Each subcommand imports only what it needs, so the operator
image (no torch, no vLLM) runs `moonlease operator` and `moonlease crd` without them.

Development commands (`demo`, `bench`) are not part of this distribution: the repository's
development package (`moonlease-dev`) adds them through the `moonlease.commands` entry-point
group, so this module never imports it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any


def _cmd_crd(args: argparse.Namespace) -> int:
    from moonlease_operator.crd import render_crd_yaml

    sys.stdout.write(render_crd_yaml())
    return 0


def _cmd_operator(args: argparse.Namespace) -> int:
    from moonlease_operator.adapters.logs import configure_logging
    from moonlease_operator.options import OperatorOptions
    from moonlease_operator.runner import run_operator

    try:
        options = OperatorOptions(reconcile_interval=args.reconcile_interval, resync_interval=args.resync_interval,
                                  listed_targets=args.listed_targets, conflict_reverts=args.conflict_reverts,
                                  conflict_backoff=args.conflict_backoff,
                                  prometheus_url_allowlist=_prometheus_allowlist(args))
    except ValueError as error:  # a bad flag stops start-up, naming the flag (exit 2, as argparse does)
        args.parser.error(str(error))
    configure_logging(args.log_format, args.log_level)
    run_operator(namespaces=args.namespace, all_namespaces=args.all_namespaces,
                 standalone=args.standalone, peering=args.peering, liveness_endpoint=args.liveness,
                 metrics_port=args.metrics_port, options=options)
    return 0


def _add_log_flags(parser: argparse.ArgumentParser) -> None:
    """--log-format and --log-level (the choices are moonlease_operator.adapters.logs')."""
    parser.add_argument("--log-format", choices=("text", "json"), default="text",
                        help="text (default; lines about a policy start with [namespace/name]) or json (one "
                             "object per line; lines about a policy carry namespace and policy)")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                        help="least severe level logged (default info)")


def _drive(args: argparse.Namespace, work: Callable[..., Any]) -> int:
    """Log in as kubectl does, run one `moonlease.drive` command with the operator's API client;
    a failure to read or write the cluster is one line on stderr and exit code 3."""
    import asyncio

    from moonlease.drive import EXIT_UNREADABLE, CommandError, login, with_client

    try:
        connection, default_namespace = login(args.kubeconfig, args.context)
        namespace = args.namespace or default_namespace
        return asyncio.run(with_client(connection, lambda client: work(client, namespace)))
    except CommandError as exc:
        sys.stderr.write(f"moonlease {args.command}: {exc}\n")
        return EXIT_UNREADABLE
    except KeyboardInterrupt:
        return 130


def _cmd_status(args: argparse.Namespace) -> int:
    """One screen about a policy; exit 0 when Ready, 2 when it waits for a person, 1 otherwise
    (still working, or failed), 3 when it cannot be read."""
    from moonlease.drive import show_status, watch_status

    if args.watch:
        return _drive(args, lambda client, ns: watch_status(client, ns, args.name, output=args.output,
                                                            targets=args.targets, interval=args.interval,
                                                            count=args.count, out=sys.stdout))
    return _drive(args, lambda client, ns: show_status(client, ns, args.name, output=args.output,
                                                       targets=args.targets, out=sys.stdout))


def _cmd_plan(args: argparse.Namespace) -> int:
    """Dry run: 0 nothing would change, 2 workloads would change, 4 refused, 3 unreadable."""
    import datetime

    from moonlease.drive import EXIT_UNREADABLE, CommandError, read_policy_file, show_plan

    try:
        policy = read_policy_file(args.filename)
    except CommandError as exc:
        sys.stderr.write(f"moonlease plan: {exc}\n")
        return EXIT_UNREADABLE
    if args.namespace is None:
        args.namespace = (policy.get("metadata") or {}).get("namespace")
    now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    return _drive(args, lambda client, ns: show_plan(client, policy, ns, output=args.output, now=now,
                                                     out=sys.stdout))


def _cmd_verb(args: argparse.Namespace) -> int:
    """A verb: 0 applied, 4 ignored (the message says why), 5 no answer within --timeout, 3 unreadable."""
    from moonlease.drive import give_verb
    from moonlease_operator.api import Verb

    verb = Verb(args.command)
    return _drive(args, lambda client, ns: give_verb(client, ns, args.name, verb, output=args.output,
                                                     wait=not args.no_wait, timeout=args.timeout, out=sys.stdout))


def kubectl_plugin() -> int:
    """`kubectl moonlease ...` (the `kubectl-moonlease` console script): kubectl finds it on
    PATH and passes the arguments after `moonlease` through."""
    return main(sys.argv[1:])


def _prometheus_allowlist(args: argparse.Namespace) -> tuple[str, ...]:
    """--prometheus-url-allow flags, then MOONLEASE_PROMETHEUS_URL_ALLOWLIST (comma-separated)."""
    import os

    from moonlease_operator.core.url_allowlist import parse_allowlist

    return (*args.prometheus_url_allow, *parse_allowlist(os.environ.get("MOONLEASE_PROMETHEUS_URL_ALLOWLIST")))


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer no smaller than `minimum` (the CRD's own bound)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    return parse


def _version() -> str:
    """The installed distribution's version (the image's wheel, or the editable install)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("moonlease")
    except PackageNotFoundError:
        return "unknown (not installed)"


_VERB_HELP = {
    "promote": "end the A/B test now and roll the treatment's configuration out to everyone",
    "abort": "roll back what the rollout under way changed, now (the policy ends Degraded)",
    "pause": "hold the policy where it is: no stage starts or times out, no A/B measurement",
    "resume": "release a pause",
    "retry": "a Degraded policy tries its spec again (a fresh A/B test, if any)",
    "approve": "approve the master restart waiting for approval (status.pendingApproval)",
}


def _cluster_arguments(parser: argparse.ArgumentParser, *, output: bool = True) -> None:
    parser.add_argument("-n", "--namespace", default=None, help="the policy's namespace (default: the kubeconfig "
                        "context's, or the service account's in a pod)")
    parser.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config;"
                        " in a pod without one: the service account)")
    parser.add_argument("--context", default=None, help="kubeconfig context (default: the current one)")
    if output:
        parser.add_argument("-o", "--output", choices=("text", "json"), default="text", help="text (default) or json")


def _add_drive_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """status, plan and the verbs (also `kubectl moonlease ...`)."""
    status = commands.add_parser("status", help="one screen about a MooncakeLeasePolicy (also `kubectl moonlease status`)")
    status.add_argument("name", help="the policy's name")
    _cluster_arguments(status)
    status.add_argument("--targets", action="store_true",
                        help="also each target as its workload's own labels and annotations tell it")
    status.add_argument("-w", "--watch", action="store_true", help="refresh until Ctrl-C (json: one object a line)")
    status.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes with --watch (default 2)")
    status.add_argument("--count", type=at_least(1), default=None, help="with --watch: stop after this many screens")
    status.set_defaults(func=_cmd_status)

    plan = commands.add_parser("plan", help="dry run of a policy file against the live cluster, through the "
                               "operator's own planner: which workloads change, how, which restart, what is refused")
    plan.add_argument("-f", "--filename", required=True, help="YAML file holding one MooncakeLeasePolicy (- for stdin)")
    _cluster_arguments(plan)
    plan.set_defaults(func=_cmd_plan)

    for verb, help_text in _VERB_HELP.items():
        parser = commands.add_parser(verb, help=help_text)
        parser.add_argument("name", help="the policy's name")
        _cluster_arguments(parser)
        parser.add_argument("--timeout", type=float, default=30.0,
                            help="seconds to wait for the operator's answer (default 30)")
        parser.add_argument("--no-wait", action="store_true", help="write the annotation and return")
        parser.set_defaults(func=_cmd_verb)


#: Entry-point group of subcommand plugins: each names a `register(commands)` function that adds
#: its subparsers to the `moonlease` command's (the development package's demo and bench).
PLUGIN_GROUP = "moonlease.commands"
#: Commands only the development package provides, named in the hint when it is not installed.
DEVELOPMENT_COMMANDS = ("demo", "bench")

Register = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]


def installed_plugins() -> tuple[list[Register], list[str]]:
    """The registration functions of the installed `moonlease.commands` entry points, and one
    line per plugin that could not be loaded (kept for the hint, not printed: a plugin's missing
    dependency must not break the product commands)."""
    from importlib.metadata import entry_points

    loaded: list[Register] = []
    failures: list[str] = []
    for point in entry_points(group=PLUGIN_GROUP):
        try:
            loaded.append(point.load())
        except Exception as exc:  # noqa: BLE001 - any failure of a plugin leaves the product CLI working
            failures.append(f"{point.name} ({point.value}): {type(exc).__name__}: {exc}")
    return loaded, failures


def build_parser(plugins: Sequence[Register] = ()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moonlease",
        description="Lease policies for vLLM's Mooncake KV store, rolled out across a fleet.")
    parser.add_argument("--version", action="version", version=f"moonlease {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    # The operator's one command line: the image, the chart, the docs and the tests run it. Its
    # defaults are OperatorOptions' (tests/unit/test_operator_options.py holds them together).
    operator = commands.add_parser("operator", help="run the MooncakeLeasePolicy operator")
    operator.add_argument("--namespace", "-n", action="append", default=[],
                          help="namespace to watch (repeatable); default: all namespaces")
    operator.add_argument("--all-namespaces", "-A", action="store_true",
                          help="watch every namespace (the default when no -n is given)")
    operator.add_argument("--standalone", action="store_true",
                          help="no peering: run as the only operator instance")
    operator.add_argument("--peering", metavar="NAME", default=None,
                          help="kopf peering object (KopfPeering / ClusterKopfPeering) shared by the operator's"
                               " replicas: one acts at a time, the others wait (leader election)")
    operator.add_argument("--liveness", default="http://0.0.0.0:8080/healthz",
                          help="liveness endpoint URL (default http://0.0.0.0:8080/healthz)")
    operator.add_argument("--metrics-port", type=int, default=9090,
                          help="Prometheus metrics port (default 9090)")
    operator.add_argument("--reconcile-interval", type=float, default=5.0,
                          help="seconds between reconciles of a policy while a stage is verified (default 5)")
    operator.add_argument("--resync-interval", type=float, default=300.0,
                          help="seconds between two safety-net reconciles of a policy at rest, from the watch"
                               " caches (default 300); changes wake a policy at once")
    operator.add_argument("--listed-targets", type=int, default=20,
                          help="workloads that need attention a policy's status lists (default 20; all are counted)")
    operator.add_argument("--conflict-reverts", type=int, default=3,
                          help="reverts in a row of a field the operator wrote, by another writer (e.g. a GitOps"
                               " tool), before it leaves the object alone for --conflict-backoff (default 3; 0: never)")
    operator.add_argument("--conflict-backoff", type=float, default=300.0,
                          help="seconds of the first backoff from a conflicting writer (default 300; doubling, up to"
                               " 8x)")
    operator.add_argument("--prometheus-url-allow", action="append", default=[], metavar="URL",
                          help="a Prometheus server A/B tests may read (repeatable; also "
                               "MOONLEASE_PROMETHEUS_URL_ALLOWLIST, comma-separated); default: none")
    _add_log_flags(operator)
    operator.set_defaults(func=_cmd_operator, parser=operator)

    _add_drive_parsers(commands)

    crd = commands.add_parser("crd", help="print the MooncakeLeasePolicy CRD (YAML)")
    crd.set_defaults(func=_cmd_crd)

    for register in plugins:
        register(commands)
    return parser


def main(argv: list[str] | None = None, plugins: Sequence[Register] | None = None) -> int:
    """Run one command; `plugins` None: the installed `moonlease.commands` entry points."""
    failures: list[str] = []
    if plugins is None:
        plugins, failures = installed_plugins()
    parser = build_parser(plugins)
    words = sys.argv[1:] if argv is None else argv
    command = next((word for word in words if not word.startswith("-")), None)
    if command in DEVELOPMENT_COMMANDS and command not in _subcommands(parser):
        sys.stderr.write(f"moonlease: {command!r} is a development command: it comes with the development "
                         "package of a repository checkout (`make setup` installs it; see docs/development.md)\n")
        for failure in failures:
            sys.stderr.write(f"moonlease: a command plugin failed to load: {failure}\n")
        return 2
    args = parser.parse_args(words)
    return int(args.func(args))


def _subcommands(parser: argparse.ArgumentParser) -> set[str]:
    """The subcommands `parser` knows (its own and its plugins')."""
    return {name for action in parser._actions if isinstance(action, argparse._SubParsersAction)
            for name in action.choices}


if __name__ == "__main__":
    sys.exit(main())
