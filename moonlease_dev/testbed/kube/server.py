"""The façade tests and the demo hold: the emulator with its HTTP server and simulator, in the
caller's event loop (`local_api_server`) or a thread of its own (`LocalApiServerThread`)."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp.test_utils
import aiohttp.web
import aiohttp.web_request
import aiohttp.web_server
import kmock
import yaml

from moonlease_dev.testbed.kube.calls import ApiCall, Traffic
from moonlease_dev.testbed.kube.emulator import ApiServerEmulator
from moonlease_dev.testbed.kube.faults import InjectedFault
from moonlease_dev.testbed.kube.manifests import namespace_manifest
from moonlease_dev.testbed.kube.resources import EVENTS
from moonlease_dev.testbed.kube.simulator import RolloutSimulator
from moonlease_dev.testbed.kube.validation import MAX_REQUEST_BODY_BYTES
from moonlease_dev.testbed.kube.watches import DEFAULT_WATCH_HISTORY

JsonObj = dict[str, Any]


class _LenientHttpServer(aiohttp.web_server.Server):
    """aiohttp's low-level server with a body limit far above the API server's, so that the
    emulator decides what is too large (413 with a Status body), not aiohttp (1 MiB, plain text)."""

    body_limit = 4 * MAX_REQUEST_BODY_BYTES

    def _make_request(self, message: Any, payload: Any, protocol: Any, writer: Any,
                      task: Any) -> aiohttp.web_request.BaseRequest:
        return aiohttp.web_request.BaseRequest(message, payload, protocol, writer, task, self._loop,
                                               client_max_size=self.body_limit)


class _HttpServer(aiohttp.test_utils.RawTestServer):
    async def _make_runner(self, debug: bool = True, **kwargs: Any) -> aiohttp.web.ServerRunner:
        return aiohttp.web.ServerRunner(_LenientHttpServer(self._handler, loop=self._loop, debug=debug, **kwargs),
                                        debug=debug, **kwargs)


class LocalApiServer:
    """A running emulator with its HTTP server: the object tests and the demo hold.

    The CRUD helpers act like an admin's kubectl: they go through the same write path as HTTP
    (validation, resourceVersion, watch events) but are not recorded as API calls, so
    `api_calls()` shows only what real clients (kopf, the operator) asked for.
    """

    def __init__(self, emulator: ApiServerEmulator, server: kmock.Server, simulator: RolloutSimulator) -> None:
        self.emulator = emulator
        self.server = server
        self.simulator = simulator

    @property
    def url(self) -> str:
        return str(self.server.url).rstrip("/")

    # ---- connection configs ---------------------------------------------------------------------

    def connection_info(self, *, default_namespace: str = "default") -> Any:
        """A `kopf.ConnectionInfo` for this server (plain HTTP, no credentials)."""
        import kopf

        return kopf.ConnectionInfo(server=self.url, insecure=True, default_namespace=default_namespace)

    def kubernetes_configuration(self) -> Any:
        """A `kubernetes.client.Configuration` pointing at this server."""
        import kubernetes.client

        config = kubernetes.client.Configuration(host=self.url)
        config.verify_ssl = False
        return config

    def kubeconfig(self, *, namespace: str = "default") -> JsonObj:
        """A kubeconfig document for kubectl or `kubernetes.config.load_kube_config`."""
        return {
            "apiVersion": "v1", "kind": "Config", "current-context": "moonlease-local",
            "clusters": [{"name": "moonlease-local", "cluster": {"server": self.url}}],
            "users": [{"name": "moonlease-local", "user": {}}],
            "contexts": [{"name": "moonlease-local",
                          "context": {"cluster": "moonlease-local", "user": "moonlease-local",
                                      "namespace": namespace}}],
        }

    def write_kubeconfig(self, path: str | Path, *, namespace: str = "default") -> Path:
        target = Path(path)
        target.write_text(yaml.safe_dump(self.kubeconfig(namespace=namespace)), encoding="utf-8")
        return target

    # ---- objects --------------------------------------------------------------------------------

    async def create(self, body: Mapping[str, Any], *, namespace: str | None = None) -> JsonObj:
        return await self.emulator.create_object(None, body, namespace=namespace)

    async def apply_yaml(self, text: str, *, namespace: str | None = None) -> list[JsonObj]:
        """Create every document of a YAML stream (like `kubectl create -f`)."""
        return [await self.create(doc, namespace=namespace) for doc in yaml.safe_load_all(text) if doc]

    def get(self, what: Any, namespace: str | None, name: str) -> JsonObj | None:
        return self.emulator.read_object(what, namespace, name)

    def list(self, what: Any, namespace: str | None = None, *, label_selector: str | None = None) -> list[JsonObj]:
        return self.emulator.list_objects(what, namespace, label_selector=label_selector)

    async def patch(self, what: Any, namespace: str | None, name: str, patch: Any, *,
                    patch_type: str = "merge", subresource: str | None = None) -> JsonObj:
        return await self.emulator.patch_object(what, namespace, name, patch, patch_type=patch_type,
                                                subresource=subresource)

    async def delete(self, what: Any, namespace: str | None, name: str) -> JsonObj:
        return await self.emulator.delete_object(what, namespace, name)

    def history(self, what: Any, namespace: str | None, name: str) -> builtins.list[JsonObj | None]:
        return self.emulator.history(what, namespace, name)

    def events(self, namespace: str | None = None, *, involved_name: str | None = None,
               reason: str | None = None) -> builtins.list[JsonObj]:
        """Events, optionally only those about one object or with one reason."""
        found = self.emulator.list_objects(EVENTS, namespace)
        return [e for e in found
                if (involved_name is None or e.get("involvedObject", {}).get("name") == involved_name)
                and (reason is None or e.get("reason") == reason)]

    def api_calls(self, since: int = 0) -> builtins.list[ApiCall]:
        """The requests real clients made, oldest first (after the first `since`)."""
        return self.emulator.api_calls(since)

    @property
    def traffic(self) -> Traffic:
        """Requests and response bytes served so far, per verb and resource."""
        return self.emulator.traffic

    def compact(self, revision: int | None = None) -> None:
        """See `ApiServerEmulator.compact`: older watches and continue tokens get 410 Gone."""
        self.emulator.compact(revision)

    def close_watches(self, what: Any = None) -> int:
        """See `ApiServerEmulator.close_watches`: open watch streams end; clients resume."""
        return self.emulator.close_watches(what)

    def inject_failures(self, what: Any, namespace: str | None = None, name: str | None = None, *,
                        status: int = 409, count: int = 1, verbs: Iterable[str] = ("patch", "update"),
                        subresource: str | None = "*") -> InjectedFault:
        """See `ApiServerEmulator.inject_failures`: the next `count` matching HTTP requests fail."""
        return self.emulator.inject_failures(what, namespace, name, status=status, count=count, verbs=verbs,
                                             subresource=subresource)

    # ---- waiting --------------------------------------------------------------------------------

    async def wait_for(self, check: Callable[[], Any | Awaitable[Any]], *, timeout: float = 5.0,
                       interval: float = 0.02, what: str = "condition",
                       describe: Callable[[], str] | None = None) -> Any:
        """Poll `check` (sync or async) until it returns something truthy; returns that value.
        `describe` says, in the timeout's message, what was there instead (a failure then
        explains itself where it cannot be reproduced)."""
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if asyncio.iscoroutine(value) or isinstance(value, Awaitable):
                value = await value
            if value:
                return value
            if time.monotonic() >= deadline:
                found = f"; found {describe()}" if describe is not None else ""
                raise TimeoutError(f"timed out after {timeout}s waiting for {what}{found}")
            await asyncio.sleep(interval)


def default_crds() -> list[JsonObj]:
    """The project's CRDs, built from the models (imported lazily: the testbed must not need the
    operator package unless CRDs are wanted)."""
    from moonlease_operator.crd import build_crd

    return [build_crd()]


@contextlib.asynccontextmanager
async def local_api_server(*, crds: Sequence[Mapping[str, Any]] | None = None,
                           namespaces: Sequence[str] = ("default",), simulate: bool = True,
                           tick_interval: float = 0.05, host: str = "127.0.0.1",
                           port: int | None = None, watch_history: int = DEFAULT_WATCH_HISTORY,
                           bookmark_interval: float = 60.0,
                           pod_ip: str = "127.0.0.1") -> AsyncIterator[LocalApiServer]:
    """Start the emulator on a free port (or `port`) with the backbone resources, `namespaces`,
    the CRDs (default: MooncakeLeasePolicy) and, if `simulate`, a ticking RolloutSimulator.

    `watch_history` (changes per resource type a watch can resume from) and `bookmark_interval`
    (seconds between BOOKMARK events) tune the watch semantics; see `ApiServerEmulator`.
    `pod_ip` is every simulated pod's address (the pods' servers listen there).
    Runs in the current event loop; clients in other threads (kopf's runner) reach it over HTTP.
    """
    crds = default_crds() if crds is None else list(crds)
    async with ApiServerEmulator(watch_history=watch_history, bookmark_interval=bookmark_interval) as emulator:
        async with kmock.Server(emulator, host=host, port=port, server_cls=_HttpServer) as server:
            api = LocalApiServer(emulator, server, RolloutSimulator(emulator, pod_ip=pod_ip))
            for ns in namespaces:
                await api.create(namespace_manifest(ns))
            for crd in crds:
                await api.create(crd)
            if simulate:
                api.simulator.start(tick_interval)
            try:
                yield api
            finally:
                await api.simulator.stop()


class LocalApiServerThread:
    """`local_api_server()` in a background thread with its own event loop, for synchronous
    programs (e.g. a demo driving subprocesses)::

        with LocalApiServerThread() as server, OperatorThread(connection=server.api.connection_info()):
            server.call(server.api.create(policy))
            server.call(server.api.wait_for(lambda: ...))

    Run writes and waits through `call` (they execute in the server's loop); `api.get`/`api.list`
    return deep copies and are safe to call from any thread.
    """

    def __init__(self, *, startup_timeout: float = 10.0, **server_options: Any) -> None:
        self.server_options = server_options
        self.startup_timeout = startup_timeout
        self._api: LocalApiServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @property
    def api(self) -> LocalApiServer:
        if self._api is None:
            raise RuntimeError("the server is not running")
        return self._api

    def start(self) -> LocalApiServer:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="local-api-server",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(self.startup_timeout) or self._api is None:
            raise RuntimeError("the local API server did not start") from self._error
        return self._api

    async def _main(self) -> None:
        try:
            async with local_api_server(**self.server_options) as api:
                self._loop, self._stopping, self._api = asyncio.get_running_loop(), asyncio.Event(), api
                self._ready.set()
                await self._stopping.wait()
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            self._ready.set()

    def call(self, awaitable: Awaitable[Any], *, timeout: float | None = 30.0) -> Any:
        """Run a coroutine in the server's loop and return its result."""
        if self._loop is None:
            raise RuntimeError("the server is not running")

        async def run() -> Any:
            return await awaitable

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout)

    def stop(self) -> None:
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._api = self._loop = self._stopping = None

    def __enter__(self) -> LocalApiServerThread:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
