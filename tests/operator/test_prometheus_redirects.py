"""The operator queries only the allowlisted Prometheus URL (issue 27): a redirect from it to
another host is not followed, and the measurement fails saying where it pointed — in the metric
source, and with kopf running an A/B test against the local API server."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from moonlease_dev.testbed.kube import LocalApiServer
from moonlease_operator.adapters.metric_sources import MetricSourceError, PrometheusSource
from moonlease_operator.core.ab_samples import Arm
from moonlease_operator.runner import OperatorThread
from tests.fixtures.kube import FAST_OPTIONS
from tests.operator.fleet import condition
from tests.operator.test_ab_operator import ab_policy, create_arms

pytestmark = pytest.mark.operator


class _Recorder(http.server.BaseHTTPRequestHandler):
    requests: list[str] = []
    location = ""

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        type(self).requests.append(self.path)
        if self.path.startswith("/elsewhere"):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"status":"success","data":{"resultType":"vector","result":[]}}')
            return
        self.send_response(302)
        self.send_header("Location", type(self).location)
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def redirecting() -> Iterator[tuple[str, type[_Recorder]]]:
    handler = type("Handler", (_Recorder,), {"requests": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    handler.location = f"http://127.0.0.1:{server.server_port}/elsewhere/api/v1/query"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", handler
    finally:
        server.shutdown()
        server.server_close()


def test_a_redirect_from_prometheus_is_not_followed(redirecting: tuple[str, type[_Recorder]]) -> None:
    url, handler = redirecting
    source = PrometheusSource(url, {Arm.CONTROL: 'job="c"', Arm.TREATMENT: 'job="t"'}, attempts=1,
                              sleep=lambda _: None)
    with pytest.raises(MetricSourceError, match="302 redirect to .*/elsewhere.* not followed"):
        source.fetch_snapshot(at=1.0)
    assert handler.requests and not [p for p in handler.requests if p.startswith("/elsewhere")]


async def test_the_operator_running_an_ab_test_never_follows_the_redirect(
        kube: LocalApiServer, redirecting: tuple[str, type[_Recorder]]) -> None:
    """With kopf against the local API server: an A/B test reading an allowlisted Prometheus
    that answers with a redirect fails its measurement (saying where it pointed) and never
    queries the other location (it used to follow it: 6 requests to a host not allowlisted)."""
    url, handler = redirecting
    await create_arms(kube, {"control": 9, "treatment": 9})
    spec = ab_policy(prometheus={"url": url, "selectors": {"control": 'job="control"', "treatment": 'job="treatment"'}},
                     consecutiveErrorLimit=1)
    async with OperatorThread(connection=kube.connection_info(), options=FAST_OPTIONS):
        await kube.create(spec)
        await kube.wait_for(lambda: condition(kube, "ABTestConcluded", "ab").get("reason") == "MeasurementFailed",
                            timeout=60, what="the measurement failed")
    message = condition(kube, "ABTestConcluded", "ab")["message"]
    assert f"Prometheus at {url} failed" in message and "HTTP 302 redirect to" in message, message
    assert handler.requests and not [p for p in handler.requests if p.startswith("/elsewhere")]
