"""Starting the operator: in its own process (`run_operator`, behind `moonlease operator`, the
operator's one command line), as a coroutine in a loop of its own (`operate`), or in a
background thread of another program (`OperatorThread`, used by the tests and `moonlease demo`
against the local API server).

Not pure: this is where kopf is configured. The connection comes from kopf's usual login
(kubeconfig / in-cluster) unless a `kopf.ConnectionInfo` is given.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from collections.abc import Collection
from types import TracebackType
from typing import Any

import kopf

from moonlease_operator import handlers
from moonlease_operator.adapters.metrics import OperatorMetrics
from moonlease_operator.api import GROUP
from moonlease_operator.options import OperatorOptions

OPERATOR_NAME = "moonlease-operator"


def choose_priority() -> int:
    """A random kopf peering priority for one replica: with distinct priorities exactly one
    replica (the highest) acts and the others pause, until its keep-alive stops (a replica that
    died is presumed dead after kopf's peering lifetime) — leader election through kopf's
    peering. Equal priorities would make kopf pause every replica."""
    return random.SystemRandom().randint(1, 2**31 - 1)


def build_settings() -> kopf.OperatorSettings:
    """kopf settings: our own annotation prefix, and no kopf fields written into our status
    (the CRD's status schema is typed, so the API server would prune them anyway)."""
    settings = kopf.OperatorSettings()
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.posting.reporting_component = OPERATOR_NAME
    settings.posting.event_name_prefix = f"{OPERATOR_NAME}-"
    # The handlers post their own events (before the changes they announce); kopf posts only
    # its warnings and errors, so that handler logs do not turn into a write per reconcile.
    settings.posting.level = logging.WARNING
    return settings


def build_registry(connection: kopf.ConnectionInfo | None = None, *,
                   context: handlers.OperatorContext | None = None) -> kopf.OperatorRegistry:
    """A fresh registry with our handlers and one login: `connection` if given, otherwise kopf's
    Kubernetes-client login (in-cluster service account, else the kubeconfig). The login also
    hands the connection to the handlers' own API client (`context`)."""
    context = context or handlers.OperatorContext()
    registry = kopf.OperatorRegistry()
    handlers.register(registry, context)

    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        def fresh() -> kopf.ConnectionInfo | None:
            return connection if connection is not None else kopf.login_via_client(**kwargs)

        info = fresh()
        context.use_connection(info, relogin=fresh)
        return info

    kopf.on.login(id="login", registry=registry)(login)
    return registry


async def operate(
    *,
    connection: kopf.ConnectionInfo | None = None,
    namespaces: Collection[str] = (),
    standalone: bool = True,
    peering: str | None = None,
    priority: int | None = None,
    stop_flag: asyncio.Event | threading.Event | asyncio.Future[Any] | None = None,
    ready_flag: asyncio.Event | threading.Event | asyncio.Future[Any] | None = None,
    liveness_endpoint: str | None = None,
    clock: handlers.Clock = handlers.utc_now,
    options: OperatorOptions | None = None,
    metrics: OperatorMetrics | None = None,
) -> None:
    """Run the operator in the current loop until `stop_flag` is set (or the task is cancelled).

    Cluster-wide unless `namespaces` are given. `standalone` skips kopf's peering (one replica).
    `peering`: the name of a kopf peering object (KopfPeering in each watched namespace, or a
    ClusterKopfPeering cluster-wide) that the replicas share; peering is then mandatory (the
    operator waits for it before acting) and each replica gets `priority` (default: a random
    one, see `choose_priority`), so one acts at a time. Neither: kopf peers if a peering object
    named "default" exists. kopf cancels every task created in this loop after it started, so
    give it a loop of its own (see `OperatorThread`) when the same program serves other things.
    """
    context = handlers.OperatorContext(clock=clock, options=options, metrics=metrics, namespaces=tuple(namespaces))
    if standalone:
        peering_args: dict[str, Any] = {"standalone": True}
    elif peering is not None:
        peering_args = {"peering_name": peering, "priority": choose_priority() if priority is None else priority}
    else:
        peering_args = {"standalone": None}
    await kopf.operator(
        registry=build_registry(connection, context=context),
        settings=build_settings(),
        clusterwide=not namespaces,
        namespaces=list(namespaces),
        **peering_args,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
        liveness_endpoint=liveness_endpoint,
    )


def run_operator(
    *,
    namespaces: Collection[str] = (),
    all_namespaces: bool = False,
    standalone: bool = False,
    peering: str | None = None,
    liveness_endpoint: str | None = None,
    metrics_port: int | None = None,
    connection: kopf.ConnectionInfo | None = None,
    options: OperatorOptions | None = None,
) -> None:
    """Run the operator in this process until SIGINT/SIGTERM (what `moonlease operator` runs).

    `all_namespaces` (or no `namespaces`) watches the whole cluster. `metrics_port` serves
    Prometheus metrics: the operator's (see `adapters.metrics`) and the process collectors.
    """
    if all_namespaces and namespaces:
        raise ValueError("either namespaces or all_namespaces, not both")
    metrics = OperatorMetrics()  # on the process-wide default registry
    if metrics_port is not None:
        import prometheus_client

        prometheus_client.start_http_server(metrics_port)
    asyncio.run(operate(connection=connection, namespaces=() if all_namespaces else namespaces,
                        standalone=standalone, peering=peering, liveness_endpoint=liveness_endpoint,
                        options=options,
                        metrics=metrics))


class OperatorThread:
    """The operator in a background thread with its own event loop, stopped cleanly on exit.

    Usable as `with` from synchronous code, and as `async with` from a loop that also serves the
    API the operator talks to (start and stop then wait in a worker thread, not in the loop)::

        async with local_api_server() as kube:
            async with OperatorThread(connection=kube.connection_info()):
                ...
    """

    def __init__(self, *, connection: kopf.ConnectionInfo | None = None, namespaces: Collection[str] = (),
                 startup_timeout: float = 15.0, stop_timeout: float = 15.0,
                 clock: handlers.Clock = handlers.utc_now, options: OperatorOptions | None = None,
                 metrics: OperatorMetrics | None = None, peering: str | None = None,
                 priority: int | None = None) -> None:
        """`metrics`: where the operator counts (default: a private registry, so that several
        operators can live in one process). `peering`/`priority`: kopf peering (see `operate`);
        without `peering` the operator runs standalone."""
        import prometheus_client

        self.options = options
        self.metrics = metrics or OperatorMetrics(prometheus_client.CollectorRegistry())
        self.connection = connection
        self.namespaces = tuple(namespaces)
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.clock = clock
        self.peering, self.priority = peering, priority
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._finished = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start and wait until kopf reports ready; raises if it fails or times out."""
        if self._thread is not None:
            raise RuntimeError("an OperatorThread starts only once")
        self._thread = threading.Thread(target=self._main, name=OPERATOR_NAME, daemon=True)
        self._thread.start()
        deadline = self.startup_timeout
        while not self._ready.wait(timeout=0.05):
            deadline -= 0.05
            if self._finished.is_set():
                raise RuntimeError("the operator exited during startup") from self._error
            if deadline <= 0:
                self.stop()
                raise TimeoutError(f"the operator was not ready in {self.startup_timeout}s")

    def stop(self) -> None:
        """Ask kopf to stop, wait for the thread, and re-raise what the operator died of, if any."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.stop_timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"the operator did not stop in {self.stop_timeout}s")
        if self._error is not None:
            raise RuntimeError("the operator failed") from self._error

    def _main(self) -> None:
        try:
            asyncio.run(operate(connection=self.connection, namespaces=self.namespaces,
                                standalone=self.peering is None, peering=self.peering, priority=self.priority,
                                stop_flag=self._stop, ready_flag=self._ready, clock=self.clock,
                                options=self.options, metrics=self.metrics))
        except BaseException as exc:  # re-raised in the caller's thread by stop()
            self._error = exc
        finally:
            self._finished.set()

    def __enter__(self) -> OperatorThread:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    async def __aenter__(self) -> OperatorThread:
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await asyncio.to_thread(self.stop)
