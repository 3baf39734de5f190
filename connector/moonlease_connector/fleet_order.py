"""Run the fleet order service: ``python -m moonlease_connector.fleet_order [--port 8790]``.

One per Mooncake master; every engine whose retention has ``evict`` on names it with
``mooncake_fleet_order_url`` (the chart's ``fleetOrder`` runs it and sets that). Imports
neither vLLM nor Mooncake: it starts in well under a second from the connector image.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence
from types import FrameType

from moonlease_connector.adapters.fleet_order_server import DEFAULT_PORT, FleetOrderServer
from moonlease_connector.core.store_room import DEFAULT_CAPACITY


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m moonlease_connector.fleet_order",
        description="One least-recently-used order of a Mooncake store's keys for every engine "
                    "(retention evict with mooncake_fleet_order_url).")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: every interface)")  # noqa: S104
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    parser.add_argument("--capacity", type=int, default=DEFAULT_CAPACITY,
                        help=f"keys remembered; the oldest beyond it are forgotten and left to the "
                             f"master's own eviction (default {DEFAULT_CAPACITY})")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 <= args.port <= 65535:
        print(f"--port {args.port}: give a port between 0 and 65535", file=sys.stderr)
        return 2
    if args.capacity < 1:
        print(f"--capacity {args.capacity}: give at least 1 key", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = FleetOrderServer(args.host, args.port, capacity=args.capacity)
    except OSError as error:
        print(f"cannot listen on {args.host}:{args.port}: {error}", file=sys.stderr)
        return 1

    def stop(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    logging.getLogger("moonlease.fleet_order").info(
        "fleet order service on %s:%d (up to %d keys); POST /v1/ops, GET /metrics, GET /healthz",
        args.host, server.port, args.capacity)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
