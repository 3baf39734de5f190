"""`python -m moonlease_operator`: the operator with kopf's usual login (in-cluster service
account or the current kubeconfig). Same as `moonlease operator`."""

from __future__ import annotations

import argparse
import os

from moonlease_operator.adapters.logs import LOG_FORMATS, LOG_LEVELS, configure_logging
from moonlease_operator.core.url_allowlist import parse_allowlist
from moonlease_operator.options import OperatorOptions
from moonlease_operator.runner import run_operator


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m moonlease_operator", description=__doc__)
    parser.add_argument("-n", "--namespace", action="append", default=[],
                        help="watch only this namespace (repeatable; default: all namespaces)")
    parser.add_argument("--standalone", action="store_true", help="no peering: the only replica")
    parser.add_argument("--peering", metavar="NAME", default=None,
                        help="kopf peering object shared by the replicas: one acts at a time")
    parser.add_argument("--liveness", metavar="URL", default=None,
                        help="serve a liveness probe, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics")
    parser.add_argument("--reconcile-interval", type=float, default=OperatorOptions.reconcile_interval,
                        help="seconds between reconciles of a policy while a stage is verified")
    parser.add_argument("--resync-interval", type=float, default=OperatorOptions.resync_interval,
                        help="seconds between two safety-net reconciles of a policy at rest (from the watch caches)")
    parser.add_argument("--listed-targets", type=int, default=OperatorOptions.listed_targets,
                        help="workloads that need attention a policy's status lists (all are counted)")
    parser.add_argument("--conflict-reverts", type=int, default=OperatorOptions.conflict_reverts,
                        help="reverts in a row by another writer (e.g. a GitOps tool) before the operator leaves"
                             " the object alone for --conflict-backoff (0: never)")
    parser.add_argument("--conflict-backoff", type=float, default=OperatorOptions.conflict_backoff,
                        help="seconds of the first backoff from a conflicting writer (doubling, up to 8x)")
    parser.add_argument("--prometheus-url-allow", action="append", default=[], metavar="URL",
                        help="a Prometheus server A/B tests may read (repeatable; also "
                             "MOONLEASE_PROMETHEUS_URL_ALLOWLIST, comma-separated); default: none")
    parser.add_argument("--benchmark-polling", action="store_true", help=argparse.SUPPRESS)  # OperatorOptions.polling
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                        help="text (lines about a policy start with [namespace/name]) or json (one object "
                             "per line, with namespace and policy)")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="least severe level logged")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging (--log-level debug)")
    args = parser.parse_args(argv)
    configure_logging(args.log_format, "debug" if args.verbose else args.log_level)
    try:
        options = OperatorOptions(
            reconcile_interval=args.reconcile_interval, resync_interval=args.resync_interval,
            listed_targets=args.listed_targets, polling=args.benchmark_polling,
            conflict_reverts=args.conflict_reverts, conflict_backoff=args.conflict_backoff,
            prometheus_url_allowlist=(*args.prometheus_url_allow, *parse_allowlist(
                os.environ.get("MOONLEASE_PROMETHEUS_URL_ALLOWLIST"))))
    except ValueError as error:
        parser.error(str(error))
    run_operator(namespaces=args.namespace, standalone=args.standalone, peering=args.peering,
                 liveness_endpoint=args.liveness, metrics_port=args.metrics_port, options=options)


if __name__ == "__main__":
    main()
