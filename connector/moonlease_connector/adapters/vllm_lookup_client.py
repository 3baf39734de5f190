"""The scheduler's lookup client with the lookup deadline: upstream's `LookupKeyClient`, bounded.

I/O adapter; the decisions (send, miss at once, probe) come from `core.lookup_breaker`.
Upstream's client sends each lookup over a ZMQ REQ socket to worker rank 0 and waits for the
reply forever: a worker stuck in a Mooncake call (a frozen master) or gone holds the
scheduler's synchronous lookups — and with them every request — for as long as it lasts.
`BoundedLookupClient` waits at most `mooncake_lookup_timeout_ms`; past it the lookup is a miss
(`store_timeout`), and while that request is still out later lookups miss at once, until the
worker answers (`core.lookup_breaker`). The worker therefore runs its lookups inline, with no
thread hand-off of its own.

Same wire frames as upstream; synchronous and asynchronous lookups both go through `_lookup`
on the client's one executor thread, which alone touches the socket (resets too:
`reset_within`). `mooncake_lookup_timeout_ms: 0` is upstream's unbounded wait.

Teardown: upstream's client opens a ZMQ context, a REQ socket and an executor thread and never
closes the context; a request left unanswered (an abandoned lookup) stays queued on a socket
that lingers forever, so terminating that context — `close()` or garbage collection alike —
blocks for good. Our sockets never linger, and `close()` (also run on garbage collection)
closes the socket on the executor thread, which owns it, and then terminates the context.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, cast

import zmq
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import MooncakeLookupResult
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.protocol import (
    LOOKUP_MSG,
    RESET_MSG,
    RESP_OK,
    decode_lookup_response,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import (
    LookupKeyClient,
    get_zmq_rpc_path_lookup,
)
from vllm.utils.network_utils import make_zmq_socket

from moonlease_connector.core.lookup_breaker import (
    CLOSED,
    Breaker,
    BreakerState,
    LookupStep,
    after_reply,
    after_timeout,
    decide_lookup,
    probe_after_s_for,
)

logger = logging.getLogger("vllm.moonlease.connector.lookup_client")

#: How long `close()` waits for the executor thread to close the socket and for the context to
#: terminate (a wait for the worker in progress is interrupted by the termination).
CLOSE_WAIT_S = 5.0


class BoundedLookupClient(LookupKeyClient):
    """Upstream's lookup client; every wait for the worker bounded (`timeout_s`; 0: unbounded).

    `on_miss` is told each lookup this client answered a miss by itself (no reply in time, or
    one still out); the scheduler counts them as `store_timeout` misses.
    """

    socket: zmq.Socket[bytes]  # made on a synchronous context (upstream types it either way)

    def __init__(self, vllm_config: VllmConfig, *, timeout_s: float,
                 on_miss: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0, got {timeout_s}")
        super().__init__(vllm_config)
        # A request the worker never answers must not hold the context's termination.
        self.socket.setsockopt(zmq.LINGER, 0)
        self._closed = False
        self._socket_path = get_zmq_rpc_path_lookup(vllm_config)
        self.timeout_s = timeout_s
        self.probe_after_s = probe_after_s_for(timeout_s)
        self.on_miss = on_miss
        self._clock = clock
        #: Touched by the executor thread only (read elsewhere for reporting).
        self.breaker: Breaker = CLOSED

    @property
    def breaker_state(self) -> BreakerState:
        return self.breaker.state(self._clock(), self.probe_after_s)

    # ---------------------------------------------------------------- lookup

    def _lookup(self, num_tokens: int, block_hashes: list[Any]) -> MooncakeLookupResult:
        hash_len = len(block_hashes[0]) if block_hashes else 0
        frames = (LOOKUP_MSG, num_tokens.to_bytes(4, byteorder="big"),
                  hash_len.to_bytes(2, byteorder="big"), b"".join(block_hashes))
        reply = self._exchange(frames)
        if reply is None:
            if self.on_miss is not None:
                self.on_miss()
            return self._missed()
        return self._decode(reply)

    def _decode(self, reply: bytes) -> MooncakeLookupResult:
        """Upstream's response reader (subclasses read more of the response)."""
        return decode_lookup_response(reply)

    def _missed(self) -> MooncakeLookupResult:
        """The answer to a lookup the worker did not answer in time."""
        return MooncakeLookupResult(0)

    def _exchange(self, frames: tuple[bytes, ...]) -> bytes | None:
        """One lookup request's reply, or None: not sent, or no reply within the deadline."""
        if not self.timeout_s:  # deadline off: upstream's wait
            self.socket.send_multipart(frames, copy=False)
            return self.socket.recv()
        now = self._clock()
        out_since = self.breaker.outstanding_since
        late = out_since is not None and self._take_late_reply()
        step, self.breaker = decide_lookup(self.breaker, now=now, late_reply_arrived=late,
                                           probe_after_s=self.probe_after_s)
        if late:
            logger.info("Worker rank 0 answers lookups again (its late reply was dropped)")
        if step is LookupStep.MISS:
            return None
        if step is LookupStep.PROBE:
            logger.warning("No reply from worker rank 0 for %.1f s; probing on a fresh lookup "
                           "channel (lookups keep missing until it answers)",
                           now - (out_since if out_since is not None else now))
            self._replace_socket()
            if not self._send(frames):
                self.breaker = CLOSED  # nothing out: the next lookup tries again
            return None
        if not self._send(frames):
            return None
        if self.socket.poll(int(self.timeout_s * 1000), zmq.POLLIN):
            self.breaker = after_reply()
            return self.socket.recv()
        self.breaker = after_timeout(now)
        logger.warning("Worker rank 0 did not answer a lookup within %d ms; reporting a miss "
                       "(later lookups miss at once until it answers)", int(self.timeout_s * 1000))
        return None

    def _send(self, frames: tuple[bytes, ...]) -> bool:
        """Queue the request without blocking; False when ZMQ cannot take it now."""
        try:
            self.socket.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("Lookup channel to worker rank 0 not ready; reporting a miss")
            return False
        return True

    def _take_late_reply(self) -> bool:
        """Drop the reply to the request that is out, if it has come; True if it had."""
        if not self.socket.poll(0, zmq.POLLIN):
            return False
        self.socket.recv()
        return True

    def _replace_socket(self) -> None:
        """A fresh REQ socket on the same path (a REQ socket owes its reply; this one is dropped).
        Called by the executor thread, which owns the socket."""
        self.socket.close(linger=0)
        self.socket = cast("zmq.Socket[bytes]", make_zmq_socket(self.ctx, self._socket_path, zmq.REQ, bind=False,
                                                                   linger=0))

    # ----------------------------------------------------------------- reset

    def reset_within(self, timeout_s: float) -> bool:
        """Upstream's reset request (`remove_all` on worker rank 0) with a deadline.

        Runs on the executor thread. A lookup still out is waited for first (the worker answers
        in order), within the same budget. Past the deadline the socket, which still owes a
        reply, is replaced by a fresh one, so later lookups are unaffected; the reset reports
        failure.
        """
        started = self._clock()
        if self.breaker.outstanding_since is not None:
            if not self.socket.poll(int(timeout_s * 1000), zmq.POLLIN):
                self._replace_socket()
                self.breaker = CLOSED
                return False
            self.socket.recv()
            self.breaker = CLOSED
        left_s = max(0.0, timeout_s - (self._clock() - started))
        self.socket.send(RESET_MSG)
        if self.socket.poll(int(left_s * 1000), zmq.POLLIN):
            return bytes(self.socket.recv()) == RESP_OK
        self._replace_socket()
        return False

    # -------------------------------------------------------------- teardown

    def close(self) -> None:
        """Release the socket, the executor thread and the context; idempotent, bounded.

        Lookups not yet started are cancelled (their callers get a miss); the socket is closed
        by the executor thread once the lookup it runs returns. Terminating the context, on a
        helper thread, interrupts a wait for the worker still in progress (the lookup fails
        into a miss) so that the close can run; if the executor thread is held elsewhere past
        `CLOSE_WAIT_S`, the context is left to the process (logged), never waited for.
        """
        if self.__dict__.get("_closed", True):
            return  # closed already, or not built by our constructor
        self._closed = True
        for future in list(self.futures.values()):
            future.cancel()
        try:
            closing: Future[None] | None = self.executor.submit(self._close_socket)
        except RuntimeError:  # the executor was shut down already: its thread is gone
            closing = None
        self.executor.shutdown(wait=False)
        terminator = threading.Thread(target=self.ctx.term, name="moonlease-lookup-client-close",
                                      daemon=True)
        terminator.start()
        if closing is not None and self._executor_alive():
            with contextlib.suppress(Exception):
                closing.result(timeout=CLOSE_WAIT_S)
        # Not picked up: the executor thread is gone (garbage collection clears the executor's
        # weak reference first, and its thread leaves) or held; the socket is closed here.
        if closing is None or closing.cancel():
            self._close_socket()
        terminator.join(CLOSE_WAIT_S)
        if terminator.is_alive():
            logger.warning("The scheduler's lookup channel did not close within %.0f s; "
                           "leaving it to the process", CLOSE_WAIT_S)

    def _executor_alive(self) -> bool:
        return any(thread.is_alive() for thread in getattr(self.executor, "_threads", ()))

    def _close_socket(self) -> None:
        self.socket.close(linger=0)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter teardown: modules may be gone already
            pass
