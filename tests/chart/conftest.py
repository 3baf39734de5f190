"""Fixtures of the chart tests, and the one ordering rule they need."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import helm_python as helm
import kmock
import pytest
import pytest_asyncio

from moonlease_dev.testbed.connector_pods import ConnectorPods
from moonlease_dev.testbed.kube import LocalApiServer, local_api_server
from tests.chart.operator_scenario import OTHER_NAMESPACE
from tests.chart.rendering import NAMESPACE, load_chart


@pytest.fixture(scope="session")
def chart() -> Iterator[helm.Chart]:
    """The chart, loaded once (rendering is offline and leaves it unchanged)."""
    with load_chart() as loaded:
        yield loaded


@pytest_asyncio.fixture
async def release_kube(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LocalApiServer]:
    """The local API server with the release's namespace (and a second one), the CRD, the
    rollout simulator ticking every 20 ms, and running connectors (settings watcher and
    endpoint) for the vLLM pods that mount a settings ConfigMap."""
    async with local_api_server(tick_interval=0.02, namespaces=(NAMESPACE, OTHER_NAMESPACE)) as api:
        pods = ConnectorPods(api, tmp_path_factory.mktemp("connector-pods"))
        pods.start()
        try:
            yield api
        finally:
            await pods.stop()
        bugs = [e for e in api.emulator.errors if not isinstance(e, kmock.KubernetesError)]
        assert not bugs, f"the local API server failed internally: {bugs!r}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests of a module that sets `RUN_AFTER_OPERATOR_TESTS` run last, whatever the collection
    order: the RBAC test compares the chart's rules with the API calls the operator tests
    recorded in this session (tests/fixtures/kube.py), so it must come after them."""
    late = [item for item in items if getattr(getattr(item, "module", None), "RUN_AFTER_OPERATOR_TESTS", False)]
    if late:
        items[:] = [item for item in items if item not in late] + late
