"""The scheduler side closes its lookup channel: on shutdown, and when it is garbage collected.

Upstream's lookup client never closes its ZMQ context; a lookup the scheduler gave up on (the
lookup deadline passed with no reply) leaves its request queued on a socket that lingers
forever, and garbage collection then terminated that context — and hung for good. Real parts:
our scheduler role built from a real `VllmConfig`, its real ZMQ client over the real IPC path;
on the other end no worker at all, or a REP socket that takes requests and never answers (a
worker stuck in a store call). A hang must fail the test, not block the run: the garbage
collection cases run each in a process of its own under a deadline (forked from one child
interpreter that imports vLLM once: an import is about 15 s on two cores), the shutdown cases on
a thread joined with one. No servers: the shutdown cases are `unit`; the garbage collection
cases `slow`.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import get_zmq_rpc_path_lookup
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

from moonlease_connector.adapters.vllm_connector import MooncakeStoreConnector
from moonlease_connector.adapters.vllm_lookup_client import BoundedLookupClient
from moonlease_dev import devenv
from tests.support.lookup_workers import LAYOUTS


REPO = Path(__file__).resolve().parents[2]
HASHES = [bytes([3, i]) * 4 for i in range(4)]
#: Bounds that catch a hang on a loaded 2-core machine, not a slow step.
SHUTDOWN_S = 30
CHILD_S = 180
_ports = itertools.count(23800)


def build_connector(port: int, timeout_ms: int) -> MooncakeStoreConnector:
    config = VllmConfig(cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
                        kv_transfer_config=KVTransferConfig(
                            kv_connector="MooncakeStoreConnector", kv_role="kv_both",
                            kv_connector_extra_config={"lookup_rpc_port": port,
                                                       "mooncake_lookup_timeout_ms": timeout_ms}))
    groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(LAYOUTS[0].specs)]
    return MooncakeStoreConnector(config, KVConnectorRole.SCHEDULER,
                                  KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups))


class SilentWorker:
    """A REP socket on the lookup path that takes requests and never answers."""

    def __init__(self, config: VllmConfig) -> None:
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(get_zmq_rpc_path_lookup(config))
        self.received = 0

    def take(self, timeout_s: float) -> bool:
        if self.socket.poll(int(timeout_s * 1000), zmq.POLLIN):
            self.socket.recv_multipart()
            self.received += 1
            return True
        return False

    def close(self) -> None:
        self.socket.close(linger=0)
        self.ctx.term()


@pytest.fixture
def rpc_base(vllm_rpc_base: Path) -> Path:
    return vllm_rpc_base


def shut_down_within(connector: MooncakeStoreConnector, seconds: float) -> float:
    """`connector.shutdown()` on a thread; fails (instead of hanging) past `seconds`."""
    started = time.monotonic()
    thread = threading.Thread(target=connector.shutdown, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"shutdown still running after {seconds} s"
    return time.monotonic() - started


def assert_closed(client: BoundedLookupClient) -> None:
    assert client.socket.closed and client.ctx.closed
    deadline = time.monotonic() + SHUTDOWN_S
    while any(thread.is_alive() for thread in client.executor._threads):
        assert time.monotonic() < deadline, "the client's executor thread is still running"
        time.sleep(0.05)


@pytest.mark.unit
def test_shutdown_after_an_abandoned_lookup_closes_socket_context_and_thread(rpc_base):
    connector = build_connector(next(_ports), timeout_ms=200)
    client = connector.connector_scheduler.client
    assert isinstance(client, BoundedLookupClient)
    worker = SilentWorker(connector._vllm_config)
    try:
        assert client.lookup("r1", 64, HASHES).hit_length == 0, "abandoned: a miss"
        assert worker.take(5), "the request reached the worker, which never answers"
        shut_down_within(connector, SHUTDOWN_S)
        assert_closed(client)
        connector.shutdown()  # idempotent
    finally:
        worker.close()


@pytest.mark.unit
def test_shutdown_interrupts_an_unbounded_wait_for_the_worker(rpc_base):
    """Deadline off (upstream's wait): shutdown ends a lookup still waiting, as a miss."""
    connector = build_connector(next(_ports), timeout_ms=0)
    client = connector.connector_scheduler.client
    assert isinstance(client, BoundedLookupClient) and client.timeout_s == 0
    worker = SilentWorker(connector._vllm_config)
    try:
        assert client.lookup("r1", 64, HASHES, non_block=True) is None, "in flight"
        assert worker.take(5)
        shut_down_within(connector, SHUTDOWN_S)
        assert client.lookup("r1", 64, HASHES, non_block=True).hit_length == 0
        assert_closed(client)
    finally:
        worker.close()


CHILD = textwrap.dedent("""
    import gc, json, os, signal, sys, time, traceback
    from tests.connector.test_scheduler_teardown import build_connector, HASHES, SilentWorker

    def drop(port, with_worker):
        connector = build_connector(port, timeout_ms=200)
        scheduler = connector.connector_scheduler
        worker = SilentWorker(connector._vllm_config) if with_worker else None
        assert scheduler.client.lookup("r1", 64, HASHES).hit_length == 0
        if worker is not None:
            assert worker.take(5)
        connector.connector_scheduler = None  # the scheduler alone is dropped; its connector too
        del connector
        started = time.monotonic()
        del scheduler
        gc.collect()
        print(f"dropped in {time.monotonic() - started:.2f} s", flush=True)
        if worker is not None:
            worker.close()

    deadline_s = float(sys.argv[1])
    for peer, port in zip(sys.argv[2::2], sys.argv[3::2]):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # a fresh process per case, vLLM already imported
            os.close(read)
            os.dup2(write, 1)
            os.dup2(write, 2)
            try:
                drop(int(port), peer == "silent-worker")
                sys.stdout.flush()
                os._exit(0)
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
                os._exit(1)
        os.close(write)
        os.set_blocking(read, False)
        output, status, ends = b"", None, time.monotonic() + deadline_s
        while status is None and time.monotonic() < ends:
            try:
                output += os.read(read, 65536)
            except BlockingIOError:
                pass
            done, code = os.waitpid(pid, os.WNOHANG)
            status = os.waitstatus_to_exitcode(code) if done else None
            time.sleep(0.05)
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        try:
            output += os.read(read, 1 << 20)
        except BlockingIOError:
            pass
        os.close(read)
        print(json.dumps({"peer": peer, "exit": status, "output": output.decode(errors="replace")}), flush=True)
""")
PEERS = ("no-worker", "silent-worker")


@pytest.fixture(scope="module")
def dropped() -> Iterator[dict[str, dict]]:
    """One child interpreter imports vLLM once and forks a fresh process per case, each under
    its own deadline (`CHILD_S`; killed past it): peer -> its exit status (None: killed) and
    output. A hang fails that case's test, never the run. Its IPC sockets go to a short folder
    of its own (`vllm_rpc_base`'s reason)."""
    rpc_base = tempfile.mkdtemp(prefix="moonlease-rpc-")
    env = dict(os.environ, VLLM_RPC_BASE_PATH=rpc_base,
               PYTHONPATH=devenv.source_pythonpath(then=os.environ.get("PYTHONPATH")))
    cases = [value for peer in PEERS for value in (peer, str(next(_ports)))]
    try:
        child = subprocess.run([sys.executable, "-c", CHILD, str(CHILD_S), *cases], cwd=REPO,
                               env=env, capture_output=True, text=True, timeout=CHILD_S * (len(PEERS) + 1))
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"the child interpreter did not finish: {(expired.stderr or b'')[-2000:]!r}")
    finally:
        shutil.rmtree(rpc_base, ignore_errors=True)
    assert child.returncode == 0, child.stderr[-4000:]
    results = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
    yield {result["peer"]: result for result in results}


@pytest.mark.slow
@pytest.mark.parametrize("peer", PEERS)
def test_dropping_a_scheduler_after_an_abandoned_lookup_finishes(dropped, peer):
    """In a process of its own, under a deadline: the hang was in garbage collection itself."""
    result = dropped[peer]
    if result["exit"] is None:
        pytest.fail(f"dropping the scheduler hung (no exit within {CHILD_S} s): {result['output'][-2000:]}")
    assert result["exit"] == 0, result["output"][-4000:]
    assert "dropped in" in result["output"], result["output"]
    dropped_s = float(result["output"].split("dropped in ")[1].split(" s")[0])
    assert dropped_s < SHUTDOWN_S, result["output"]
