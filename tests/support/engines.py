"""Shared bits of the engine tests: our connector's kv-transfer-config, and engine counters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tests.support.numerics import assert_same_logprobs


def moonlease_transfer_config(**extra_config: Any) -> dict[str, Any]:
    """`--kv-transfer-config` loading our connector, with Moonlease keys in the extra config."""
    config: dict[str, Any] = {"kv_connector": "MooncakeStoreConnector",
                              "kv_connector_module_path": "moonlease_connector", "kv_role": "kv_both"}
    if extra_config:
        config["kv_connector_extra_config"] = dict(extra_config)
    return config


def engine_counter(llm: Any, name: str, **labels: str) -> float:
    """A counter of the engine's Prometheus registry (name without `_total`), summed over the
    labels not given."""
    return sum(float(metric.value) for metric in llm.get_metrics()
               if metric.name == name and all(metric.labels.get(k) == v for k, v in labels.items()))


@dataclass(frozen=True)
class FreshEngineRun:
    """What one fresh engine did for a list of prompts: its store hits, output and leases."""

    external_hits: int
    cached: list[int]
    tokens: list[list[int]]
    logprobs: list[Any]
    keys_leased: float
    keys_probed: float
    operations: dict[str, float]


def serve_fresh(vllm_engine: Any, model: str, transfer_config: dict[str, Any], store_config: Any,
                prompts: list[list[int]], *, operations: tuple[str, ...] = ()) -> FreshEngineRun:
    """Start a fresh engine (empty local cache), serve `prompts` greedily, measure, stop it."""
    from moonlease_dev.testbed import vllm_engine as ve

    engine = vllm_engine(model, kv_transfer_config=transfer_config, mooncake_config_path=store_config)
    completions = ve.generate_greedy(engine, prompts, max_tokens=8, logprobs=True)
    run = FreshEngineRun(
        external_hits=ve.prefix_cache_counters(engine).external_hits,
        cached=[c.num_cached_tokens for c in completions],
        tokens=[c.token_ids for c in completions],
        logprobs=[c.logprobs for c in completions],
        keys_leased=engine_counter(engine, "vllm:moonlease_lookup_keys", kind="leased"),
        keys_probed=engine_counter(engine, "vllm:moonlease_lookup_keys", kind="probed"),
        operations={op: engine_counter(engine, "vllm:mooncake_store_operation", operation=op)
                    for op in operations})
    vllm_engine.stop(engine)
    return run


def assert_same_service(ours: FreshEngineRun, theirs: FreshEngineRun) -> None:
    """Same store hits per prompt and the same output (tokens exact, logprobs within the test
    dtype's bound: `tests.support.numerics`)."""
    assert ours.external_hits == theirs.external_hits and ours.cached == theirs.cached
    assert ours.tokens == theirs.tokens
    for mine, other in zip(ours.logprobs, theirs.logprobs, strict=True):
        assert_same_logprobs(mine, other)


def error_chain(error: BaseException | None) -> list[BaseException]:
    """An exception and every cause or context behind it (vLLM wraps start-up errors)."""
    chain = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return chain
