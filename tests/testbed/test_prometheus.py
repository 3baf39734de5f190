"""The Prometheus test bed is real: it scrapes live exporters and answers PromQL."""

from __future__ import annotations

import pytest
from prometheus_client import Counter

pytestmark = pytest.mark.prometheus


def test_prometheus_returns_a_scraped_sample_the_test_drove(prometheus, metrics_exporter) -> None:
    registry, target = metrics_exporter()
    hits = Counter("demo_hits", "test-driven counter", ["arm"], registry=registry)
    hits.labels(arm="treatment").inc(41)
    hits.labels(arm="treatment").inc()

    server = prometheus({"arms": [target]})
    result = server.wait_for('demo_hits_total{arm="treatment"}')

    assert [float(sample["value"][1]) for sample in result] == [42.0]
    assert result[0]["metric"]["job"] == "arms"


def test_prometheus_scrapes_a_real_mooncake_master(prometheus, mooncake_master) -> None:
    server = prometheus({"mooncake-master": [f"127.0.0.1:{mooncake_master.metrics_port}"]})
    result = server.wait_for("master_total_capacity_bytes")
    assert result, "no sample of master_total_capacity_bytes was scraped"
    assert server.targets_health() == {mooncake_master.metrics_url: "up"}
