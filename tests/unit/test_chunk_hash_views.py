"""The lookup reads vLLM's chunk-hash views in one slice, whatever holds the hashes.

The lookup server hands the lookup a `BlobBlockHashes` (one flat buffer); in-process callers a
list of `bytes`. Both, through vLLM's own per-group view, must give the same chunk hashes as
indexing the view one chunk at a time.
"""

from __future__ import annotations

import os

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    BlobBlockHashes,
    chunk_hashes_for_block_size,
)

from moonlease_connector.adapters.vllm_lookup import _first_chunk_hashes

pytestmark = pytest.mark.unit

HASHES = [os.urandom(32) for _ in range(37)]


@pytest.mark.parametrize("holder", ["list", "blob"])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("chunks", [0, 1, 5, 9, 40])
def test_chunk_hashes_equal_vllms_view_indexed_one_by_one(holder, block_size, chunks) -> None:
    hashes = list(HASHES) if holder == "list" else BlobBlockHashes(memoryview(b"".join(HASHES)), 32)
    view = chunk_hashes_for_block_size(hashes, 16, block_size)
    expected = [bytes(view[index]) for index in range(min(chunks, len(view)))]
    read = _first_chunk_hashes(view, chunks)
    assert read == expected
    assert all(type(chunk_hash) is bytes for chunk_hash in read)
