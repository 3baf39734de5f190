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

from moonlease_connector import MooncakeStoreConnector as MoonleaseConnector
from tests.support.save_gate import GATE_WAIT_LIMIT_S, SAVE_GATE_ENV, held_file, open_file

logger = logging.getLogger("vllm.moonlease.tests.gated_saves")

_upstream_handle_request = KVCacheStoreSendingThread._handle_request


def _gate_closed() -> bool:
    gate = os.environ.get(SAVE_GATE_ENV)
    return bool(gate) and not open_file(Path(gate)).exists()


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


class MooncakeStoreConnector(MoonleaseConnector):
    """Moonlease's connector, but an engine whose save is held at a closed gate goes idle.

    Upstream keeps an engine stepping while a save job still pins blocks (its completion reaches
    the scheduler only on a step); with the save held, that busy loop (engine core and worker
    spinning on their shared-memory queue) takes both cores of a 2-core machine and starves the
    decode engine the test is waiting for. The held save itself runs on the worker's send thread
    whether the engine steps or not; its blocks go back on the engine's next request."""

    def has_pending_push_work(self) -> bool:
        return False if _gate_closed() else super().has_pending_push_work()


__all__ = ["MooncakeStoreConnector"]
