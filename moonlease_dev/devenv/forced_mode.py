"""vLLM's Mooncake store suites with one Moonlease mode forced on (a pytest plugin).

Loaded beside `moonlease_dev.devenv.upstream_suites` (which puts our classes in upstream's place)
with `MOONLEASE_FORCED_MODE` naming the mode (`FORCED_MODES`). Switched on the way a user does
it (environment or extra config), a mode barely runs in these suites: their lookup tests build
bare workers that never read either. Forced, it runs wherever a worker does:

- the worker's class default and the settings our constructor reads are the mode's;
- the suites' in-memory stores (their fakes and `MagicMock`s) get a `batch_probe_key` that
  answers like Mooncake 0.3.14 (1/0 per key, whatever the policy, leasing nothing), read from
  what their `batch_is_exist` is set to answer without recording a call (a fixed list, written
  for upstream's one call over every candidate, then answers ours per key: `answer_per_key`,
  fed by each probe and by the shadow lookup below); capabilities are 0.3.14's and a
  LastHitOnly response contract is 0.3.14's (per-key existence) — what detection finds against
  a 0.3.14 client;
- every lookup is also answered by upstream's own `MooncakeStoreWorker.lookup` on a shadow of
  the same store (no call recorded, no stat kept), and the two hits compared: a hit that
  differs from upstream's is reported by itself (`hit differences`), so it can never pass for
  an expected difference;
- where a suite builds a layout last-hit-only cannot serve (no recurrent group, a sliding-window
  group), our code refuses the mode (`ConnectorConfigError`), and the test fails on that refusal;
- with a save mode (junction retention, retention pieces), our send thread is what the suites
  build where they build upstream's (`KVCacheStoreSendingThread` of upstream's module).

At the end it prints one line the compat test reads: `forced mode report: {json}` with the
lookups compared, the probes answered, our send threads built, and every hit difference (test,
tokens, ours, upstream's). Development tooling; the suites are never committed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from typing import Any
from unittest import mock

import pytest

#: The modes the compat tier forces, each as connector settings on top of the defaults.
FORCED_MODES: dict[str, dict[str, Any]] = {
    "selective": {"mooncake_lease_mode": "selective"},
    "lastHitOnly": {"mooncake_lease_mode": "lastHitOnly"},
    "junction": {"mooncake_junction_retention": True},
    "skip": {"mooncake_retention_skip": True},
    "pin+retry+evict": {"mooncake_retention_pin": True, "mooncake_retention_retry": True,
                        "mooncake_retention_evict": True},
}
MODE_ENV = "MOONLEASE_FORCED_MODE"
#: Set to 1 to make every hit of ours one token short: the compat tier checks with it that a
#: wrong hit is reported as a hit difference (never only as a failed test).
WRONG_HITS_ENV = "MOONLEASE_FORCED_WRONG_HITS"

_report: dict[str, Any] = {"mode": None, "lookups": 0, "probed": 0, "unknown": 0, "send_threads": 0,
                           "hit_differences": []}
_current_test: list[str] = [""]


def _configured_answer(method: Any, keys: list[str]) -> list[int] | None:
    """What a `MagicMock`'s `batch_is_exist` answers for `keys`, without recording a call
    (None: an iterator of answers, which cannot be read without consuming it)."""
    effect = method.side_effect
    if effect is None or getattr(effect, "_moonlease_per_key", False) is True:
        answer = method.return_value if effect is None else effect(list(keys))
        if answer is mock.DEFAULT:  # (keys the per-key answers do not know)
            answer = method.return_value
        return list(answer) if isinstance(answer, (list, tuple)) else None
    if callable(effect):
        return list(effect(list(keys)))
    return None


def existence(store: Any, keys: Sequence[str]) -> list[int] | None:
    """Whether each key exists, as the suite's store would answer `batch_is_exist`, read
    without a call the test could see."""
    method = getattr(store, "batch_is_exist", None)
    if method is None:
        return None
    if isinstance(method, mock.NonCallableMock):
        return _configured_answer(method, list(keys))
    return [int(answer) for answer in method(list(keys))]  # a fake class: no calls recorded


def give_probe(store: Any) -> None:
    """Give a suite's store a `batch_probe_key` answering like Mooncake 0.3.14 (once)."""
    if store is None:
        return
    current = getattr(store, "batch_probe_key", None)
    if current is not None and getattr(current, "_moonlease_0314", False) is True:  # (a Mock says anything)
        return
    if current is not None and not isinstance(current, mock.NonCallableMock):
        return  # a store with a real probe of its own

    def batch_probe_key(keys: list[str], policy: str = "none", candidate_size: int = 1) -> list[int]:
        answers = existence(store, keys)
        _report["probed"] += 1
        if answers is None:
            raise RuntimeError("the suite's store answer cannot be read without a call")
        answer_per_key(store, keys, answers)
        return answers

    batch_probe_key._moonlease_0314 = True  # type: ignore[attr-defined]
    try:
        store.batch_probe_key = batch_probe_key
    except AttributeError:  # a store type that refuses new attributes keeps leasing-only
        pass


def answer_per_key(store: Any, keys: Sequence[str], answers: Sequence[int]) -> None:
    """A `MagicMock` `batch_is_exist` set to one fixed list answers the one call upstream makes
    (all candidates); a store answers per key, so a later `batch_is_exist` of some of the probed
    keys (selective's lease of the hit's load set) gets those keys' answers — while the test
    keeps that same list. The call is still recorded, as the test sees it."""
    method = getattr(store, "batch_is_exist", None)
    if not isinstance(method, mock.NonCallableMock) or not isinstance(method.return_value, (list, tuple)):
        return
    if method.side_effect is not None and getattr(method.side_effect, "_moonlease_per_key", False) is not True:
        return
    fixed = method.return_value
    earlier = method.side_effect
    known = dict(earlier._moonlease_known) if earlier is not None and earlier._moonlease_fixed is fixed else {}
    known.update(zip(keys, answers, strict=False))

    def per_key(asked: list[str]) -> Any:
        if method.return_value is fixed and all(key in known for key in asked):
            return [known[key] for key in asked]
        return mock.DEFAULT

    per_key._moonlease_per_key = True  # type: ignore[attr-defined]
    per_key._moonlease_known = known  # type: ignore[attr-defined]
    per_key._moonlease_fixed = fixed  # type: ignore[attr-defined]
    method.side_effect = per_key


class _ShadowStore:
    """The suite's store as upstream's lookup sees it: `batch_is_exist` answered from its
    configuration (no call recorded); anything else is the store's own."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        answers = existence(self._store, keys)
        if answers is None:
            raise LookupError("unreadable answer")
        # Upstream asks every candidate in one call (the answer a test's fixed list was written
        # for); from then on the store answers ours per key, whichever of them it asks.
        answer_per_key(self._store, keys, answers)
        return answers

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def upstream_hit(worker: Any, num_tokens: int, block_hashes: Any) -> int | None:
    """Upstream's hit for this lookup on the same store contents (None: it could not be
    computed without disturbing the test)."""
    # Upstream's class as our worker derives from it (the suites' module attribute is ours).
    from moonlease_connector.adapters.vllm_worker import MooncakeStoreWorker

    store = worker.__dict__.get("store")
    if store is None or type(block_hashes) not in (list, tuple):
        return None  # (a test's own sequence may record every read: upstream's would show)
    shadow = _ShadowStore(store)
    had_record = "_record_kv_connector_operation" in worker.__dict__
    saved_record = worker.__dict__.get("_record_kv_connector_operation")
    worker.store = shadow
    worker._record_kv_connector_operation = lambda *args, **kwargs: None
    try:
        with mock.patch("vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker.logger"):
            result = MooncakeStoreWorker.lookup(worker, num_tokens, block_hashes)
    except Exception:
        return None
    finally:
        worker.store = store
        if had_record:
            worker._record_kv_connector_operation = saved_record
        else:
            del worker._record_kv_connector_operation
    hit = getattr(result, "hit_length", result)
    return int(hit) if isinstance(hit, int) else None


def _forced_settings(base: Callable[..., Any], update: dict[str, Any]) -> Callable[..., Any]:
    from moonlease_settings.config import MoonleaseConnectorConfig

    def connector_settings(*args: Any, **kwargs: Any) -> Any:
        config = base(*args, **kwargs)
        return MoonleaseConnectorConfig.model_validate({**config.model_dump(), **update})

    return connector_settings


def force_mode(mode: str) -> None:
    """Set the worker's defaults to `mode` and wrap its lookup (see the module docstring)."""
    from moonlease_connector.adapters import vllm_worker
    from moonlease_settings.config import MoonleaseConnectorConfig
    from moonlease_connector.core.capabilities import StoreCapabilities

    update = FORCED_MODES[mode]
    _report["mode"] = mode
    worker_class = vllm_worker.MoonleaseStoreWorker
    worker_class.moonlease_config = MoonleaseConnectorConfig.model_validate(update)
    vllm_worker.connector_settings = _forced_settings(vllm_worker.connector_settings, update)
    capabilities = StoreCapabilities("0.3.14", True, ("none", "LastHitOnly"))
    vllm_worker.UNDETECTED_CAPABILITIES = capabilities

    def detect_capabilities(store: Any) -> StoreCapabilities:
        give_probe(store)
        return capabilities

    vllm_worker.detect_capabilities = detect_capabilities
    _force_probe_contract()
    ours = worker_class.lookup
    wrong_hits = os.environ.get(WRONG_HITS_ENV) == "1"

    def lookup(self: Any, num_tokens: int, block_hashes: Any) -> Any:
        give_probe(self.__dict__.get("store"))
        upstream = upstream_hit(self, num_tokens, block_hashes)
        result = ours(self, num_tokens, block_hashes)
        if wrong_hits and result.hit_length > 0:  # the plugin's own check (see WRONG_HITS_ENV)
            result = dataclasses.replace(result, hit_length=result.hit_length - 1)
        _report["lookups"] += 1
        if upstream is None:
            _report["unknown"] += 1
        elif int(result.hit_length) != upstream:
            _report["hit_differences"].append({"test": _current_test[0], "num_tokens": num_tokens,
                                               "ours": int(result.hit_length), "upstream": upstream})
        return result

    worker_class.lookup = lookup
    _force_send_threads(worker_class.moonlease_config)


def _force_probe_contract() -> None:
    """LastHitOnly answers are read under 0.3.14's contract (per-key existence), which is what
    detection finds against a 0.3.14 client; the suites' stores cannot take detection's own
    writes, so it answers without them. Each worker still gets its own detector (ours)."""
    from moonlease_connector.adapters.mooncake_store import ProbeContractDetector
    from moonlease_connector.core.last_hit import ProbeContract

    def detect_locked(self: Any) -> ProbeContract:
        self._contract = ProbeContract.PER_KEY_EXISTENCE
        return self._contract

    ProbeContractDetector._detect_locked = detect_locked  # type: ignore[method-assign]


def _force_send_threads(settings: Any) -> None:
    """Our send thread where the suites build upstream's (they take the class from upstream's
    module): junction retention's thread, or retention's with the mode's pieces. Upstream's
    constructor arguments; ours added (retention `evict` gets no master metrics here, so it
    waits, as it does when the master cannot be read)."""
    if not (settings.mooncake_junction_retention or settings.retention.active):
        return
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import worker as upstream_worker

    from moonlease_connector.adapters.vllm_retention import RetentionSendingThread
    from moonlease_connector.adapters.vllm_save import JunctionSendingThread

    base: Any = RetentionSendingThread if settings.retention.active else JunctionSendingThread
    extra: dict[str, Any] = {"on_junction_tails_saved": lambda written: None,
                             "junctions_enabled": lambda: settings.finds_junctions}
    if settings.retention.active:
        extra["retention"] = settings.retention

    class ForcedSendingThread(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**extra, **kwargs})
            _report["send_threads"] += 1

    ForcedSendingThread.__name__ = ForcedSendingThread.__qualname__ = base.__name__
    upstream_worker.KVCacheStoreSendingThread = ForcedSendingThread


def pytest_configure(config: Any) -> None:
    mode = os.environ.get(MODE_ENV)
    if mode:
        force_mode(mode)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: Any) -> None:
    _current_test[0] = item.nodeid


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _report["mode"] is not None:
        terminalreporter.write_line(f"forced mode report: {json.dumps(_report)}")
