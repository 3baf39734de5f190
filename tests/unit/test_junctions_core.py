"""Junction retention's pure core (seed 004) and its lookup wire format, on hand-computed cases.

The wire-format tests also run upstream's own encoder, decoder and receive thread from the
installed vLLM, to show both directions of compatibility: upstream's loader ignores junction
entries, and our reader takes upstream's payloads.
"""

from __future__ import annotations

import queue
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import protocol as upstream
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    ChunkedTokenDatabase,
    KeyMetadata,
    LoadSpec,
    MooncakeLookupResult,
    ReqMeta,
    TailKeyBoundary,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
    KVCacheStoreRecvingThread,
)

from moonlease_connector.core.junctions import (
    add_junction_tails,
    find_junctions,
    merge_junctions,
    request_boundary,
)
from moonlease_connector.core.lookup import TailKey
from moonlease_connector.core.lookup_protocol import (
    JUNCTION_GROUP_ID,
    LookupResponse,
    LookupResponseError,
    build_wire_entries,
    decode_lookup_response,
    encode_lookup_response,
    parse_wire_entries,
)
from tests.support.lookup_workers import HASH_BLOCK, LAYOUTS

pytestmark = pytest.mark.unit

# ----------------------------------------------------------------------------- the rule


@pytest.mark.parametrize(("hit", "group_hits", "junctions"), [
    (0, [256], (256,)),          # full attention has the prefix, the window has nothing
    (128, [256, 128], (256,)),   # the window lags: junction where full attention stops
    (256, [256, 256], ()),       # every group agrees: no junction
    (256, [256], ()),
    (0, [0, 0], ()),             # nothing stored
    (0, [], ()),
    (64, [32], ()),              # a single-group hit never below the reconciled one counts
])
def test_the_junction_is_the_longest_single_group_hit_when_it_is_longer(hit, group_hits, junctions):
    assert find_junctions(hit, group_hits) == junctions


def test_a_request_keeps_every_junction_and_cores_boundary_wins_the_single_field():
    assert merge_junctions(0, ()) == ()
    assert merge_junctions(0, (256,)) == (256,)
    assert merge_junctions(320, (256, 320, 0)) == (256, 320)
    assert request_boundary(0, ()) == 0
    assert request_boundary(0, (256, 512)) == 512      # core found none: the deepest store junction
    assert request_boundary(320, (512,)) == 320        # core's own is kept


# ------------------------------------------------------------------------- save masks


def test_junction_tails_join_sparse_masks_and_never_recurrent_ones():
    base = ([True, False, False, False, True],   # sliding window: replay tail only
            None,                                 # full attention: every chunk
            [False] * 5)                          # Mamba: nothing positional
    tails = ([False, True, True, False, False], [False] * 5, [True] * 5)
    result = add_junction_tails(base, tails, recurrent=(False, False, True))
    assert result.masks == ([True, True, True, False, True], None, [False] * 5)
    assert result.added == ((1, 2), (), ())
    assert result.num_added == 2


def test_a_dense_junction_mask_makes_the_group_dense():
    result = add_junction_tails([[True, False]], [None], [False])
    assert result.masks == (None,) and result.added == ((1,),)


def test_masks_must_line_up():
    with pytest.raises(ValueError):
        add_junction_tails([[True]], [[True, False]], [False])
    with pytest.raises(ValueError):
        add_junction_tails([[True]], [], [False])


# ------------------------------------------------------------------------- wire format

entries = st.lists(st.tuples(st.integers(0, 8), st.integers(0, 2**32 - 1)), max_size=6)
junction_lists = st.lists(st.integers(0, 2**32 - 1), max_size=3)


@given(hit=st.integers(0, 2**32 - 1), tails=entries, junctions=junction_lists)
def test_round_trip_and_upstream_bytes(hit, tails, junctions):
    response = LookupResponse(hit, tuple(TailKey(g, n) for g, n in tails), tuple(junctions))
    payload = encode_lookup_response(response)
    assert decode_lookup_response(payload) == response
    # Byte for byte what upstream's encoder writes for the same entries.
    wire = build_wire_entries(response)
    assert payload == upstream.encode_lookup_response(
        MooncakeLookupResult(hit, tuple(TailKeyBoundary(g, n) for g, n in wire)))
    # An upstream reader decodes it; the real tails are what it has under real group ids.
    theirs = upstream.decode_lookup_response(payload)
    assert theirs.hit_length == hit
    assert parse_wire_entries(hit, [(b.group_id, b.num_tokens) for b in theirs.tail_key_boundaries]) \
        == response


@given(hit=st.integers(0, 2**32 - 1), tails=entries)
def test_payloads_from_writers_that_predate_junctions(hit, tails):
    old = upstream.encode_lookup_response(
        MooncakeLookupResult(hit, tuple(TailKeyBoundary(g, n) for g, n in tails)))
    assert decode_lookup_response(old) == LookupResponse(hit, tuple(TailKey(g, n) for g, n in tails), ())


def test_a_no_junction_response_is_upstreams_exactly():
    assert encode_lookup_response(LookupResponse(0)) == (0).to_bytes(4, "big")
    assert encode_lookup_response(LookupResponse(96, (TailKey(0, 96), TailKey(1, 112)))) == \
        upstream.encode_lookup_response(MooncakeLookupResult(96, (TailKeyBoundary(0, 96),
                                                                  TailKeyBoundary(1, 112))))


def test_junctions_ride_after_the_tails_under_the_sentinel_group():
    payload = encode_lookup_response(LookupResponse(0, (), (256,)))
    assert payload == bytes.fromhex("00000000" "ffffffff" "00000100")
    assert JUNCTION_GROUP_ID == 0xFFFFFFFF


@pytest.mark.parametrize("payload", [b"", b"\x00\x00\x00", b"\x00" * 7, b"\x00" * 13])
def test_malformed_payloads_are_rejected(payload):
    with pytest.raises(LookupResponseError):
        decode_lookup_response(payload)


@pytest.mark.parametrize("response", [
    LookupResponse(-1),
    LookupResponse(2**32),
    LookupResponse(16, (TailKey(JUNCTION_GROUP_ID, 16),)),
    LookupResponse(16, (), (2**32,)),
])
def test_unencodable_responses_are_rejected(response):
    with pytest.raises(LookupResponseError):
        encode_lookup_response(response)


class LoadRecorder:
    """A store whose loads succeed and are recorded, key by key."""

    def __init__(self) -> None:
        self.loaded: list[str] = []

    def batch_get_into_multi_buffers(self, keys, addrs, sizes):
        self.loaded.extend(keys)
        return [sum(s) for s in sizes]


def upstream_load_keys(tail_key_boundaries: tuple[TailKeyBoundary, ...], hit: int,
                       hashes: list[bytes]) -> list[str]:
    """The keys upstream's own receive thread reads to load `hit` with these entries."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.coordinator import (
        MooncakeStoreCoordinator,
    )
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec

    layout = LAYOUTS[3]  # full attention + sliding window
    groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(layout.specs)]
    coord = MooncakeStoreCoordinator(groups, layout.scheduler_block, HASH_BLOCK)
    databases = []
    for group_id, spec in enumerate(layout.specs):
        db = ChunkedTokenDatabase(KeyMetadata("tiny", 0, 0, 0, 0, group_id=group_id),
                                  spec.block_size, HASH_BLOCK)
        db.set_kv_caches_base_addr([1 << 20])
        db.set_block_len([64])
        databases.append(db)
    store = LoadRecorder()
    thread = KVCacheStoreRecvingThread(store, coord, databases, layout.scheduler_block, 0,
                                       threading.Event(), request_queue=queue.Queue(),
                                       is_hma_required=True)
    thread.start()
    blocks = list(range(1, len(hashes) + 1))
    thread.add_request(ReqMeta("r", hit, (blocks, blocks), list(hashes),
                               load_spec=LoadSpec(0, hit, True, hit, tail_key_boundaries)))
    thread.request_queue.join()
    assert thread.get_and_clear_finished_requests() == {"r"}
    assert not thread.get_and_clear_block_ids_with_load_errors()
    return store.loaded


def test_upstreams_loader_ignores_junction_entries():
    hashes = [bytes([i]) * 8 for i in range(12)]
    tails = (TailKeyBoundary(0, 112), TailKeyBoundary(1, 112))
    with_junctions = upstream.decode_lookup_response(
        encode_lookup_response(LookupResponse(112, (TailKey(0, 112), TailKey(1, 112)), (160, 192))))
    assert len(with_junctions.tail_key_boundaries) == 4  # the old reader sees them as entries...
    plain = upstream_load_keys(tails, 112, hashes)
    assert plain  # ...yet loads exactly what it loads without them
    assert upstream_load_keys(with_junctions.tail_key_boundaries, 112, hashes) == plain
