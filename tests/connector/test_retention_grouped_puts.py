"""Retention puts parts of a batch that upstream configured per key (a real Mooncake 0.3.14).

With `enable_group_semantics`, upstream's save sets `ReplicateConfig.group_ids`, one entry per
key of the batch; Mooncake refuses, with INVALID_PARAMS for every key, a batch whose list is not
as long as its keys. Retention `pin` puts the pinned keys apart from the others and `retry` puts
the refused ones again, so each part must carry only its own keys' entries: otherwise every
save of a mixed batch is lost (each save looks stored to nothing, and the next turn misses).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from moonlease_connector.adapters.mooncake_store import config_for_keys
from moonlease_connector.adapters.vllm_retention import _RetentionStore
from moonlease_connector.core.put_retry import PutRetryPolicy
from moonlease_dev.testbed.mooncake import MasterSettings

pytestmark = pytest.mark.store

VALUE = 4096


def test_pinned_and_plain_parts_of_a_grouped_batch_are_each_stored(
        mooncake_master_factory: Callable[..., Any], store_pool_factory: Callable[..., Any],
        store_client_factory: Callable[..., Any]) -> None:
    from mooncake.store import ReplicateConfig

    master = mooncake_master_factory(MasterSettings())
    store_pool_factory(master, segment_bytes=16 << 20)
    client = store_client_factory(master)
    buffer = torch.arange(4 * VALUE, dtype=torch.int32).to(torch.uint8)
    assert client.register_buffer(buffer.data_ptr(), buffer.numel()) == 0
    keys = [f"grouped-{i}" for i in range(4)]
    addrs = [[buffer.data_ptr() + i * VALUE] for i in range(4)]
    sizes = [[VALUE]] * 4
    config = ReplicateConfig()
    config.group_ids = [f"group-{i % 2}" for i in range(4)]
    config.replica_num = 1

    events: list[tuple[str, int]] = []
    store = _RetentionStore(client, lambda key: key in (keys[0], keys[2]),
                            lambda decision, count: events.append((decision, count)),
                            retry=lambda: PutRetryPolicy(attempts=1, delay_s=0.0))
    assert store.batch_put_from_multi_buffers(keys, addrs, sizes, config) == [0, 0, 0, 0]
    assert client.batch_is_exist(keys) == [1, 1, 1, 1]
    assert config.group_ids == ["group-0", "group-1", "group-0", "group-1"], "upstream's config untouched"

    # The same cut for a retry's part: entries of the refused keys only, other fields kept.
    part = config_for_keys(config, [1, 3], 4)
    assert part.group_ids == ["group-1", "group-1"] and part.replica_num == 1
    assert config_for_keys(config, range(4), 4) is config, "a whole batch keeps upstream's config"

    # What happened before the cut: a part carrying the whole batch's list is refused by Mooncake.
    whole = ReplicateConfig()
    whole.group_ids = ["group-0", "group-1", "group-0"]
    refused = client.batch_put_from_multi_buffers(["grouped-x", "grouped-y"], addrs[:2], sizes[:2], whole)
    assert all(code < 0 for code in refused)
