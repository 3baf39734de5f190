"""vLLM binding, save side of junction retention (seed 004): junction tails in the save mask.

I/O adapter. Upstream's send thread (`KVCacheStoreSendingThread`) computes each job's save
mask with ``coord.store_mask(...)``, which keeps a sliding-window group's tails only at the
prompt's replay boundaries. `JunctionSendingThread` is that thread with a coordinator view
(`JunctionStoreMasks`) whose `store_mask` also keeps the tails at the job's junctions:
vLLM's own ``reachable_block_mask`` with the junctions as reachable boundaries, ORed in by
`core.junctions.add_junction_tails` (never on Mamba groups). Everything else — which chunks
exist, null-block skipping, dedup against the store, puts, retries, block release — is
upstream's thread unchanged: a junction tail whose block the GPU already freed has a null
block id and is skipped, so it is never saved with wrong data.

The view and the counters belong to the send thread alone (one thread, one job at a time).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import MooncakeStoreCoordinator
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
    KVCacheStoreSendingThread,
)
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from moonlease_connector.adapters.vllm_scheduler import junctions_of
from moonlease_connector.adapters.vllm_specs import unwrap_spec
from moonlease_connector.core.junctions import Mask, add_junction_tails


class JunctionStoreMasks:
    """A `MooncakeStoreCoordinator` whose `store_mask` adds the tails at `junctions`.

    Every other attribute is the wrapped coordinator's. `added` maps a group to the absolute
    chunk ids the junctions added to the last mask (empty when they added none).
    """

    def __init__(self, coord: Any) -> None:
        self._coord = coord
        self.junctions: tuple[int, ...] = ()
        self.added: dict[int, tuple[int, ...]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._coord, name)

    def _chunk_range(self, spec: Any, aligned_token_len: int, start_token: int) -> tuple[int, int]:
        # Upstream's `_reachable_masks`: chunks after `start_token`, up to the aligned length.
        end_chunk = aligned_token_len // spec.block_size
        return min(end_chunk, max(0, cdiv(start_token, spec.block_size))), end_chunk

    def junction_masks(self, aligned_token_len: int, start_token: int,
                       junctions: Sequence[int]) -> tuple[Mask, ...]:
        """Per group, what the group's own reachability rule keeps for `junctions` alone.

        Same arguments as upstream's `store_mask` passes to ``reachable_block_mask``, with the
        junctions in place of the replay boundaries. Mamba groups get none (all False).
        """
        coord = self._coord
        masks: list[Mask] = []
        for group_id, group in enumerate(coord.kv_cache_groups):
            spec = unwrap_spec(group.kv_cache_spec)
            start_chunk, end_chunk = self._chunk_range(spec, aligned_token_len, start_token)
            if isinstance(spec, MambaSpec):
                masks.append([False] * (end_chunk - start_chunk))
                continue
            manager_cls = KVCacheSpecRegistry.get_manager_class(spec)
            assert manager_cls is not None
            masks.append(manager_cls.reachable_block_mask(
                start_block=start_chunk, end_block=end_chunk,
                alignment_tokens=coord.lcm_block_size, kv_cache_spec=spec,
                use_eagle=group_id in coord.eagle_group_ids,
                retention_interval=coord.retention_interval,
                reachable_boundaries=tuple(junctions), dcp_world_size=1))
        return tuple(masks)

    def store_mask(self, aligned_token_len: int, start_token: int = 0,
                   num_prompt_tokens: int | None = None) -> tuple[Mask, ...]:
        base = self._coord.store_mask(aligned_token_len, start_token,
                                      num_prompt_tokens=num_prompt_tokens)
        self.added = {}
        if not self.junctions:
            return base
        groups = self._coord.kv_cache_groups
        addition = add_junction_tails(
            base, self.junction_masks(aligned_token_len, start_token, self.junctions),
            [isinstance(unwrap_spec(g.kv_cache_spec), MambaSpec) for g in groups])
        for group_id, chunks in enumerate(addition.added):
            if chunks:
                spec = unwrap_spec(groups[group_id].kv_cache_spec)
                start_chunk, _ = self._chunk_range(spec, aligned_token_len, start_token)
                self.added[group_id] = tuple(start_chunk + chunk for chunk in chunks)
        return addition.masks


class _PutObserver:
    """The thread's store handle, reporting each `batch_put_from_multi_buffers` outcome."""

    def __init__(self, store: Any, on_put: Callable[[Sequence[str], Sequence[int]], None]) -> None:
        self._store = store
        self._on_put = on_put

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def batch_put_from_multi_buffers(self, keys: list[str], *args: Any, **kwargs: Any) -> Any:
        results = self._store.batch_put_from_multi_buffers(keys, *args, **kwargs)
        self._on_put(keys, results)
        return results


class JunctionSendingThread(KVCacheStoreSendingThread):
    """Upstream's send thread; each job's save mask keeps the tails at its junctions.

    `on_junction_tails_saved(n)` is called with the number of store keys a put wrote because
    of junctions (keys the store already held, or null source blocks, are not written).
    """

    def __init__(self, *args: Any, on_junction_tails_saved: Callable[[int], None],
                 junctions_enabled: Callable[[], bool] = lambda: True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Read per job: with live settings, junction retention can be switched on and off.
        self._junctions_enabled = junctions_enabled
        self.masks = JunctionStoreMasks(self.coord)
        self.coord = cast(MooncakeStoreCoordinator, self.masks)  # a stand-in: the coordinator's calls, wrapped
        self.store = _PutObserver(self.store, self._count_junction_tails)
        self._on_junction_tails_saved = on_junction_tails_saved
        self._job: Any = None

    def _handle_request(self, req_meta: Any) -> None:
        self._job = req_meta
        self.masks.junctions = junctions_of(req_meta) if self._junctions_enabled() else ()
        self.masks.added = {}
        try:
            super()._handle_request(req_meta)
        finally:
            self._job = None
            self.masks.junctions = ()
            self.masks.added = {}

    def junction_tail_keys(self, req_meta: Any) -> set[str]:
        """Store keys of the chunks the junctions added to the current job's mask."""
        if not self.masks.added:
            return set()
        lcm = self.masks.lcm_block_size
        token_len = req_meta.token_len_chunk // lcm * lcm
        keys: set[str] = set()
        for group_id, chunks in self.masks.added.items():
            db = self.token_databases[group_id]
            for chunk in chunks:
                end = min((chunk + 1) * db.block_size, token_len)
                chunk_hash = req_meta.block_hashes[end // db.hash_block_size - 1]
                keys.update(db.store_layout.key_for(shard, chunk_hash)
                            for shard in db.store_layout.local_shard_ids)
        return keys

    def _count_junction_tails(self, keys: Sequence[str], results: Sequence[int]) -> None:
        if self._job is None or not self.masks.added:
            return
        junction_keys = self.junction_tail_keys(self._job)
        written = sum(1 for key, result in zip(keys, results, strict=False)
                      if result >= 0 and key in junction_keys)
        if written:
            self._on_junction_tails_saved(written)
