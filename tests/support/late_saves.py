"""Test-only connector module: Moonlease's connector whose saves land `SAVE_DELAY_S` late.

Loaded by an engine as `kv_connector_module_path: "tests.support.late_saves"`. vLLM answers a
prefill request before the connector's asynchronous save has run; on an idle machine the save
usually wins the race against the router's decode request anyway, so a P/D test that relies on
timing shows the hand-off only when the machine happens to be slow. Holding every save job back
makes the race certain: without the decode engine's wait for the promised save, its lookup finds
nothing. The delay runs on the worker's send thread, before upstream's job handling (puts
included), in every process that imports this module.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import KVCacheStoreSendingThread

from moonlease_connector import MooncakeStoreConnector

#: Seconds each save job waits before it starts putting.
SAVE_DELAY_S = 0.5

_upstream_handle_request = KVCacheStoreSendingThread._handle_request


def _late_handle_request(self: Any, req_meta: Any) -> Any:
    time.sleep(SAVE_DELAY_S)
    return _upstream_handle_request(self, req_meta)


KVCacheStoreSendingThread._handle_request = _late_handle_request  # type: ignore[method-assign]

__all__ = ["MooncakeStoreConnector", "SAVE_DELAY_S"]
