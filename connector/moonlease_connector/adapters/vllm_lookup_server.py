"""The worker's lookup server (rank 0): upstream's wire protocol, with every wait bounded.

I/O adapter. Upstream's `LookupKeyServer` answers the scheduler's lookups and resets on one
thread, and its reset waits for the send queue to drain (`request_queue.join()`) and for
`store.remove_all(force=True)` without a deadline: a wedged save or a frozen master holds that
thread, and every later lookup with it — with synchronous lookups (the default), the scheduler.
`BoundedLookupServer` speaks the same protocol (vLLM's `mooncake/store/protocol.py`) on the same
IPC path; lookups go to the worker and run inline on this thread (the scheduler's
`BoundedLookupClient` waits at most `mooncake_lookup_timeout_ms` for the answer, and misses at
once while one is still out, so a lookup stuck in a frozen store holds no one but itself); a
reset drains saves for at most `drain_s` and gives `remove_all` at most `remove_s` (on a helper
thread, abandoned past it), answering `RESP_ERR` when either runs out. It stops within
`POLL_S` of `close()`, from its own thread (ZMQ sockets are not thread-safe).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
    BlobBlockHashes,
    MooncakeLookupResult,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.protocol import (
    LOOKUP_MSG,
    RESET_MSG,
    RESP_ERR,
    RESP_OK,
    encode_lookup_response,
)
from vllm.utils.network_utils import make_zmq_socket

from moonlease_connector.adapters.exit_guard import native_call
from moonlease_connector.adapters.store_deadline import BoundedCaller, CallStatus

logger = logging.getLogger("vllm.moonlease.connector.lookup_server")

#: Reset budget on the worker: below the scheduler's own reset deadline (60 s), so the
#: scheduler hears a NACK rather than giving up on the socket.
RESET_DRAIN_S = 20.0
RESET_REMOVE_S = 20.0
#: How often the serving thread checks whether it should stop.
POLL_S = 0.1


class BoundedLookupServer:
    """A REP socket on `socket_path` answering LOOKUP and RESET for `store_worker`."""

    def __init__(self, store_worker: Any, socket_path: str, *, drain_s: float = RESET_DRAIN_S,
                 remove_s: float = RESET_REMOVE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store_worker = store_worker
        self.drain_s = drain_s
        self._clock = clock
        self._remover = BoundedCaller(remove_s, name="moonlease-store-reset")
        self.ctx = zmq.Context()
        self._ipc_path = socket_path.removeprefix("ipc://")
        if os.path.exists(self._ipc_path):
            os.unlink(self._ipc_path)
        # A synchronous context makes a synchronous socket (upstream's return type says either).
        self.socket = cast("zmq.Socket[bytes]", make_zmq_socket(self.ctx, socket_path, zmq.REP, bind=True))
        self.running = True
        #: True while a request is being answered (a lookup runs inline, on this thread).
        self.busy = False
        self.thread = threading.Thread(target=self._serve, name="moonlease-lookup-server", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------- serving

    def _serve(self) -> None:
        poll_ms = int(POLL_S * 1000)
        try:
            while self.running:
                if self.socket.poll(poll_ms, zmq.POLLIN):
                    frames = self.socket.recv_multipart(copy=False)
                    self.busy = True
                    try:
                        self.socket.send(self._answer(frames))
                    finally:
                        self.busy = False
            if self.socket.poll(0, zmq.POLLIN):  # a request that arrived while stopping
                self.socket.recv_multipart()
                self.socket.send(RESP_ERR)
        except zmq.ZMQError as error:  # the context was terminated under us
            logger.warning("Moonlease lookup server stopped: %s", error)
        finally:
            self.socket.close(linger=0)

    def _answer(self, frames: list[Any]) -> bytes:
        kind = bytes(frames[0])
        if kind == LOOKUP_MSG:
            try:
                num_tokens = int.from_bytes(frames[1], byteorder="big")
                hash_len = int.from_bytes(frames[2], byteorder="big")
                with native_call():  # the client may stop waiting; interpreter exit will not
                    result = self.store_worker.lookup(num_tokens, BlobBlockHashes(frames[3].buffer, hash_len))
            except Exception:  # a lookup answer must stay a lookup answer: a miss
                logger.exception("Moonlease lookup request failed; answering a miss")
                result = MooncakeLookupResult(0)
            return encode_lookup_response(result)
        if kind == RESET_MSG:
            return RESP_OK if self.reset_store() else RESP_ERR
        logger.warning("Moonlease lookup server received an unknown message %r", kind[:32])
        return RESP_ERR

    def reset_store(self) -> bool:
        """Drain in-flight saves (so none repopulates the store), then `remove_all`; bounded."""
        send_thread = getattr(self.store_worker, "kv_send_thread", None)
        if send_thread is not None:
            deadline = self._clock() + self.drain_s
            while send_thread.request_queue.unfinished_tasks:
                if self._clock() >= deadline:
                    logger.error("Mooncake reset refused: %d save job(s) still in flight after %.0f s",
                                 send_thread.request_queue.unfinished_tasks, self.drain_s)
                    return False
                time.sleep(0.01)
        store = self.store_worker.store
        outcome = self._remover.call(lambda: store.remove_all(force=True))
        if outcome.status is CallStatus.OK:
            logger.info("Mooncake store reset via remove_all succeeded.")
            return True
        if outcome.status is CallStatus.RAISED:
            logger.error("Mooncake remove_all failed: %s", outcome.error)
        else:
            logger.error("Mooncake remove_all did not finish within %.0f s (or an earlier one is "
                         "still out); reset failed", self._remover.timeout_s)
        return False

    # ------------------------------------------------------------- shutdown

    def close(self) -> None:
        """Stop serving (within `POLL_S`, by the serving thread itself) and remove the path."""
        self.running = False
        self.thread.join(timeout=5 * POLL_S + 1.0)
        self._remover.close()
        if os.path.exists(self._ipc_path):
            os.unlink(self._ipc_path)
        if not self.thread.is_alive():
            self.ctx.term()


_STOP_REQUEST = b"moonlease-stop"


class _DropStopRequestWarning(logging.Filter):
    """Upstream's server logs every request it does not know as a warning; ours, sent only to
    wake it for shutdown, is not something an operator should be told about."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.args, tuple) and _STOP_REQUEST in record.args)


def stop_upstream_lookup_server(server: Any, timeout_s: float = 5.0) -> bool:
    """Stop upstream's `LookupKeyServer` (a thread blocked in `recv_multipart`): mark it stopped,
    wake it with one request (it answers RESP_ERR and leaves its loop), then close its socket.

    Returns False, leaving its socket alone, if the thread did not stop (closing a ZMQ socket
    from another thread is not safe); its unlinked IPC path is then simply unreachable.
    """
    server.running = False
    upstream_logger = logging.getLogger(type(server).__module__)
    quiet = _DropStopRequestWarning()
    upstream_logger.addFilter(quiet)
    waker_ctx = zmq.Context()
    try:
        waker = waker_ctx.socket(zmq.REQ)
        waker.setsockopt(zmq.LINGER, 0)
        waker.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        waker.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        waker.connect(f"ipc://{server._ipc_path}")
        try:
            waker.send(_STOP_REQUEST)
            waker.recv()
        except zmq.ZMQError:
            pass
        waker.close(linger=0)
    finally:
        waker_ctx.term()
    server.thread.join(timeout=timeout_s)
    upstream_logger.removeFilter(quiet)
    if server.thread.is_alive():
        logger.warning("upstream's lookup server did not stop; leaving its socket open")
        return False
    server.close()
    server.ctx.term()
    return True
