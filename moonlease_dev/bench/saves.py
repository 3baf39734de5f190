"""What a request stores, imitating upstream's worker without an engine.

Which keys a prompt stores comes from vLLM's own retention masks (the coordinator's
`_reachable_masks`: sliding-window tails and Mamba states at block boundaries, dense or at the
replay boundary only), plus — with junction retention (seed 004) — the tails at the lookup's
junctions (`JunctionStoreMasks.junction_masks`, the mask our send thread adds). What a save
writes after a hit is upstream's: `batch_is_exist` on every full-attention block from token 0,
the loaded window and new blocks of other groups, new boundary states; then `put_batch` of
the keys the store lacks. `build_*` are pure over the worker's coordinator; `apply_save` does
the store I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from moonlease_connector.adapters.vllm_save import JunctionStoreMasks
from moonlease_connector.adapters.vllm_retention import build_resume_set, build_shared_set, chunk_kind
from moonlease_dev.bench.stores import fetch_presence
from moonlease_connector.core.junctions import add_junction_tails
from moonlease_connector.core.put_retry import PutRetryPolicy, plan_put_retry
from moonlease_connector.core.retention import (
    ChunkRetention,
    SaveChunk,
    SaveRetentionPlan,
    plan_save_retention,
)
from moonlease_settings.retention import RetentionSettings


@dataclass(frozen=True)
class ChunkKeys:
    """One group's chunk of a prompt, keyed at its end, in every rank namespace."""

    group_id: int
    chunk: int
    end_tokens: int
    keys: tuple[str, ...]
    recurrent: bool


@dataclass(frozen=True)
class ValueSizes:
    """Bytes of one stored value: a stand-in for the real KV sizes (eviction counts objects)."""

    attention: int = 2048  # one 16-token block of one attention group and rank
    recurrent: int = 8192  # one Mamba checkpoint of one rank namespace

    def of(self, chunk: ChunkKeys) -> int:
        return self.recurrent if chunk.recurrent else self.attention


@dataclass(frozen=True)
class SaveResult:
    keys_checked: int
    keys_put: int
    put_failures: int  # put_batch calls that returned an error
    keys_failed: int  # keys in those calls
    keys_pinned: int = 0  # keys put soft-pinned (retention `pin`)
    keys_skipped: int = 0  # keys retention `skip` did not write
    keys_retried: int = 0  # keys retention `retry` stored by putting them again


def build_prompt_chunks(lookup: Any, hashes: Sequence[bytes], hash_block_tokens: int,
                        junctions: Sequence[int] = ()) -> list[ChunkKeys]:
    """Every key storing this prompt writes, each group's chunks keyed at their end.

    Upstream saves lcm-aligned prefixes; which sliding-window blocks and Mamba states it keeps
    comes from vLLM's own retention masks (`store_mask` for KV blocks; for Mamba the same
    reachable-block mask that decides which boundary states the scheduler hands off, which
    `store_mask` leaves out only because those travel as boundary puts). `junctions` add the
    sliding-window tails junction retention keeps (never Mamba states).
    """
    coord = lookup.coord
    num_tokens = len(hashes) * hash_block_tokens
    aligned = num_tokens // coord.lcm_block_size * coord.lcm_block_size
    if aligned == 0:
        return []
    masks = list(coord._reachable_masks(aligned, 0, retention_interval=coord.retention_interval,
                                        num_prompt_tokens=num_tokens))
    groups = lookup.groups
    if junctions:
        junction_masks = JunctionStoreMasks(coord).junction_masks(aligned, 0, tuple(junctions))
        recurrent = [any(g.group_id == i and g.is_recurrent for g in groups)
                     for i in range(len(masks))]
        masks = list(add_junction_tails(masks, junction_masks, recurrent).masks)
    chunks = []
    for group in groups:
        spec = coord.kv_cache_groups[group.group_id].kv_cache_spec
        chunk_hashes = coord.block_hashes_for_spec(list(hashes), spec)
        mask = masks[group.group_id]
        for chunk in range(aligned // group.block_size):
            if mask is None or mask[chunk]:
                chunks.append(ChunkKeys(group.group_id, chunk, (chunk + 1) * group.block_size,
                                        group.keys_for(bytes(chunk_hashes[chunk])), group.is_recurrent))
    return chunks


def build_save_keys(lookup: Any, hashes: Sequence[bytes], hit: int,
                    chunks: Sequence[ChunkKeys]) -> list[ChunkKeys]:
    """What upstream's worker checks with `batch_is_exist` (and puts when missing) after a hit.

    Its first save of a request starts at token 0: every full-attention block of the prompt,
    and for a sliding window only the blocks the engine holds (the loaded window, then the new
    ones); recurrent states are saved only as new boundary states after the hit.
    """
    load_masks = lookup.coord.load_mask(list(hashes), hit) if hit > 0 else None
    keep = []
    for chunk in chunks:
        if chunk.end_tokens > hit:
            keep.append(chunk)
        elif not chunk.recurrent and load_masks is not None:
            mask = load_masks[chunk.group_id]
            if chunk.chunk < len(mask) and mask[chunk.chunk]:
                keep.append(chunk)
    return keep


def build_save_retention(lookup: Any, hashes: Sequence[bytes], hash_block_tokens: int,
                         chunks: Sequence[ChunkKeys], settings: RetentionSettings,
                         junctions: Sequence[int] = (), shared_blocks: int = 0) -> SaveRetentionPlan:
    """The connector's retention decision (`core.retention`) for these chunks of this prompt.

    `shared_blocks`: the prompt's shared prefix in hash blocks (`core.shared_prefix`), which
    ``pin`` pins.
    """
    if not settings.active:
        return SaveRetentionPlan((ChunkRetention.PLAIN,) * len(chunks))
    coord = lookup.coord
    resume = build_resume_set(coord, list(hashes), len(hashes) * hash_block_tokens, junctions)
    shared = build_shared_set(coord, list(hashes), shared_blocks * hash_block_tokens)
    return plan_save_retention(
        [SaveChunk(c.group_id, c.chunk, chunk_kind(coord.kv_cache_groups[c.group_id].kv_cache_spec))
         for c in chunks], resume, settings, shared)


def _put_answers(client: Any, keys: Sequence[str], code: int) -> list[int]:
    """Per-key answers of a `put_batch` that returned `code` (it answers for the whole batch).

    A refused batch may have stored some keys: a lease-free probe tells which; the others
    count as refused with the batch's code.
    """
    if code == 0:
        return [0] * len(keys)
    return [0 if present else code for present in fetch_presence(client, list(keys))]


def apply_save(client: Any, chunks: Sequence[ChunkKeys], sizes: ValueSizes,
               plan: SaveRetentionPlan | None = None, pin_config: Any = None,
               retry: PutRetryPolicy | None = None,
               sleep: Callable[[float], None] = time.sleep,
               eviction: Any = None) -> SaveResult:
    """Upstream's save: `batch_is_exist` (a lease on what exists), then put what is missing.

    With a retention `plan`, skipped chunks are neither checked nor written, and the missing
    keys of pinned chunks are put with `pin_config` (a soft-pin `ReplicateConfig`), the rest
    as upstream puts them. With `retry` (retention ``retry``), keys refused for lack of space
    are put again as `core.put_retry` says — those of chunks the plan marks `retried` — as
    the engine's send thread does. With `eviction` (retention ``evict``: an
    `adapters.store_eviction.StoreEviction`), the save's re-check and puts go through it as
    through the engine's send-thread store handle: it learns their recency and makes room
    before each put.
    """
    decisions = plan.decisions if plan is not None else (ChunkRetention.PLAIN,) * len(chunks)
    retry_chunks = plan.retried if plan is not None and plan.retried else (True,) * len(chunks)
    keyed = [(key, sizes.of(chunk), decision is ChunkRetention.PINNED)
             for chunk, decision in zip(chunks, decisions, strict=True)
             if decision is not ChunkRetention.SKIPPED for key in chunk.keys]
    worth_retry = {key for chunk, decision, again in zip(chunks, decisions, retry_chunks, strict=True)
                   if again and decision is not ChunkRetention.SKIPPED for key in chunk.keys}
    skipped = sum(len(chunk.keys) for chunk, decision in zip(chunks, decisions, strict=True)
                  if decision is ChunkRetention.SKIPPED)
    # Retention evict leaves the shared prefix alone (other engines read it).
    shared_keys = frozenset(key for chunk, is_shared in zip(chunks, plan.shared, strict=True)
                            if is_shared for key in chunk.keys) if plan is not None and plan.shared else frozenset()
    if not keyed:
        return SaveResult(0, 0, 0, 0, keys_skipped=skipped)
    exists = client.batch_is_exist([key for key, _, _ in keyed])
    if eviction is not None:
        eviction.saw_exist([key for key, _, _ in keyed], exists, shared=shared_keys)
    missing = [entry for entry, answer in zip(keyed, exists, strict=True) if answer != 1]
    values = {size: b"\0" * size for size in {sizes.attention, sizes.recurrent}}
    failures = failed_keys = pinned = retried = 0
    for pin in (True, False):
        group = [(key, size) for key, size, pinned_key in missing if pinned_key is pin]
        for start in range(0, len(group), 512):
            batch = group[start:start + 512]

            def put(entries: Sequence[tuple[str, int]]) -> int:
                args: list[Any] = [[key for key, _ in entries], [values[size] for _, size in entries]]
                if pin:  # noqa: B023 - put() runs within this iteration
                    args.append(pin_config)
                if eviction is not None:
                    eviction.before_put(args[0], [size for _, size in entries])
                code = client.put_batch(*args)
                if eviction is not None:
                    answers = [0] * len(entries) if code == 0 else _put_answers(client, args[0], code)
                    eviction.after_put(args[0], [size for _, size in entries], answers, shared=shared_keys)
                return code

            code = put(batch)
            if code != 0:
                failures += 1
                # A refused batch may have stored part of it: count what was not stored.
                answers = _put_answers(client, [key for key, _ in batch], code)
                if retry is not None:
                    attempts = 0
                    retryable = [key in worth_retry for key, _ in batch]
                    while again := plan_put_retry(answers, attempts, retry, retryable):
                        attempts += 1
                        sleep(retry.delay_s)
                        entries = [batch[i] for i in again]
                        for i, answer in zip(again, _put_answers(client, [k for k, _ in entries],
                                                                 put(entries)), strict=True):
                            answers[i] = answer
                            retried += answer >= 0
                lost = sum(1 for answer in answers if answer < 0)
                failed_keys += lost
                if pin:
                    pinned += len(batch) - lost
            elif pin:
                pinned += len(batch)
    return SaveResult(len(keyed), len(missing), failures, failed_keys, pinned, skipped, retried)
