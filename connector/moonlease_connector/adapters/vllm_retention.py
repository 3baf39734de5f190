"""vLLM binding of Moonlease retention (`core.retention`): the resume set, and the send thread.

Adapter. `build_resume_set` only reads vLLM's coordinator; `RetentionSendingThread` does the
store I/O through upstream's send thread. The resume set of a prompt is what vLLM's
load rule (`MooncakeStoreCoordinator.load_mask`) reads for a hit ending at the prompt's last
aligned boundary — where the next turn of the conversation resumes —, where an exact re-send
of the prompt hits (one block lower for a block-aligned prompt), and at each of the request's
shared-prefix junctions — where a sibling resumes. The send thread and the replay
benchmark both ask `build_resume_set`, then `core.retention.plan_save_retention`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import MooncakeStoreCoordinator
from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

from moonlease_connector.adapters.mooncake_store import (
    PER_KEY_CONFIG_FIELDS,
    build_soft_pin_config,
    config_for_keys,
)
from moonlease_connector.adapters.store_eviction import StoreEviction
from moonlease_connector.adapters.vllm_save import JunctionSendingThread, JunctionStoreMasks
from moonlease_connector.adapters.vllm_scheduler import junctions_of
from moonlease_connector.adapters.vllm_specs import unwrap_spec
from moonlease_connector.core.put_retry import (
    DEFAULT_PUT_RETRY,
    PutRetryPolicy,
    answers_for_upstream,
    plan_put_retry,
)
from moonlease_connector.core.retention import (
    ChunkKind,
    ChunkRetention,
    SaveChunk,
    plan_save_retention,
    resume_ends,
)
from moonlease_settings.retention import RetentionSettings
from moonlease_connector.core.shared_prefix import SharedPrefixTracker
from moonlease_connector.core.store_room import KeyOrder, StoreUsage


def chunk_kind(spec: Any) -> ChunkKind:
    """Full attention, a windowed group (sliding window, chunked local) or a recurrent one."""
    spec = unwrap_spec(spec)
    if isinstance(spec, MambaSpec):
        return ChunkKind.RECURRENT
    if isinstance(spec, SlidingWindowSpec) or getattr(spec, "attention_chunk_size", None):
        return ChunkKind.WINDOW
    return ChunkKind.FULL


def build_resume_set(coord: Any, block_hashes: Sequence[Any], num_tokens: int,
                     junctions: Sequence[int] = ()) -> frozenset[tuple[int, int]]:
    """`(group_id, chunk)` pairs a hit that resumes the prompt loads (`core.retention.resume_ends`:
    at the prompt's end, where an exact re-send of it hits, and at each junction). `num_tokens`
    is the prompt's own length, not cut to its whole hash blocks: a prompt that does not end on
    a block boundary is not hit one block lower when sent again."""
    resend_end = coord.align_lookup_length(num_tokens - 1)  # upstream's re-derived full hit
    resume: set[tuple[int, int]] = set()
    hashes = list(block_hashes)
    for end in resume_ends(num_tokens, coord.lcm_block_size, resend_end, junctions):
        for group_id, mask in enumerate(coord.load_mask(hashes, end)):
            resume.update((group_id, chunk) for chunk, loaded in enumerate(mask) if loaded)
    return frozenset(resume)


def build_shared_set(coord: Any, block_hashes: Sequence[Any],
                     shared_tokens: int) -> frozenset[tuple[int, int]]:
    """`(group_id, chunk)` pairs a hit at the end of the shared prefix loads (empty if none).

    `shared_tokens` comes from `core.shared_prefix.SharedPrefixTracker` (in tokens); it is
    aligned down to the coordinator's lcm block, as any hit is.
    """
    end = shared_tokens // coord.lcm_block_size * coord.lcm_block_size
    if end <= 0:
        return frozenset()
    return frozenset((group_id, chunk)
                     for group_id, mask in enumerate(coord.load_mask(list(block_hashes), end))
                     for chunk, loaded in enumerate(mask) if loaded)


logger = logging.getLogger("vllm.moonlease.connector.retention")


# --------------------------------------------------------------------------------------------
# Engine side: the send thread that carries the plan out (I/O through upstream's thread)
# --------------------------------------------------------------------------------------------

class RetentionStoreMasks(JunctionStoreMasks):
    """The junction view's `store_mask`, minus the window chunks the plan skips."""

    def __init__(self, coord: Any) -> None:
        super().__init__(coord)
        self.skipped: dict[int, frozenset[int]] = {}  # group -> absolute chunks not to write
        self.dropped: dict[int, int] = {}  # group -> chunks the last mask dropped

    def store_mask(self, aligned_token_len: int, start_token: int = 0,
                   num_prompt_tokens: int | None = None) -> tuple[Any, ...]:
        masks = super().store_mask(aligned_token_len, start_token, num_prompt_tokens)
        if not self.skipped:
            return masks
        groups = self._coord.kv_cache_groups
        result = []
        for group_id, mask in enumerate(masks):
            drop = self.skipped.get(group_id)
            if not drop:
                result.append(mask)
                continue
            spec = unwrap_spec(groups[group_id].kv_cache_spec)
            start_chunk, end_chunk = self._chunk_range(spec, aligned_token_len, start_token)
            base = [True] * (end_chunk - start_chunk) if mask is None else list(mask)
            kept = [keep and (start_chunk + i) not in drop for i, keep in enumerate(base)]
            self.dropped[group_id] = sum(base) - sum(kept)
            result.append(kept)
        return tuple(result)


class _RetentionStore:
    """The thread's store handle: puts of pinned keys carry a soft pin, others as before; with
    ``retry``, keys refused for lack of space are put again (`core.put_retry`); with ``evict``,
    the keys saves re-check or put are kept in recency order and the least recent removed
    before a put would cross the watermark (`adapters.store_eviction`)."""

    def __init__(self, store: Any, pinned: Callable[[str], bool],
                 on_retention: Callable[[str, int], None],
                 retry: Callable[[], PutRetryPolicy | None] = lambda: None,
                 sleep: Callable[[float], None] = time.sleep,
                 retryable: Callable[[str], bool] = lambda key: True,
                 eviction: Callable[[], StoreEviction | None] = lambda: None,
                 shared: Callable[[], frozenset[str]] = frozenset) -> None:
        self._store = store
        self._shared = shared
        self._pinned = pinned
        self._retryable = retryable
        self._on_retention = on_retention
        self._retry = retry
        self._sleep = sleep
        self._eviction = eviction
        self._configs: dict[int, Any] = {}

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        answers = self._store.batch_is_exist(keys)
        eviction = self._eviction()
        if eviction is not None:
            eviction.saw_exist(keys, answers, shared=self._shared())
        return answers

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def _pin_config(self, config: Any) -> Any:
        if any(isinstance(getattr(config, name, None), list) for name in PER_KEY_CONFIG_FIELDS):
            return build_soft_pin_config(config)  # upstream rewrites its per-key lists every batch
        if id(config) not in self._configs:
            self._configs = {id(config): build_soft_pin_config(config)}
        return self._configs[id(config)]

    def _put(self, keys: list[str], addrs: list[Any], sizes: list[Any], config: Any,
             args: tuple[Any, ...], indices: Sequence[int], results: list[int]) -> None:
        """Put `indices` of the batch (pinned ones with the pin config), answers into `results`.
        Each part carries the per-key fields of its own keys only."""
        pinned = [i for i in indices if self._pinned(keys[i])]
        plain = [i for i in indices if not self._pinned(keys[i])]
        for group, pin in ((pinned, True), (plain, False)):
            if not group:
                continue
            put_config = config_for_keys(self._pin_config(config) if pin else config, group, len(keys))
            answers = self._store.batch_put_from_multi_buffers(
                [keys[i] for i in group], [addrs[i] for i in group], [sizes[i] for i in group],
                put_config, *args)
            for i, answer in zip(group, answers, strict=True):
                results[i] = answer

    def batch_put_from_multi_buffers(self, keys: list[str], addrs: list[Any], sizes: list[Any],
                                     config: Any = None, *args: Any) -> list[int]:
        eviction = self._eviction()
        if eviction is not None:
            eviction.before_put(keys, sizes)
        answers = self._put_with_retention(keys, addrs, sizes, config, *args)
        if eviction is not None:
            eviction.after_put(keys, sizes, answers, shared=self._shared())
        return answers

    def _put_with_retention(self, keys: list[str], addrs: list[Any], sizes: list[Any],
                            config: Any = None, *args: Any) -> list[int]:
        policy = self._retry()
        if policy is None and not any(self._pinned(key) for key in keys):
            return self._store.batch_put_from_multi_buffers(keys, addrs, sizes, config, *args)
        results: list[int] = [0] * len(keys)
        self._put(keys, addrs, sizes, config, args, range(len(keys)), results)
        attempts = 0
        retryable = [self._retryable(key) for key in keys] if policy is not None else None
        while policy is not None:
            again = plan_put_retry(results, attempts, policy, retryable)
            if not again:
                break
            attempts += 1
            self._sleep(policy.delay_s)
            self._put(keys, addrs, sizes, config, args, again, results)
            stored = sum(1 for i in again if results[i] >= 0)
            if stored:
                self._on_retention("retried", stored)
        written = sum(1 for i, key in enumerate(keys) if results[i] >= 0 and self._pinned(key))
        if written:
            self._on_retention("pinned", written)
        return answers_for_upstream(results, retryable)


class LoadObserver:
    """A receive thread's store handle: loads as the store answers them, and the keys each load
    read handed to `on_loaded` (retention ``evict`` learns from them what a save never
    re-checks: the prefix a request loaded)."""

    def __init__(self, store: Any, on_loaded: Callable[[list[str]], None]) -> None:
        self._store = store
        self._on_loaded = on_loaded

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def batch_get_into_multi_buffers(self, keys: list[str], addrs: Any, sizes: Any) -> list[int]:
        answers = self._store.batch_get_into_multi_buffers(keys, addrs, sizes)
        read = [key for key, answer in zip(keys, answers) if answer >= 0]
        if read:
            self._on_loaded(read)
        return answers


def observe_loads(receive_threads: Sequence[Any], on_loaded: Callable[[list[str]], None]) -> None:
    """Have each receive thread's loads reported to `on_loaded` (its next load on)."""
    for thread in receive_threads:
        if not isinstance(thread.store, LoadObserver):
            thread.store = LoadObserver(thread.store, on_loaded)


class RetentionSendingThread(JunctionSendingThread):
    """Upstream's send thread (with junction tails) carrying out Moonlease retention.

    Per job: the resume set of the prompt (`build_resume_set`, at its end and junctions), with
    ``pin`` its shared prefix (`shared_prefixes`, then `build_shared_set`), the plan
    (`core.retention.plan_save_retention`) over every chunk the job could write; window
    chunks the plan skips leave the save mask, recurrent states it skips leave the boundary
    puts, and puts of pinned keys go out with a soft-pin `ReplicateConfig`. With ``retry``,
    keys a put was refused for lack of space are put again (`core.put_retry`) before the
    job reports its answers to upstream's thread. Keys already in
    the store are not re-put, so a shared prefix is pinned when a save writes it: after the
    tracker has seen it shared, the next time it is missing (evicted, or on a fresh store).
    """

    masks: RetentionStoreMasks

    def __init__(self, *args: Any, retention: RetentionSettings | Callable[[], RetentionSettings],
                 on_retention: Callable[[str, int], None] = lambda decision, keys: None,
                 master_usage: Callable[[], StoreUsage | None] = lambda: None,
                 fleet_order: KeyOrder | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: The pieces in force, read per job (live settings may switch them).
        self.retention_now: Callable[[], RetentionSettings] = (
            retention if callable(retention) else (lambda: retention))
        self._on_retention = on_retention
        self.masks = RetentionStoreMasks(self.masks._coord)
        self.coord = cast(MooncakeStoreCoordinator, self.masks)  # a stand-in: the coordinator's calls, wrapped
        #: The per-prefix reuse estimate `pin` pins by and `evict` leaves alone (this worker's prompts).
        self.shared_prefixes = SharedPrefixTracker()
        self._pinned_keys: frozenset[str] = frozenset()
        #: The job's shared-prefix keys, which ``evict`` leaves to the master (other engines read them).
        self._shared_keys: frozenset[str] = frozenset()
        self._skipped_keys: frozenset[str] = frozenset()
        self._boundary_dropped = 0
        # Passes puts through untouched while the current job has no pinned keys and retry is off.
        self._unretried_keys: frozenset[str] = frozenset()
        #: Retention ``evict``: the recency of this worker's keys and the removals it makes
        #: (kept while the piece is switched off live, so switching it back on starts warm); the
        #: order is the fleet's when ``mooncake_fleet_order_url`` names the service.
        self.eviction = StoreEviction(self.store, master_usage, self.retention_now().evict_watermark,
                                      on_removed=lambda keys: self._on_retention("removed", keys),
                                      order=fleet_order)
        self.store = _RetentionStore(
            self.store, lambda key: key in self._pinned_keys, self._on_retention,
            retry=lambda: DEFAULT_PUT_RETRY if self.retention_now().retry else None,
            retryable=lambda key: key not in self._unretried_keys,
            eviction=self._eviction_now, shared=lambda: self._shared_keys)

    def saw_load(self, keys: list[str]) -> None:
        """A receive thread loaded `keys`: with ``evict`` on, they were used now (any thread)."""
        if self.retention_now().evict:
            self.eviction.saw_load(keys)

    def _eviction_now(self) -> StoreEviction | None:
        settings = self.retention_now()
        if not settings.evict:
            return None
        self.eviction.watermark = settings.evict_watermark
        return self.eviction

    def _chunk_keys(self, req_meta: Any, group_id: int, chunk: int) -> tuple[str, ...]:
        db = self.token_databases[group_id]
        end = (chunk + 1) * db.block_size
        index = end // db.hash_block_size - 1
        if index >= len(req_meta.block_hashes):
            return ()
        chunk_hash = req_meta.block_hashes[index]
        return tuple(db.store_layout.key_for(shard, chunk_hash) for shard in db.store_layout.local_shard_ids)

    def plan_job(self, req_meta: Any) -> None:
        """The plan for this job's prompt: which keys are pinned, which skipped."""
        coord = self.masks._coord
        full_prompt = req_meta.prefill_end_tokens or req_meta.num_prompt_tokens or req_meta.token_len_chunk
        prompt = min(full_prompt, len(req_meta.block_hashes) * coord.hash_block_size)
        lcm = coord.lcm_block_size
        aligned = prompt // lcm * lcm
        junctions = junctions_of(req_meta)
        # The prompt's own length: only a prompt that ends on a block boundary is re-derived
        # one block lower when sent again (its hashes stop at the last whole hash block).
        resume = build_resume_set(coord, req_meta.block_hashes, full_prompt, junctions)
        settings = self.retention_now()
        shared: frozenset[tuple[int, int]] = frozenset()
        if settings.pin or settings.evict:
            hashes = list(req_meta.block_hashes[:prompt // coord.hash_block_size])
            shared_blocks = self.shared_prefixes.observe_and_share(hashes)
            shared = build_shared_set(coord, req_meta.block_hashes, shared_blocks * coord.hash_block_size)
        chunks = [SaveChunk(g, c, chunk_kind(group.kv_cache_spec))
                  for g, group in enumerate(coord.kv_cache_groups)
                  for c in range(aligned // self.token_databases[g].block_size)]
        plan = plan_save_retention(chunks, resume, settings, shared)
        pinned: set[str] = set()
        skipped: set[str] = set()
        unretried: set[str] = set()
        window_skips: dict[int, set[int]] = {}
        for chunk, again in zip(chunks, plan.retried, strict=False):
            if not again:
                unretried.update(self._chunk_keys(req_meta, chunk.group_id, chunk.chunk))
        for chunk, decision in zip(chunks, plan.decisions, strict=True):
            if decision is ChunkRetention.PINNED:
                pinned.update(self._chunk_keys(req_meta, chunk.group_id, chunk.chunk))
            elif decision is ChunkRetention.SKIPPED:
                skipped.update(self._chunk_keys(req_meta, chunk.group_id, chunk.chunk))
                window_skips.setdefault(chunk.group_id, set()).add(chunk.chunk)
        self._shared_keys = frozenset(
            key for chunk, is_shared in zip(chunks, plan.shared, strict=False) if is_shared
            for key in self._chunk_keys(req_meta, chunk.group_id, chunk.chunk))
        self._pinned_keys, self._skipped_keys = frozenset(pinned), frozenset(skipped)
        self._unretried_keys = frozenset(unretried)
        self.masks.skipped = {g: frozenset(c) for g, c in window_skips.items()}

    def _handle_request(self, req_meta: Any) -> None:
        try:
            settings = self.retention_now()
            # Retry too: it re-puts only what the plan marks; evict, for the shared prefix it keeps.
            if settings.plans_saves or settings.retry or settings.evict:
                self.plan_job(req_meta)
        except Exception as error:  # a plan that cannot be made saves as upstream does
            logger.warning(
                "retention plan failed for %s (saving as upstream): %s", req_meta.req_id, error)
            self._pinned_keys, self._skipped_keys, self.masks.skipped = frozenset(), frozenset(), {}
            self._unretried_keys = frozenset()
            self._shared_keys = frozenset()
        self.masks.dropped = {}
        self._boundary_dropped = 0
        try:
            super()._handle_request(req_meta)
        finally:
            skipped = self._boundary_dropped + sum(
                count * len(self.token_databases[group].store_layout.local_shard_ids)
                for group, count in self.masks.dropped.items())
            if skipped:
                self._on_retention("skipped", skipped)
            self._pinned_keys, self._skipped_keys, self.masks.skipped = frozenset(), frozenset(), {}
            self._unretried_keys = frozenset()
            self._shared_keys = frozenset()

    def _boundary_puts(self, req_meta: Any) -> list[Any]:
        puts = super()._boundary_puts(req_meta)
        if not self._skipped_keys:
            return puts
        kept = [put for put in puts if put[0] not in self._skipped_keys]
        self._boundary_dropped += len(puts) - len(kept)
        return kept
