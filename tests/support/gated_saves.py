"""Test-only connector module: Moonlease's connector whose save jobs wait at a gate the test
opens (`tests.support.save_gate`).

Loaded by an engine as `kv_connector_module_path: "tests.support.gated_saves"`. vLLM answers a
prefill request before the connector's asynchronous save has run, so a P/D test relying on
timing shows decode's wait for the promised save only when the machine happens to be slow (and
a fixed delay only when it is fast enough). Holding the save until the test has seen decode look
the prompt up and miss makes the race certain on any machine. The gate is checked on the
worker's send thread, before upstream's job handling (puts included).

Never import this module into a test process: it patches upstream's send thread in whatever
process imports it.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import KVCacheStoreSendingThread

from moonlease_connector import MooncakeStoreConnector
from tests.support.save_gate import GATE_WAIT_LIMIT_S, SAVE_GATE_ENV, held_file, open_file

logger = logging.getLogger("vllm.moonlease.tests.gated_saves")

_upstream_handle_request = KVCacheStoreSendingThread._handle_request


def _wait_at_gate() -> None:
    gate = os.environ.get(SAVE_GATE_ENV)
    if not gate:
        return
    opened = open_file(Path(gate))
    if not opened.exists():
        held_file(Path(gate)).touch()
    deadline = time.monotonic() + GATE_WAIT_LIMIT_S
    while not opened.exists():
        if time.monotonic() > deadline:
            logger.warning("The save gate %s stayed closed for %.0f s: saving anyway", gate, GATE_WAIT_LIMIT_S)
            return
        time.sleep(0.01)


def _gated_handle_request(self: Any, req_meta: Any) -> Any:
    _wait_at_gate()
    return _upstream_handle_request(self, req_meta)


KVCacheStoreSendingThread._handle_request = _gated_handle_request  # type: ignore[method-assign]

__all__ = ["MooncakeStoreConnector"]
