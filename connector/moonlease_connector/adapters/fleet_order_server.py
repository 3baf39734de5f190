"""The fleet order service: one recency order for every engine of a Mooncake store, over HTTP.

I/O adapter (the standard library's threading HTTP server; no vLLM, no Mooncake): the rules are
`core.fleet_order`'s, applied under one lock in the order requests arrive. Run one per master
(`python -m moonlease_connector.fleet_order`, the chart's ``fleetOrder``); engines name it with
``mooncake_fleet_order_url``.

- ``POST /v1/ops``: a batch of operations (`core.fleet_order.OperationsRequest`), answered with
  one result each; a malformed body gets 400 and a message saying what is wrong.
- ``GET /healthz``: 200 while serving.
- ``GET /metrics``: `moonlease_fleet_order_keys` (keys ordered), `..._shared_keys`,
  `..._operations_total{op}`, `..._keys_taken_total` (handed out for removal),
  `..._keys_kept_total` (given back: a removal the master refused) and
  `..._rejected_requests_total`.

The order lives in memory: a restart forgets it, and the engines' evict then finds nothing to
take (the master's own eviction runs, as without evict) until their saves have told it again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from pydantic import ValidationError

from moonlease_connector.core.fleet_order import (
    Keep,
    OperationsRequest,
    OperationsResponse,
    Take,
    apply_operation,
)
from moonlease_connector.core.store_room import DEFAULT_CAPACITY, RecencyOrder

logger = logging.getLogger("moonlease.fleet_order")

#: Largest request body accepted (a batch of long prompts' keys).
MAX_BODY_BYTES = 256 << 20
DEFAULT_PORT = 8790


class FleetOrder:
    """The fleet's order and its metrics; `apply` is safe from any thread."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.order = RecencyOrder(capacity)
        self._lock = threading.Lock()
        self.registry = CollectorRegistry()
        self._keys = Gauge("moonlease_fleet_order_keys", "Keys in the fleet's recency order",
                           registry=self.registry)
        self._shared = Gauge("moonlease_fleet_order_shared_keys",
                             "Keys of the order marked as a shared prefix (never handed out for removal)",
                             registry=self.registry)
        self._operations = Counter("moonlease_fleet_order_operations", "Operations applied, by kind",
                                   ["op"], registry=self.registry)
        self._taken = Counter("moonlease_fleet_order_keys_taken", "Keys handed to engines to remove",
                              registry=self.registry)
        self._kept = Counter("moonlease_fleet_order_keys_kept",
                             "Keys given back after the master refused their removal (under lease)",
                             registry=self.registry)
        self.rejected = Counter("moonlease_fleet_order_rejected_requests",
                                "Requests refused as malformed (400)", registry=self.registry)

    def apply(self, request: OperationsRequest) -> OperationsResponse:
        with self._lock:
            results = [apply_operation(self.order, operation) for operation in request.ops]
            self._keys.set(len(self.order))
            self._shared.set(self.order.shared_count)
        for operation, result in zip(request.ops, results, strict=True):
            self._operations.labels(operation.op).inc()
            if isinstance(operation, Take):
                self._taken.inc(len(result.taken or ()))
            elif isinstance(operation, Keep):
                self._kept.inc(len(operation.taken))
        return OperationsResponse(results=results)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: each engine holds one connection
    disable_nagle_algorithm = True  # headers and body leave at once (no 40-ms delayed-ACK wait)
    server: FleetOrderServer

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path == "/healthz":
            self._send(HTTPStatus.OK, b"ok\n", "text/plain")
        elif self.path == "/metrics":
            self._send(HTTPStatus.OK, generate_latest(self.server.fleet_order.registry), CONTENT_TYPE_LATEST)
        else:
            self._send(HTTPStatus.NOT_FOUND, b"not found: GET /healthz, GET /metrics, POST /v1/ops\n",
                       "text/plain")

    def do_POST(self) -> None:  # noqa: N802
        if self.path != "/v1/ops":
            self._send(HTTPStatus.NOT_FOUND, b"not found: POST /v1/ops\n", "text/plain")
            return
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            self._reject(f"body of {length} bytes is over the {MAX_BODY_BYTES}-byte limit", drain=False)
            return
        body = self.rfile.read(length)
        try:
            request = OperationsRequest.model_validate_json(body)
        except ValidationError as error:
            self._reject(str(error))  # nothing of the batch applied
            return
        response = self.server.fleet_order.apply(request)
        self._send(HTTPStatus.OK, response.model_dump_json(exclude_none=True).encode(), "application/json")

    def _reject(self, why: str, *, drain: bool = True) -> None:
        self.server.fleet_order.rejected.inc()
        if not drain:
            self.close_connection = True
        self._send(HTTPStatus.BAD_REQUEST, json.dumps({"error": why}).encode(), "application/json")

    def _send(self, status: HTTPStatus, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
        logger.debug("%s " + format, self.address_string(), *args)


class FleetOrderServer(ThreadingHTTPServer):
    """Serves one `FleetOrder` on (`host`, `port`); `port` 0 picks a free one (`.port`)."""

    daemon_threads = True

    def __init__(self, host: str = "0.0.0.0", port: int = DEFAULT_PORT, *,  # noqa: S104 (a Service's pod)
                 capacity: int = DEFAULT_CAPACITY) -> None:
        self.fleet_order = FleetOrder(capacity)
        super().__init__((host, port), _Handler)
        self._thread: threading.Thread | None = None
        #: Open client connections (kept alive): `close` ends them, as a process exit would.
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()

    def get_request(self) -> tuple[socket.socket, Any]:
        connection, address = super().get_request()
        with self._connections_lock:
            self._connections.add(connection)
        return connection, address

    def shutdown_request(self, request: Any) -> None:
        with self._connections_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    @property
    def url(self) -> str:
        host = self.server_address[0]
        return f"http://{host.decode() if isinstance(host, bytes) else host}:{self.port}"

    def start(self) -> FleetOrderServer:
        """Serve on a daemon thread (tests, the replay benchmark); `close` stops it."""
        self._thread = threading.Thread(target=self.serve_forever, name="fleet-order", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop accepting and end every open connection (a handler thread would otherwise go on
        answering a kept-alive client from an order nobody else sees)."""
        if self._thread is not None:
            self.shutdown()
        self.server_close()
        with self._connections_lock:
            connections, self._connections = self._connections, set()
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=5)
