"""A small asynchronous Kubernetes API client on aiohttp, logged in as kopf is. Not pure.

Why not the `kubernetes` package: it is synchronous (a thread per call inside kopf's loop) and
its pydantic models refuse partial objects. kopf's own API helpers are private. This client
speaks plain JSON over the same `kopf.ConnectionInfo` that kopf's login produced (server, CA,
client certificate, token), or over a `ClusterConnection` with the same fields (the command line's
login: `moonlease status` needs no kopf, which only the operator installs), so it works against a real cluster and against the local API
server alike, where every request it makes is recorded (`LocalApiServer.api_calls()`) under the
User-Agent `moonlease-operator/<version>`.

Retries: 429 and 5xx answers and connection errors are retried with exponential backoff, a
few times, then raised as `ApiError`. A 409 is never retried here: the caller re-reads the object
and decides again (see `adapters.workloads.apply_change`).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import dataclasses
import importlib.metadata
import json
import os
import ssl
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import aiohttp

from moonlease_operator.core.conflicts import FIELD_MANAGER

try:
    _VERSION = importlib.metadata.version("moonlease")
except importlib.metadata.PackageNotFoundError:  # running from a source tree
    _VERSION = "dev"
USER_AGENT = f"moonlease-operator/{_VERSION}"
RETRIABLE = frozenset({429, 500, 502, 503, 504})
LIST_PAGE_SIZE = 500  # items per LIST page: a 5,000-workload namespace arrives in 10 answers, not one


@dataclasses.dataclass(frozen=True)
class ClusterConnection:
    """Where and how to reach an API server: the fields of `kopf.ConnectionInfo` this client
    reads, for programs that log in without kopf (the `moonlease` command line)."""

    server: str
    ca_path: str | None = None
    ca_data: str | bytes | None = None
    insecure: bool = False
    username: str | None = None
    password: str | None = None
    scheme: str | None = None  # e.g. Bearer
    token: str | None = None
    certificate_path: str | None = None
    certificate_data: str | bytes | None = None
    private_key_path: str | None = None
    private_key_data: str | bytes | None = None
    default_namespace: str | None = None

    def as_http_headers(self) -> dict[str, str]:
        """The Authorization header, as kopf builds it: basic auth, else scheme and token."""
        if self.username and self.password:
            return {"Authorization": aiohttp.BasicAuth(self.username, self.password).encode()}
        if self.token:
            return {"Authorization": f"{self.scheme or 'Bearer'} {self.token}"}
        return {"Authorization": self.scheme} if self.scheme else {}


class ApiError(Exception):
    """A Kubernetes API error answer (or a transport failure, with status 0)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message

    @property
    def conflict(self) -> bool:
        return self.status == 409

    @property
    def not_found(self) -> bool:
        return self.status == 404


class KubeClient:
    """JSON requests to one API server. Create it inside the loop that uses it; `close()` it."""

    def __init__(self, connection: Any, *, user_agent: str = USER_AGENT, retries: int = 4,
                 backoff: float = 0.1, timeout: float = 30.0,
                 on_retry: Callable[[str, int], None] | None = None) -> None:
        self.server = str(connection.server).rstrip("/")
        self.retries, self.backoff, self.on_retry = retries, backoff, on_retry
        self._tempfiles: list[str] = []
        headers = {"User-Agent": user_agent, "Accept": "application/json"}
        headers.update(connection.as_http_headers())
        self._session = aiohttp.ClientSession(
            headers=headers, timeout=aiohttp.ClientTimeout(total=timeout),
            connector=aiohttp.TCPConnector(ssl=self._ssl(connection), limit=32),
            trust_env=bool(getattr(connection, "trust_env", False)),
        )
        self.default_namespace = getattr(connection, "default_namespace", None)

    def _ssl(self, info: Any) -> ssl.SSLContext | bool:
        if not self.server.startswith("https"):
            return True
        if info.insecure:
            return False
        cadata = info.ca_data.decode() if isinstance(info.ca_data, bytes) else info.ca_data
        context = ssl.create_default_context(cafile=os.fspath(info.ca_path) if info.ca_path else None, cadata=cadata)
        cert = self._file(info.certificate_path, info.certificate_data)
        key = self._file(info.private_key_path, info.private_key_data)
        if cert is not None:
            context.load_cert_chain(cert, key)
        return context

    def _file(self, path: Any, data: str | bytes | None) -> str | None:
        if path:
            return os.fspath(path)
        if not data:
            return None
        handle, name = tempfile.mkstemp(prefix="moonlease-", suffix=".pem")
        with os.fdopen(handle, "wb") as out:
            out.write(data if isinstance(data, bytes) else data.encode())
        self._tempfiles.append(name)
        return name

    async def close(self) -> None:
        await self._session.close()
        for name in self._tempfiles:
            with contextlib.suppress(OSError):
                os.unlink(name)

    async def request(self, method: str, path: str, *, params: Mapping[str, str] | None = None,
                      body: Any = None, content_type: str = "application/json") -> Any:
        """One request, retried on 429/5xx/transport errors; the decoded JSON answer."""
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        for attempt in range(self.retries + 1):
            try:
                async with self._session.request(method, self.server + path, params=params, data=data,
                                                 headers=headers) as rsp:
                    text = await rsp.text()
                    if rsp.status < 400:
                        return json.loads(text) if text else None
                    error = _api_error(rsp.status, text)
            except (TimeoutError, aiohttp.ClientConnectionError) as exc:
                error = ApiError(0, "Unreachable", str(exc) or type(exc).__name__)
            if error.status not in RETRIABLE and error.status != 0:
                raise error
            if attempt == self.retries:
                raise error
            if self.on_retry is not None:
                self.on_retry(method, error.status)
            await asyncio.sleep(self.backoff * (2 ** attempt))
        raise AssertionError("unreachable")

    async def get(self, path: str) -> Any:
        return await self.request("GET", path)

    async def list(self, path: str, *, label_selector: str | None = None,
                   page_size: int = LIST_PAGE_SIZE) -> list[dict[str, Any]]:
        """Every item, read in pages of `page_size` (`limit`/`continue`)."""
        items, _ = await self.list_with_version(path, label_selector=label_selector, page_size=page_size)
        return items

    async def list_with_version(self, path: str, *, label_selector: str | None = None, page_size: int = LIST_PAGE_SIZE,
                                keep: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
                                ) -> tuple[builtins.list[dict[str, Any]], str | None]:
        """Every item, paginated, and the list's resourceVersion (where a watch resumes from).
        `keep`: what to keep of each item, applied page by page (so that a large listing is
        never held whole: the caches keep a trimmed copy)."""
        items: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            params = {"limit": str(page_size)}
            if label_selector:
                params["labelSelector"] = label_selector
            if token:
                params["continue"] = token
            answer = await self.request("GET", path, params=params) or {}
            meta = answer.get("metadata") or {}
            page = answer.get("items") or []
            items.extend(page if keep is None else map(keep, page))
            del page, answer  # the page as decoded: freed before the next one arrives
            token = meta.get("continue") or None
            if token is None:
                return items, meta.get("resourceVersion")

    async def watch(self, path: str, params: Mapping[str, str], *, read_timeout: float) -> AsyncIterator[dict[str, Any]]:
        """The events of one watch stream (`?watch=true`), decoded, until the server ends it.
        An error answer raises `ApiError`; an `ERROR` event (410 Gone) is yielded as it came."""
        query = {**params, "watch": "true"}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=read_timeout)
        try:
            async with self._session.get(self.server + path, params=query, timeout=timeout) as rsp:
                if rsp.status >= 400:
                    raise _api_error(rsp.status, await rsp.text())
                pending = b""
                async for chunk in rsp.content.iter_any():  # lines may be longer than aiohttp's readline limit
                    pending += chunk
                    *lines, pending = pending.split(b"\n")
                    for line in lines:
                        if line.strip():
                            yield json.loads(line)
                if pending.strip():
                    yield json.loads(pending)
        except (TimeoutError, aiohttp.ClientConnectionError) as exc:
            raise ApiError(0, "Unreachable", str(exc) or type(exc).__name__) from exc

    # Every write names the operator's field manager, so that `metadata.managedFields` tells
    # its writes from another writer's (`core.conflicts.last_writer`).

    async def merge_patch(self, path: str, patch: Mapping[str, Any]) -> Any:
        return await self.request("PATCH", path, params=_WRITER, body=patch,
                                  content_type="application/merge-patch+json")

    async def strategic_merge_patch(self, path: str, patch: Mapping[str, Any]) -> Any:
        """A strategic merge patch (built-in kinds only: Deployments, StatefulSets, ...)."""
        return await self.request("PATCH", path, params=_WRITER, body=patch,
                                  content_type="application/strategic-merge-patch+json")

    async def create(self, path: str, body: Mapping[str, Any]) -> Any:
        return await self.request("POST", path, params=_WRITER, body=body)


_WRITER = {"fieldManager": FIELD_MANAGER}


def _api_error(status: int, text: str) -> ApiError:
    try:
        payload = json.loads(text)
    except ValueError:
        payload = {}
    if not isinstance(payload, dict):
        payload = {}
    return ApiError(status, str(payload.get("reason") or "Error"), str(payload.get("message") or text[:200]))
