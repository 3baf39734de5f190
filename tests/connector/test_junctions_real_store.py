"""Junction retention on a real Mooncake store: save -> lookup -> save -> lookup, two instances.

Each "instance" is what one engine's worker does with the store: our lookup, and upstream's
send thread (ours, `JunctionSendingThread`, with retention) putting real KV bytes out of a
CPU tensor registered with its own store client. Instance 1 saves prompt A; instance 2 looks
up sibling C (shares A's first 8 blocks), saves C carrying the junction its lookup returned,
then looks up sibling D. A third tensor loads D's hit through upstream's own receive thread,
and the bytes must be the ones saved. The scheduler hand-off between lookup and save is
`core.junctions.merge_junctions` here (the scheduler is tested in test_junctions_scheduler).
"""

from __future__ import annotations

import hashlib
import queue
import threading
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    ChunkedTokenDatabase,
    KeyMetadata,
    LoadSpec,
    MooncakeLookupResult,
    ReqMeta,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
    KVCacheStoreRecvingThread,
    KVCacheStoreSendingThread,
)
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

from moonlease_connector.adapters.vllm_save import JunctionSendingThread
from moonlease_connector.adapters.vllm_scheduler import JunctionReqMeta
from moonlease_settings.config import LeaseMode, MoonleaseConnectorConfig
from moonlease_connector.core.junctions import merge_junctions
from moonlease_connector.core.lookup_protocol import parse_wire_entries
from tests.support.lookup_workers import HASH_BLOCK, LAYOUTS, build_lookup

pytestmark = pytest.mark.store

LAYOUT = LAYOUTS[3]  # full attention + a 40-token window over blocks of 16: 3-block tails
BLOCK_BYTES = 256
NUM_BLOCKS = 32
SHARED = [hashlib.sha256(b"shared%d" % i).digest()[:16] for i in range(8)]  # 128 tokens


def prompt(name: str, extra_blocks: int = 6) -> list[bytes]:
    return SHARED + [hashlib.sha256(b"%s%d" % (name.encode(), i)).digest()[:16]
                     for i in range(extra_blocks)]


def content(group: int, chunk_hash: bytes) -> torch.Tensor:
    """The KV bytes of a block: a function of its group and prefix, like real KV."""
    seed = hashlib.sha256(bytes([group]) + chunk_hash).digest()
    return torch.tensor(list(seed * (BLOCK_BYTES // len(seed))), dtype=torch.uint8)


class Instance:
    """One engine's worker side: lookups, a send thread and a registered KV tensor per group."""

    def __init__(self, client: Any, *, retention: bool) -> None:
        self.client = client
        config = MoonleaseConnectorConfig.for_mode(LeaseMode.LEASE_ALL, junction_retention=retention)
        # Sparse retention, an engine's default (`prefix_cache_retention_interval=0`).
        self.worker = build_lookup(LAYOUT, client, config, retention_interval=0)
        self.kv = torch.zeros((len(LAYOUT.specs), NUM_BLOCKS, BLOCK_BYTES), dtype=torch.uint8)
        assert client.register_buffer(self.kv.data_ptr(), self.kv.numel()) == 0
        self.databases = []
        for group, spec in enumerate(LAYOUT.specs):
            db = ChunkedTokenDatabase(KeyMetadata("tiny", 0, 0, 0, 0, group_id=group),
                                      spec.block_size, HASH_BLOCK)
            db.set_kv_caches_base_addr([self.kv[group].data_ptr()])
            db.set_block_len([BLOCK_BYTES])
            self.databases.append(db)
        self.junction_keys_saved: list[int] = []
        from mooncake.store import ReplicateConfig

        arguments = (client, self.worker.coord, self.databases, LAYOUT.scheduler_block, 0, (1, 1),
                     "kv_both", threading.Event(), False, ReplicateConfig())
        self.sender = (JunctionSendingThread(*arguments,
                                             on_junction_tails_saved=self.junction_keys_saved.append)
                       if retention else KVCacheStoreSendingThread(*arguments))
        self.sender.start()
        self._jobs = 0

    def lookup(self, hashes: list[bytes]) -> tuple[MooncakeLookupResult, tuple[int, ...]]:
        result = self.worker.lookup(len(hashes) * HASH_BLOCK, hashes).result
        response = parse_wire_entries(result.hit_length,
                                      [(b.group_id, b.num_tokens) for b in result.tail_key_boundaries])
        return result, response.junctions

    def compute_and_save(self, name: str, hashes: list[bytes], junctions: tuple[int, ...] = (),
                         freed_window_chunks: frozenset[int] = frozenset()) -> None:
        """Fill blocks 1.. with the prompt's KV and save it in one job, as one prefill step
        would; `freed_window_chunks` are window blocks the GPU already freed (null ids)."""
        tables = []
        for group in range(len(LAYOUT.specs)):
            ids = []
            for chunk, chunk_hash in enumerate(hashes):
                block = chunk + 1
                self.kv[group, block] = content(group, chunk_hash)
                ids.append(NULL_BLOCK_ID if group == 1 and chunk in freed_window_chunks else block)
            tables.append(ids)
        self._jobs += 1
        tokens = len(hashes) * HASH_BLOCK
        fields = dict(req_id=name, token_len_chunk=tokens, block_ids=tuple(tables),
                      block_hashes=list(hashes), can_save=True, num_prompt_tokens=tokens,
                      prefill_end_tokens=tokens, completed_token_len=tokens, store_job_id=self._jobs)
        job = JunctionReqMeta(**fields, junctions=junctions) if junctions else ReqMeta(**fields)
        self.sender.add_request(job)
        self.sender.request_queue.join()
        assert self.sender.take_completed_saves() == {self._jobs: 1}

    def load(self, hashes: list[bytes], result: MooncakeLookupResult) -> None:
        """Load `result` into blocks 1.. with upstream's receive thread (an old reader)."""
        receiver = KVCacheStoreRecvingThread(self.client, self.worker.coord, self.databases,
                                             LAYOUT.scheduler_block, 0, threading.Event(),
                                             request_queue=queue.Queue(), is_hma_required=True)
        receiver.start()
        hit = result.hit_length
        blocks = list(range(1, len(hashes) + 1))
        receiver.add_request(ReqMeta("load", hit, (blocks, blocks), list(hashes),
                                     load_spec=LoadSpec(0, hit, True, hit, result.tail_key_boundaries)))
        receiver.request_queue.join()
        assert receiver.get_and_clear_finished_requests() == {"load"}
        assert not receiver.get_and_clear_block_ids_with_load_errors()


def window_key(chunk_hash: bytes) -> str:
    return f"tiny@tp_rank:0@pcp0@dcp0@pp_rank:0@group:1@{chunk_hash.hex()}"


@pytest.fixture
def store(mooncake_master_factory, store_pool_factory, store_client_factory):
    master = mooncake_master_factory(default_kv_lease_ttl=500)
    store_pool_factory(master)
    return master, store_client_factory


@pytest.mark.parametrize("retention", [True, False], ids=["retention", "upstream"])
def test_two_instances_save_lookup_save_lookup(store, retention):
    master, connect = store
    first = Instance(connect(master), retention=retention)
    a, c, d = prompt("A"), prompt("C"), prompt("D")
    first.compute_and_save("A", a)
    # Sparse retention kept the window only at A's replay tail (223 -> 208: chunks 10..12).
    keys_after_a = master.metrics()["master_key_count"]
    assert keys_after_a == len(a) + 3

    second = Instance(connect(master), retention=retention)
    result_c, junctions_c = second.lookup(c)
    assert result_c.hit_length == 0   # full attention has 128 shared tokens, the window nothing
    assert junctions_c == ((128,) if retention else ())

    second.compute_and_save("C", c, merge_junctions(0, junctions_c))
    # C's own replay tail, and with retention the window tail at the junction (chunks 5..7).
    new_keys = master.metrics()["master_key_count"] - keys_after_a
    assert new_keys == 6 + 3 + (3 if retention else 0)
    if retention:
        assert sum(second.junction_keys_saved) == 3

    result_d, junctions_d = second.lookup(d)
    assert junctions_d == ()
    if not retention:
        assert result_d.hit_length == 0
        return
    assert result_d.hit_length == 128

    third = Instance(connect(master), retention=retention)
    third.load(d, result_d)
    for chunk in range(8):
        assert torch.equal(third.kv[0, chunk + 1], content(0, d[chunk])), chunk
    for chunk in (5, 6, 7):  # the window's tail at the junction, written by C's save
        assert torch.equal(third.kv[1, chunk + 1], content(1, d[chunk])), chunk
    assert not third.kv[1, 1:6].any()  # nothing else of the window was loaded


def test_a_freed_junction_tail_block_is_never_saved(store):
    master, connect = store
    first = Instance(connect(master), retention=True)
    first.compute_and_save("A", prompt("A"))
    second = Instance(connect(master), retention=True)
    c = prompt("C")
    _, junctions = second.lookup(c)
    assert junctions == (128,)
    second.compute_and_save("C", c, junctions, freed_window_chunks=frozenset({6}))
    assert sum(second.junction_keys_saved) == 2  # chunks 5 and 7; 6 had no block any more
    probe = connect(master)
    assert probe.batch_is_exist([window_key(c[chunk]) for chunk in (5, 6, 7)]) == [1, 0, 1]
    result_d, _ = second.lookup(prompt("D"))
    assert result_d.hit_length == 0  # an incomplete window tail serves no hit


def test_a_junction_tail_the_store_already_holds_is_not_counted_again(store):
    """Two engines look sibling C up before either saves it: both see the junction, the
    second save finds the tail written (upstream's dedup) and writes nothing for it."""
    master, connect = store
    Instance(connect(master), retention=True).compute_and_save("A", prompt("A"))
    c = prompt("C")
    second, third = Instance(connect(master), retention=True), Instance(connect(master), retention=True)
    junctions = [second.lookup(c)[1], third.lookup(c)[1]]
    assert junctions == [(128,), (128,)]
    second.compute_and_save("C", c, junctions[0])
    third.compute_and_save("C", c, junctions[1])
    assert (second.junction_keys_saved, third.junction_keys_saved) == ([3], [])
