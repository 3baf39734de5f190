"""The fleet order service's rules (`core.fleet_order`), its HTTP server and client on loopback.

The server is ours (the standard library's HTTP server in this process); the client talks to
it over real TCP. The engines' side against a real master is in
tests/connector/test_store_eviction_real_store.py.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from pydantic import ValidationError

from moonlease_connector.adapters.fleet_order_client import FleetOrderClient, parse_service_url
from moonlease_connector.adapters.fleet_order_server import FleetOrderServer
from moonlease_connector.adapters.store_eviction import StoreEviction
from moonlease_connector.core.fleet_order import (
    Keep,
    OperationsRequest,
    Refresh,
    Take,
    Touch,
    apply_operation,
)
from moonlease_connector.core.store_room import RecencyOrder
from moonlease_connector.fleet_order import main as fleet_order_main
from moonlease_settings.config import ConnectorConfigError, MoonleaseConnectorConfig

pytestmark = pytest.mark.unit


@pytest.fixture
def server() -> Iterator[FleetOrderServer]:
    service = FleetOrderServer("127.0.0.1", 0).start()
    yield service
    service.close()


def test_operations_apply_as_the_engines_own_order_would() -> None:
    order = RecencyOrder()
    apply_operation(order, Touch(keys=["a0", "a1"], sizes=[10, 10]))
    apply_operation(order, Touch(keys=["b0", "b1"], sizes=[10, 10], shared=["b0"]))
    assert apply_operation(order, Refresh(keys=["a0", "a1", "unknown"])).refreshed == 2
    taken = apply_operation(order, Take(free_bytes=15, protect=["b1"])).taken
    assert taken == [("a1", 10), ("a0", 10)]  # b1 protected, b0 shared: A's conversation, tail first
    apply_operation(order, Keep(taken=[("a1", 10)]))  # the master refused it: most recent again
    assert apply_operation(order, Take(free_bytes=1)).taken == [("b1", 10)]
    with pytest.raises(ValidationError, match="1 sizes for 2 keys"):
        Touch(keys=["x", "y"], sizes=[1])


def test_the_wire_refuses_unknown_operations_and_fields() -> None:
    with pytest.raises(ValidationError):
        OperationsRequest.model_validate({"ops": [{"op": "evict_all"}]})
    with pytest.raises(ValidationError):
        OperationsRequest.model_validate({"ops": [{"op": "take", "free_bytes": -1}]})
    with pytest.raises(ValidationError):
        OperationsRequest.model_validate({"ops": [{"op": "refresh", "keys": [], "force": True}]})


def test_two_engines_share_one_order_through_the_service(server: FleetOrderServer) -> None:
    a, b = FleetOrderClient(server.url), FleetOrderClient(server.url)
    try:
        a.touch(["a0", "a1"], [10, 10])
        assert a.flush()
        b.touch(["b0", "b1"], [10, 10])
        b.refresh(["a0", "a1"])  # B read A's conversation after saving its own
        assert b.flush()
        assert a.take_oldest(15) == [("b1", 10), ("b0", 10)]
        a.keep([("b0", 10)])
        assert a.flush()
        assert b.take_oldest(1) == [("a1", 10)]
    finally:
        a.close()
        b.close()
    metrics = urllib.request.urlopen(server.url + "/metrics").read().decode()
    assert "moonlease_fleet_order_keys 2.0" in metrics
    assert "moonlease_fleet_order_keys_taken_total 3.0" in metrics
    assert "moonlease_fleet_order_keys_kept_total 1.0" in metrics
    assert 'moonlease_fleet_order_operations_total{op="take"} 2.0' in metrics
    assert urllib.request.urlopen(server.url + "/healthz").read() == b"ok\n"


def _post(server: FleetOrderServer, ops: list[dict[str, object]]) -> urllib.error.HTTPError:
    request = urllib.request.Request(server.url + "/v1/ops", data=json.dumps({"ops": ops}).encode(),
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request)
    return raised.value


def test_a_malformed_request_gets_400_says_why_and_applies_nothing(server: FleetOrderServer) -> None:
    refused = _post(server, [{"op": "nope"}])
    assert refused.code == 400 and "nope" in json.loads(refused.read())["error"]
    # A good touch before a bad one in the same batch: neither is applied.
    refused = _post(server, [{"op": "touch", "keys": ["a"], "sizes": [1]},
                             {"op": "touch", "keys": ["b", "c"], "sizes": [1]}])
    assert refused.code == 400 and "1 sizes for 2 keys" in json.loads(refused.read())["error"]
    assert len(server.fleet_order.order) == 0
    metrics = urllib.request.urlopen(server.url + "/metrics").read().decode()
    assert "moonlease_fleet_order_rejected_requests_total 2.0" in metrics


def test_a_service_that_does_not_answer_costs_no_request(caplog: pytest.LogCaptureFixture) -> None:
    """Down: a take answers [] within its timeout, reports beyond the bound are dropped oldest
    first, one warning says so; back up: it answers again, and says that too."""
    service = FleetOrderServer("127.0.0.1", 0)  # bound, not serving yet: requests wait unanswered
    troubles: dict[str, int] = {}
    client = FleetOrderClient(service.url, timeout_s=0.2, max_queued=3,
                              on_trouble=lambda kind, n: troubles.update({kind: troubles.get(kind, 0) + n}))
    logger = logging.getLogger("vllm.moonlease.connector.fleet_order")
    logger.addHandler(caplog.handler)  # vLLM's logger, once imported, does not propagate to the root
    try:
        with caplog.at_level(logging.WARNING, logger=logger.name):
            started = time.monotonic()
            assert client.take_oldest(10) == []
            assert time.monotonic() - started < 1.0
            for index in range(10):
                client.touch([f"k{index}"], [1])
            assert client.dropped_operations >= 5
            time.sleep(1.3)  # past the connection's own timeout (1 s): the first send has failed
            service.start()
            assert client.flush(timeout_s=10)
            client.touch(["late"], [1])
            assert client.flush()
            assert client.take_oldest(1) != []
    finally:
        logger.removeHandler(caplog.handler)
        client.close()
        service.close()
    assert client.unanswered_takes == 1
    assert "does not answer" in caplog.text and "answers again" in caplog.text
    # What the worker counts as vllm:moonlease_fleet_order_errors_total{kind}.
    assert troubles == {"unanswered_take": 1, "dropped_report": client.dropped_operations,
                        "failed_request": client.failed_requests}


def test_evict_on_the_fleet_order_reports_a_load_at_once(server: FleetOrderServer) -> None:
    """A load reaches the fleet's order at once, not at the reading engine's next save (which
    may never come): another engine's next take already sees it."""
    class NoStore:
        def batch_remove(self, keys: list[str], force: bool = False) -> list[int]:
            return [0] * len(keys)

    saver, reader = FleetOrderClient(server.url), FleetOrderClient(server.url)
    try:
        saver.touch(["old0", "old1"], [10, 10])
        saver.touch(["new0", "new1"], [10, 10])
        assert saver.flush()
        StoreEviction(NoStore(), lambda: None, 0.8, order=reader).saw_load(["old0", "old1"])
        assert reader.flush()
        assert saver.take_oldest(1) == [("new1", 10)]
    finally:
        saver.close()
        reader.close()


def test_the_service_url_is_checked_at_start_up() -> None:
    assert parse_service_url("http://fleet-order.ns.svc:8790") == ("http", "fleet-order.ns.svc", 8790, "/v1/ops")
    assert parse_service_url("https://lb/prefix/")[1:] == ("lb", 443, "/prefix/v1/ops")
    config = MoonleaseConnectorConfig.from_sources({"mooncake_fleet_order_url": "http://fleet-order:8790"})
    assert config.mooncake_fleet_order_url == "http://fleet-order:8790"
    with pytest.raises(ConnectorConfigError, match=r"mooncake_fleet_order_url: .*http://host:port"):
        MoonleaseConnectorConfig.from_sources({"mooncake_fleet_order_url": "fleet-order:8790"})
    with pytest.raises(ValueError, match="give the fleet order service as http://host:port"):
        parse_service_url("fleet-order:8790")


def test_the_command_refuses_bad_arguments_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert fleet_order_main(["--capacity=0"]) == 2
    assert "--capacity 0: give at least 1 key" in capsys.readouterr().err
    assert fleet_order_main(["--port=70000"]) == 2
    assert "give a port between 0 and 65535" in capsys.readouterr().err


def test_a_restarted_service_is_reached_again_and_starts_empty() -> None:
    """The service's pod replaced (same address): the client's kept-alive connection is dead,
    the next request goes out on a fresh one; the new service knows nothing (its order lived in
    the old one's memory), so a take finds nothing until saves report again."""
    first = FleetOrderServer("127.0.0.1", 0).start()
    port = first.port
    client = FleetOrderClient(first.url)
    try:
        client.touch(["old"], [10])
        assert client.flush()
        first.close()
        second = FleetOrderServer("127.0.0.1", port).start()
        try:
            assert client.take_oldest(1) == []  # answered: the new service holds nothing yet
            client.touch(["new"], [10])
            assert client.take_oldest(1) == [("new", 10)]
        finally:
            second.close()
    finally:
        client.close()
    assert client.unanswered_takes == 0


def test_an_operation_the_wire_cannot_carry_is_left_out_and_counted(server: FleetOrderServer) -> None:
    """A caller's operation the wire refuses (here sizes that do not match the keys; in an
    engine, a prompt over the key limit) never raises into the save: it is left out, counted."""
    troubles: list[str] = []
    client = FleetOrderClient(server.url, on_trouble=lambda kind, n: troubles.append(kind))
    try:
        client.touch(["a", "b"], [1])
        client.touch(["c"], [1])
        assert client.flush()
        assert client.take_oldest(10) == [("c", 1)]
    finally:
        client.close()
    assert troubles == ["invalid_operation"]
