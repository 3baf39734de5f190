"""Last-hit-only on a real Mooncake 0.3.14 store: lookup -> load metadata -> receiver buffers.

Full attention (16-token blocks, one rank namespace: its KV heads are replicated across TP)
plus align-mode Mamba (64-token checkpoints) with two rank namespaces, as at TP=2. A writer
puts distinct bytes for every KV block and for every recurrent checkpoint of each rank. Our
lookup (`MoonleaseStoreWorker`, last-hit-only) runs on a real 0.3.14 client; its result becomes
a LoadSpec/ReqMeta the way upstream's scheduler builds them; upstream's own receive thread
(one per rank, each with its own client and registered buffers) loads it. Each recurrent rank
buffer must hold exactly the saved state of the selected checkpoint for that rank, and the KV
buffers the saved KV. The store is the lease witness: a key under a read lease refuses a
non-forced remove (-706), so only the selected checkpoint's recurrent keys may refuse.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    ChunkedTokenDatabase,
    KeyMetadata,
    LoadSpec,
    ReqMeta,
    RequestTracker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
    KVCacheStoreRecvingThread,
)

from moonlease_connector.adapters.mooncake_store import detect_capabilities
from moonlease_settings.config import LeaseMode, MoonleaseConnectorConfig
from tests.support.lookup_workers import (
    HASH_BLOCK,
    Layout,
    RecordingStore,
    build_lookup,
    build_upstream_lookup,
    full_attention,
    mamba_align,
)

pytestmark = pytest.mark.store

LEASED = -706
KV, MAMBA = 0, 1
CHECKPOINT = 64  # Mamba block size: a recurrent state every 4 hash blocks
RANKS = 2
KV_BYTES = 256
STATE_BYTES = 512
NUM_HASHES = 21  # 336 tokens: checkpoints at 64 .. 320
NUM_TOKENS = NUM_HASHES * HASH_BLOCK + 5  # the prompt's partial last block is not hashed

PLAIN = Layout("full+mamba-2ranks", (full_attention(), mamba_align(CHECKPOINT)), CHECKPOINT, (1, RANKS))
EAGLE = Layout("full+mamba-2ranks-eagle", PLAIN.specs, CHECKPOINT, (1, RANKS), eagle=True)

HASHES = [hashlib.sha256(b"last-hit%d" % i).digest()[:16] for i in range(NUM_HASHES)]
CHECKPOINTS = [CHECKPOINT * c for c in range(1, NUM_HASHES * HASH_BLOCK // CHECKPOINT + 1)]


def kv_key(index: int) -> str:
    return f"tiny@tp_rank:0@pcp0@dcp0@pp_rank:0@group:{KV}@{HASHES[index].hex()}"


def state_key(rank: int, position: int) -> str:
    return f"tiny@tp_rank:{rank}@pcp0@dcp0@pp_rank:0@group:{MAMBA}@{HASHES[position // HASH_BLOCK - 1].hex()}"


def kv_bytes(index: int) -> torch.Tensor:
    seed = hashlib.sha256(b"kv" + HASHES[index]).digest()
    return torch.tensor(list(seed * (KV_BYTES // len(seed))), dtype=torch.uint8)


def state_bytes(rank: int, position: int) -> torch.Tensor:
    """Distinct per rank and per checkpoint, so a wrong rank or checkpoint shows."""
    seed = hashlib.sha256(b"state%d@%d" % (rank, position)).digest()
    return torch.tensor(list(seed * (STATE_BYTES // len(seed))), dtype=torch.uint8)


@dataclass(frozen=True)
class Scenario:
    layout: Layout
    kv_blocks: int  # KV blocks stored, from the prompt's start
    missing_states: frozenset[tuple[int, int]]  # (rank, position) not stored
    expected_checkpoint: int


SCENARIOS = {
    # Every state stored: the last checkpoint the 341-token prompt allows (its lookup length).
    "complete": Scenario(PLAIN, NUM_HASHES, frozenset(), 320),
    # 320 missing on rank 1 only: 320 is incomplete, the previous checkpoint serves both ranks.
    "rank-hole": Scenario(PLAIN, NUM_HASHES, frozenset({(1, 320)}), 256),
    # KV stored for 208 tokens (13 blocks), states up to 320: the KV evidence bounds the
    # checkpoint at 192, the last one it covers.
    "kv-cap": Scenario(PLAIN, 13, frozenset(), 192),
    # EAGLE drops the last matched block: 320 is no longer legal, the load is from 256.
    "eagle": Scenario(EAGLE, NUM_HASHES, frozenset(), 256),
}


@pytest.fixture
def store(mooncake_master_factory, store_pool_factory, store_client_factory):
    master = mooncake_master_factory(default_kv_lease_ttl=600_000)  # leases outlive the test
    store_pool_factory(master)
    return master, store_client_factory


def save(writer: Any, scenario: Scenario) -> set[str]:
    stored = set()
    for index in range(scenario.kv_blocks):
        assert writer.put(kv_key(index), kv_bytes(index).numpy().tobytes()) == 0
        stored.add(kv_key(index))
    for position in CHECKPOINTS:
        for rank in range(RANKS):
            if (rank, position) in scenario.missing_states:
                continue
            assert writer.put(state_key(rank, position), state_bytes(rank, position).numpy().tobytes()) == 0
            stored.add(state_key(rank, position))
    return stored


class RankBuffers:
    """One TP rank's receive side: its own client, registered KV and Mamba buffers."""

    def __init__(self, client: Any, rank: int, coord: Any) -> None:
        self.client, self.rank = client, rank
        num_kv = NUM_HASHES + 1
        num_states = len(CHECKPOINTS) + 1
        self.kv = torch.zeros((num_kv, KV_BYTES), dtype=torch.uint8)
        self.states = torch.zeros((num_states, STATE_BYTES), dtype=torch.uint8)
        for tensor in (self.kv, self.states):
            assert client.register_buffer(tensor.data_ptr(), tensor.numel()) == 0
        # As upstream's worker builds them: the replicated KV group keyed at tp_rank 0
        # (tp_rank // replication factor), the Mamba group at the rank's own tp_rank.
        kv_db = ChunkedTokenDatabase(KeyMetadata("tiny", 0, 0, 0, 0, group_id=KV), HASH_BLOCK, HASH_BLOCK)
        kv_db.set_kv_caches_base_addr([self.kv.data_ptr()])
        kv_db.set_block_len([KV_BYTES])
        state_db = ChunkedTokenDatabase(KeyMetadata("tiny", rank, 0, 0, 0, group_id=MAMBA), CHECKPOINT,
                                        HASH_BLOCK)
        state_db.set_kv_caches_base_addr([self.states.data_ptr()])
        state_db.set_block_len([STATE_BYTES])
        self.receiver = KVCacheStoreRecvingThread(client, coord, [kv_db, state_db], CHECKPOINT, rank,
                                                  threading.Event(), request_queue=queue.Queue(),
                                                  is_hma_required=True)
        self.receiver.start()
        # Block tables: block id i + 1 for chunk i (0 is vLLM's null block, left untouched).
        self.block_ids = (list(range(1, num_kv)), list(range(1, num_states)))

    def load(self, req_meta: ReqMeta) -> None:
        self.receiver.add_request(req_meta)
        self.receiver.request_queue.join()
        assert self.receiver.get_and_clear_finished_requests() == {req_meta.req_id}
        assert self.receiver.get_and_clear_failed_requests() == set()


def load_metadata(result: Any, block_ids: tuple[list[int], ...]) -> ReqMeta:
    """Upstream's scheduler hand-off: get_num_new_matched_tokens -> update_state_after_alloc ->
    build_connector_meta (ReqMeta.from_request_tracker) -> the worker's start_load_kv."""
    spec = LoadSpec(vllm_cached_tokens=0, kvpool_cached_tokens=result.hit_length, can_load=False,
                    tail_key_boundaries=result.tail_key_boundaries)
    spec.can_load = True  # update_state_after_alloc with the external tokens allocated
    tracker = RequestTracker("req", token_len=result.hit_length,
                             allocated_block_ids=tuple(list(ids) for ids in block_ids),
                             prefill_end_tokens=NUM_TOKENS)
    meta = ReqMeta.from_request_tracker(tracker, CHECKPOINT, load_spec=spec, block_hashes=list(HASHES),
                                        num_prompt_tokens=NUM_TOKENS)
    assert meta is not None and meta.load_spec is spec and not meta.can_save
    meta.load_spec.token_len = meta.load_spec.kvpool_cached_tokens  # start_load_kv
    return meta


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_last_hit_lookup_loads_the_selected_checkpoint_on_every_rank(name, store):
    scenario = SCENARIOS[name]
    master, connect = store
    writer = connect(master)
    stored = save(writer, scenario)

    client = connect(master)
    capabilities = detect_capabilities(client)
    assert capabilities.mooncake_version == "0.3.14"
    worker = build_lookup(scenario.layout, client, MoonleaseConnectorConfig.for_mode(LeaseMode.LAST_HIT_ONLY),
                          capabilities=capabilities)
    result = worker.lookup(NUM_TOKENS, HASHES)

    checkpoint = scenario.expected_checkpoint
    assert result.hit_length == checkpoint
    # Upstream's own lookup over the same stored keys (a recorder: it leases nothing real).
    upstream = build_upstream_lookup(scenario.layout,
                                     RecordingStore(dict.fromkeys(stored, 1)))(NUM_TOKENS, HASHES)
    assert (result.hit_length, result.tail_key_boundaries) == (upstream.hit_length,
                                                               upstream.tail_key_boundaries)

    # The store's own word on leases, before any load (a get would lease what it reads).
    # A non-forced remove of an unleased key succeeds, so the unselected states go away here;
    # the load below then also shows it reads none of them.
    for position in CHECKPOINTS:
        for rank in range(RANKS):
            key = state_key(rank, position)
            if key not in stored:
                continue
            expected = LEASED if position == checkpoint else 0
            assert client.remove(key) == expected, (rank, position)
    # KV keys are leased as upstream leases them (batch_is_exist): every block the load reads.
    kv_leased = {index for index in range(scenario.kv_blocks) if client.remove(kv_key(index)) == LEASED}
    loaded_kv = checkpoint // HASH_BLOCK
    assert set(range(loaded_kv)) <= kv_leased
    assert result.outcome.miss_reason is None
    assert result.outcome.keys_leased == len(kv_leased) + RANKS, "the KV keys and one checkpoint per rank"

    ranks = [RankBuffers(connect(master), rank, worker.coord) for rank in range(RANKS)]
    for rank_buffers in ranks:
        rank_buffers.load(load_metadata(result, rank_buffers.block_ids))

    selected_chunk = checkpoint // CHECKPOINT - 1
    for rank_buffers in ranks:
        rank = rank_buffers.rank
        assert torch.equal(rank_buffers.states[selected_chunk + 1], state_bytes(rank, checkpoint)), rank
        others = [b for b in range(rank_buffers.states.shape[0]) if b != selected_chunk + 1]
        assert not rank_buffers.states[others].any(), f"rank {rank}: only the selected state is loaded"
        for index in range(loaded_kv):
            assert torch.equal(rank_buffers.kv[index + 1], kv_bytes(index)), (rank, index)
        assert not rank_buffers.kv[0].any() and not rank_buffers.kv[loaded_kv + 1:].any(), rank


def test_the_real_store_is_detected_as_per_key_whatever_the_version_string(store):
    """Mooncake 0.3.14 answers LastHitOnly per key. Detection reads that from its answers, so a
    client whose version reads "unknown" (a source build) still hits with every checkpoint
    complete, where reading the version string took it for RFC 4255 and rejected the answer."""
    from moonlease_connector.adapters.mooncake_store import ProbeContractDetector
    from moonlease_connector.core.capabilities import StoreCapabilities
    from moonlease_connector.core.last_hit import ProbeContract

    master, connect = store
    client = connect(master)
    detector = ProbeContractDetector(client, key_prefix="contract-test")
    assert detector.detect() is ProbeContract.PER_KEY_EXISTENCE
    assert list(client.batch_probe_key([f"contract-test@{i}" for i in range(3)], "none", 1)) == [0, 0, 0], \
        "the probe removes its own keys"

    scenario = SCENARIOS["complete"]
    save(connect(master), scenario)
    worker = build_lookup(scenario.layout, client, MoonleaseConnectorConfig.for_mode(LeaseMode.LAST_HIT_ONLY),
                          capabilities=StoreCapabilities("unknown", True, ("none", "LastHitOnly")))
    assert worker.lookup(NUM_TOKENS, HASHES).hit_length == scenario.expected_checkpoint
    assert worker.probe_contract.contract is ProbeContract.PER_KEY_EXISTENCE
