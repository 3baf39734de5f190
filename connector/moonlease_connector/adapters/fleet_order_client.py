"""An engine's side of the fleet order service: `StoreEviction`'s order, kept by the service.

I/O adapter (HTTP, standard library). `FleetOrderClient` offers `store_room.RecencyOrder`'s four
calls — `touch`, `refresh`, `take_oldest`, `keep` — so `adapters.store_eviction.StoreEviction`
runs unchanged on the fleet's order (``mooncake_fleet_order_url``) instead of its own.

One sender thread sends what is queued, in order, batched into one ``POST /v1/ops``, over one
kept-alive connection: reports (touch, refresh, keep) return at once (a load's receive thread
never waits on the network); `take_oldest` waits for its answer at most `timeout_s`. The service
unreachable or slow costs hit rate, never a request: a take that gets no answer takes nothing
(the put goes ahead and the master evicts as without evict), reports beyond `max_queued` are
dropped oldest first, and one warning says so until the service answers again. Each trouble
is also handed to `on_trouble(kind, count)` — `failed_request`, `dropped_report`,
`unanswered_take`, `invalid_operation` (over the wire's limits, left out) — which the worker
counts as `vllm:moonlease_fleet_order_errors_total{kind}`.
"""

from __future__ import annotations

import http.client
import logging
import threading
import urllib.parse
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

from pydantic import ValidationError

from moonlease_settings.config import check_service_url
from moonlease_connector.core.fleet_order import (
    MAX_OPERATIONS_PER_REQUEST,
    Keep,
    OperationResult,
    OperationsRequest,
    OperationsResponse,
    Refresh,
    Take,
    Touch,
)

logger = logging.getLogger("vllm.moonlease.connector.fleet_order")

DEFAULT_TIMEOUT_S = 0.5
#: Reports held while the service does not answer (then the oldest are dropped).
DEFAULT_MAX_QUEUED = 4096


@dataclass
class _Pending:
    """One queued operation; `done` set once its answer (or the failure) is known."""

    operation: Touch | Refresh | Take | Keep
    waits: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    result: OperationResult | None = None


def parse_service_url(url: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, path of /v1/ops) from ``http(s)://host[:port][/prefix]``, checked as
    the connector's settings check it (ValueError saying what to write)."""
    parts = urllib.parse.urlsplit(check_service_url(url))
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.scheme, parts.hostname or "", port, parts.path.rstrip("/") + "/v1/ops"  # checked: a host


class FleetOrderClient:
    """The fleet's recency order, as `StoreEviction` uses an order; thread-safe."""

    #: Loads are reported as they happen, not at this engine's next save as per-engine evict
    #: takes them: the other engines' puts decide by them meanwhile.
    shared_by_fleet = True

    def __init__(self, url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_queued: int = DEFAULT_MAX_QUEUED,
                 on_trouble: Callable[[str, int], None] = lambda kind, count: None) -> None:
        self.url = url
        self._on_trouble = on_trouble
        self._scheme, self._host, self._port, self._path = parse_service_url(url)
        self.timeout_s = timeout_s
        self.max_queued = max_queued
        self._queue: deque[_Pending] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._connection: http.client.HTTPConnection | None = None
        self._failing = False
        self._warned_invalid = False
        self.sent_requests = 0
        self.failed_requests = 0
        self.dropped_operations = 0
        self.unanswered_takes = 0
        self._thread = threading.Thread(target=self._run, name="moonlease-fleet-order", daemon=True)
        self._thread.start()

    # ---- RecencyOrder's calls -------------------------------------------------------------------

    def touch(self, keys: Sequence[str], sizes: Sequence[int | None] | None = None,
              shared: Collection[str] | None = None) -> None:
        if keys:
            self._report(lambda: Touch(keys=list(keys), sizes=None if sizes is None else list(sizes),
                                       shared=None if shared is None else [k for k in keys if k in shared]))

    def refresh(self, keys: Sequence[str]) -> int:
        """Reported, not awaited: the count is the service's (0 here)."""
        if keys:
            self._report(lambda: Refresh(keys=list(keys)))
        return 0

    def take_oldest(self, free_bytes: int, protect: Iterable[str] = ()) -> list[tuple[str, int]]:
        take = self._valid(lambda: Take(free_bytes=max(0, int(free_bytes)), protect=list(protect)))
        if take is None:
            return []
        pending = _Pending(take, waits=True)
        with self._cond:
            self._queue.append(pending)
            self._cond.notify()
        if not pending.done.wait(self.timeout_s) or pending.result is None:
            self.unanswered_takes += 1
            self._on_trouble("unanswered_take", 1)
            return []
        return list(pending.result.taken or ())

    def keep(self, keys: Iterable[tuple[str, int]]) -> None:
        taken = list(keys)
        if taken:
            self._report(lambda: Keep(taken=taken))

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (at most `timeout_s`), then stop."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout_s)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything queued so far has been sent (tests, the replay's end)."""
        marker = _Pending(Refresh(keys=[]), waits=True)
        with self._cond:
            self._queue.append(marker)
            self._cond.notify()
        return marker.done.wait(timeout_s)

    # ---- sending --------------------------------------------------------------------------------

    def _valid(self, build: Callable[[], Touch | Refresh | Take | Keep]) -> Touch | Refresh | Take | Keep | None:
        """The operation, or None (counted, logged) when the wire cannot carry it (over its limits:
        a prompt of more than half a million keys) — a save never fails for the service."""
        try:
            return build()
        except ValidationError as error:
            self._on_trouble("invalid_operation", 1)
            if self._warned_invalid:
                return None
            self._warned_invalid = True
            logger.warning("retention evict: an operation the fleet order service cannot take is left out "
                           "(the first of any; counted as invalid_operation): %s",
                           str(error).splitlines()[0])
            return None

    def _report(self, build: Callable[[], Touch | Refresh | Keep]) -> None:
        operation = self._valid(build)
        if operation is None:
            return
        dropped_now = 0
        with self._cond:
            self._queue.append(_Pending(operation))
            while len(self._queue) > self.max_queued:
                dropped = next((p for p in self._queue if not p.waits), None)
                if dropped is None:
                    break
                self._queue.remove(dropped)
                dropped_now += 1
            self.dropped_operations += dropped_now
            self._cond.notify()
        if dropped_now:
            self._on_trouble("dropped_report", dropped_now)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue and self._closed:
                    break
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), MAX_OPERATIONS_PER_REQUEST))]
            results = self._send([p.operation for p in batch])
            for index, pending in enumerate(batch):
                pending.result = results[index] if results is not None else None
                pending.done.set()
        if self._connection is not None:
            self._connection.close()

    def _send(self, ops: list[Touch | Refresh | Take | Keep]) -> list[OperationResult] | None:
        # Each operation was validated when it was made: the request around them needs no more.
        body = OperationsRequest.model_construct(ops=ops).model_dump_json().encode()
        for attempt in range(2):  # a kept-alive connection the service closed: once more, fresh
            try:
                if self._connection is None:
                    cls = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
                    self._connection = cls(self._host, self._port, timeout=max(self.timeout_s, 1.0))
                self._connection.request("POST", self._path, body, {"Content-Type": "application/json"})
                response = self._connection.getresponse()
                payload = response.read()
                if response.status != 200:
                    raise OSError(f"HTTP {response.status}: {payload[:200].decode('utf-8', 'replace')}")
                results = OperationsResponse.model_validate_json(payload).results
                if len(results) != len(ops):
                    raise ValueError(f"{len(results)} results for {len(ops)} operations")
                self.sent_requests += 1
                if self._failing:
                    logger.warning("retention evict: the fleet order service at %s answers again", self.url)
                    self._failing = False
                return results
            except (OSError, ValueError, ValidationError, http.client.HTTPException) as error:
                if self._connection is not None:
                    self._connection.close()
                    self._connection = None
                if attempt == 0 and isinstance(error, (http.client.RemoteDisconnected, ConnectionResetError,
                                                       BrokenPipeError)):
                    continue
                self.failed_requests += 1
                self._on_trouble("failed_request", 1)
                if not self._failing:
                    logger.warning("retention evict: the fleet order service at %s does not answer (%s); "
                                   "saves go on and the master evicts as without evict until it does",
                                   self.url, error)
                    self._failing = True
                return None
        return None
