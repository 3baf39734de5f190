"""`python -m moonlease_operator`: run the operator with kopf's usual login (in-cluster service
account or the current kubeconfig)."""

from __future__ import annotations

import argparse
import asyncio
import logging

import kopf

from moonlease_operator.runner import run_operator


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m moonlease_operator", description=__doc__)
    parser.add_argument("-n", "--namespace", action="append", default=[],
                        help="watch only this namespace (repeatable; default: all namespaces)")
    parser.add_argument("--liveness", metavar="URL", default=None,
                        help="serve a liveness probe, e.g. http://0.0.0.0:8080/healthz")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    kopf.configure(verbose=args.verbose, log_format=kopf.LogFormat.PLAIN)
    logging.getLogger("moonlease_operator").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    asyncio.run(run_operator(namespaces=args.namespace, liveness_endpoint=args.liveness))


if __name__ == "__main__":
    main()
