"""Junctions in the save mask: at several positions, on sliding-window groups, never on Mamba.

`JunctionStoreMasks` wraps vLLM's real `MooncakeStoreCoordinator` the way the send thread sees
it. Expected chunks are computed by hand from vLLM's rule (a window of W tokens over blocks of B
needs ceil((W - 1) / B) blocks ending at the boundary, floored to the scheduler block; EAGLE
keeps one more and shifts by one), so a change in what vLLM keeps shows up here.
"""

from __future__ import annotations

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (
    MooncakeStoreCoordinator,
)
from vllm.v1.kv_cache_interface import KVCacheGroupSpec

from moonlease_connector.adapters.vllm_save import JunctionStoreMasks
from tests.support.lookup_workers import HASH_BLOCK, full_attention, mamba_align, sliding_window

pytestmark = pytest.mark.compat


def coordinator(*specs, scheduler_block: int, eagle: bool = False,
                retention_interval: int | None = 0) -> MooncakeStoreCoordinator:
    groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)]
    return MooncakeStoreCoordinator(groups, scheduler_block, HASH_BLOCK, use_eagle=eagle,
                                    retention_interval=retention_interval)


def kept(mask) -> set[int]:
    return {i for i, keep in enumerate(mask) if keep}


def masks_for(coord, junctions, tokens=320, start=0, prompt=320):
    view = JunctionStoreMasks(coord)
    view.junctions = tuple(junctions)
    return view, view.store_mask(tokens, start, num_prompt_tokens=prompt)


FULL_SWA = (full_attention(16), sliding_window(40, 16))  # window needs 3 blocks of 16


@pytest.mark.parametrize(("junctions", "window_chunks"), [
    ((), {16, 17, 18}),                             # the replay tail alone (319 -> 304)
    ((128,), {5, 6, 7, 16, 17, 18}),
    ((130,), {5, 6, 7, 16, 17, 18}),                # floored to the scheduler block
    ((48,), {0, 1, 2, 16, 17, 18}),
    ((32,), {0, 1, 16, 17, 18}),                    # a junction closer to 0 than the window
    ((128, 224), {5, 6, 7, 11, 12, 13, 16, 17, 18}),
    ((304,), {16, 17, 18}),                         # on the replay boundary: nothing added
])
def test_junction_tails_at_several_positions(junctions, window_chunks):
    coord = coordinator(*FULL_SWA, scheduler_block=16)
    view, masks = masks_for(coord, junctions)
    assert masks[0] is None  # full attention keeps every block
    assert kept(masks[1]) == window_chunks
    assert view.added.get(1, ()) == tuple(sorted(window_chunks - {16, 17, 18}))
    assert 0 not in view.added


def test_no_junction_is_upstreams_mask_exactly():
    coord = coordinator(*FULL_SWA, scheduler_block=16)
    view, masks = masks_for(coord, ())
    assert masks == coord.store_mask(320, 0, num_prompt_tokens=320)
    assert view.added == {}


def test_a_later_save_keeps_only_the_tails_in_its_own_range():
    coord = coordinator(*FULL_SWA, scheduler_block=16)
    view, masks = masks_for(coord, (128, 224), start=160)  # chunks 10..19 of this job
    assert kept(masks[1]) == {c - 10 for c in (11, 12, 13, 16, 17, 18)}
    assert view.added == {1: (11, 12, 13)}


def test_never_on_mamba_groups():
    coord = coordinator(full_attention(16), sliding_window(40, 16), mamba_align(64),
                        scheduler_block=64)
    view, masks = masks_for(coord, (128, 256))
    assert masks[0] is None
    assert masks[2] == [False] * 5            # 320 tokens / 64 per state: all False
    # Replay: 319 -> 256 -> chunks 13..15; junctions 128 and 256 (on the replay boundary).
    assert kept(masks[1]) == {5, 6, 7, 13, 14, 15}
    assert set(view.added) == {1}


def test_eagle_keeps_one_more_block_shifted_past_the_junction():
    coord = coordinator(*FULL_SWA, scheduler_block=16, eagle=True)
    view, masks = masks_for(coord, (128,))
    # EAGLE replay boundaries of a 320-token prompt: 288 and 304 -> chunks 15..18 and 16..19.
    assert kept(masks[1]) == {5, 6, 7, 8} | {15, 16, 17, 18, 19}
    assert view.added == {1: (5, 6, 7, 8)}


def test_dense_retention_needs_no_junction_tails():
    coord = coordinator(*FULL_SWA, scheduler_block=16, retention_interval=None)
    view, masks = masks_for(coord, (128,))
    assert masks == (None, None) and view.added == {}
