"""vLLM's reset-prefix-cache path never hangs: `reset_cache()` on the scheduler role.

Our connector's scheduler role (every mode off) is built from a real `VllmConfig`; upstream's
reset waits for worker rank 0 forever. Here no worker listens, then a real upstream
`LookupKeyServer` over a lookup-only worker answers: the reset reports failure within its
deadline, and the lookup channel still works afterwards. No servers: unit tier.
"""

from __future__ import annotations

import itertools
import logging
import time
from types import SimpleNamespace

import pytest
from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import LookupKeyServer
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

from moonlease_connector.adapters.vllm_connector import MooncakeStoreConnector
from moonlease_connector.adapters.vllm_lookup_server import stop_upstream_lookup_server
from moonlease_connector.adapters.vllm_scheduler import MoonleaseStoreScheduler
from tests.support.lookup_workers import LAYOUTS, PatternStore, build_lookup

pytestmark = pytest.mark.unit
LAYOUT = LAYOUTS[0]
_ports = itertools.count(23600)


@pytest.fixture
def connector(vllm_rpc_base):
    config = VllmConfig(cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
                        kv_transfer_config=KVTransferConfig(
                            kv_connector="MooncakeStoreConnector", kv_role="kv_both",
                            kv_connector_extra_config={"lookup_rpc_port": next(_ports)}))
    groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(LAYOUT.specs)]
    kv_cache_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    built = MooncakeStoreConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    servers: list[LookupKeyServer] = []
    yield built, config, servers
    built.shutdown()  # closes the scheduler's lookup channel
    for server in servers:  # the tests' lookup servers: upstream's, or ours (closes itself)
        if isinstance(server, LookupKeyServer):
            assert stop_upstream_lookup_server(server)
        else:
            server.close()


def test_reset_without_a_worker_fails_within_its_deadline_and_lookups_still_work(connector):
    conn, config, servers = connector
    scheduler = conn.connector_scheduler
    assert isinstance(scheduler, MoonleaseStoreScheduler), "our scheduler, every mode off"
    scheduler.reset_timeout_s = 0.5
    started = time.monotonic()
    assert conn.reset_cache() is False
    assert time.monotonic() - started < 10, "bounded by the deadline, not forever"

    # A worker appears: the channel was replaced, so a lookup gets its answer.
    hashes = [bytes([3, i]) * 4 for i in range(4)]
    answers = {f"tiny@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{h.hex()}": 1 for h in hashes}
    lookup = build_lookup(LAYOUT, PatternStore(answers))
    servers.append(LookupKeyServer(SimpleNamespace(lookup=lambda n, h: lookup.lookup(n, h).result),
                                   config))
    result = scheduler.client.lookup("r1", 64, hashes)
    assert result is not None and result.hit_length == 48  # the last token is recomputed


def test_stopping_upstreams_lookup_server_logs_no_unknown_request_warning(connector):
    _, config, _ = connector
    server = LookupKeyServer(SimpleNamespace(lookup=lambda n, h: None), config)
    upstream_logger = logging.getLogger(LookupKeyServer.__module__)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    upstream_logger.addHandler(handler)
    try:
        assert stop_upstream_lookup_server(server)
    finally:
        upstream_logger.removeHandler(handler)
    assert not server.thread.is_alive()
    assert [r.getMessage() for r in records if r.levelno >= logging.WARNING] == []
    assert upstream_logger.filters == [], "the filter is only there while stopping"
