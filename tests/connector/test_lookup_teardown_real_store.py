"""Both ends of the lookup channel are dropped after a lookup abandoned on a frozen real master,
and the interpreter collects them and exits.

`test_scheduler_teardown` drops the scheduler with no worker, or a socket that never answers.
Here the other end is the worker's side as it runs: our `BoundedLookupServer` answering with a
real lookup object over a real 0.3.14 client of a real master (the server runs lookups inline,
as on rank 0 behind the scheduler's bounded client). The master is frozen (SIGSTOP) while a
lookup is out, so the server's thread is inside Mooncake's call when the scheduler gives up on
it. Then every reference — scheduler, server, lookup, store client — is dropped and garbage
collected while the master is still frozen, the master thaws, and the interpreter exits.
A hang (in garbage collection, in a ZMQ context's termination, in the store client's
destructor at exit) would never return, so it all runs in a child interpreter under a timeout:
the parent asserts the exit status and the time.

The second case resumes the master only once the interpreter has begun to exit: the abandoned
lookup then returns during finalization, where CPython 3.11 ends the returning thread with
`pthread_exit` through pybind11's `noexcept` GIL guard and the process aborts (exit -6,
"terminate called without an active exception") unless exit waits for the call (`exit_guard`).
Without the guard it aborted 15 times in 16 with the master resumed 0 to 0.8 s into the exit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from moonlease_dev import devenv
from tests.connector.test_scheduler_teardown import HASHES, SHUTDOWN_S, _ports, rpc_base  # noqa: F401

pytestmark = [pytest.mark.store, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
KEYS = [f"tiny@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{h.hex()}" for h in HASHES]
#: The child imports vLLM (about 15 s on two cores), connects, waits out one lookup deadline and
#: drops everything: a bound that catches a hang on a loaded 2-core machine, not a slow step.
CHILD_S = 180

CHILD = textwrap.dedent("""
    import contextlib, gc, subprocess, sys, time
    from types import SimpleNamespace
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import get_zmq_rpc_path_lookup
    from moonlease_connector.adapters.vllm_lookup_server import BoundedLookupServer
    from moonlease_dev.testbed.mooncake import connect_store_client
    from tests.connector.test_scheduler_teardown import build_connector, HASHES
    from tests.support.freeze import frozen
    from tests.support.lookup_workers import LAYOUTS, build_lookup

    port, master_address, master_pid = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    resume_during_exit_s = float(sys.argv[4]) if len(sys.argv) > 4 else None
    connector = build_connector(port, timeout_ms=300)
    scheduler = connector.connector_scheduler
    store = connect_store_client(SimpleNamespace(rpc_address=master_address))
    lookup = build_lookup(LAYOUTS[0], store)  # inline, no deadline of its own: the client's
    worker = SimpleNamespace(lookup=lambda n, h: lookup.lookup(n, h).result, store=store,
                             kv_send_thread=None)
    server = BoundedLookupServer(worker, get_zmq_rpc_path_lookup(connector._vllm_config))
    assert scheduler.client.lookup("r1", 64, HASHES).hit_length == 48, "the master answers"
    with contextlib.ExitStack() as thaw:
        thaw.enter_context(frozen(master_pid))
        started = time.monotonic()
        assert scheduler.client.lookup("r2", 64, HASHES).hit_length == 0, "abandoned: a miss"
        assert time.monotonic() - started < 30, "within the client's deadline"
        deadline = time.monotonic() + 10
        while not server.busy and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.busy, "the server's thread is inside the frozen store call"
        connector.connector_scheduler = None
        del connector, scheduler, worker, server, lookup, store
        started = time.monotonic()
        gc.collect()
        print(f"dropped in {time.monotonic() - started:.2f} s", flush=True)
        if resume_during_exit_s is not None:  # stay frozen; resumed once exit has begun
            thaw.pop_all()
            subprocess.Popen(["sh", "-c", f"sleep {resume_during_exit_s}; kill -CONT {master_pid}"])
    print(f"exiting at {time.monotonic():.3f}", flush=True)  # (the clock is system-wide)
""")


@pytest.mark.parametrize("resume_during_exit_s", [None, 0.2],
                         ids=["master-resumed-before-exit", "master-resumed-during-exit"])
def test_dropping_both_ends_after_a_lookup_abandoned_on_a_frozen_master_exits(
        resume_during_exit_s, rpc_base, mooncake_master, store_pool, store_client_factory):  # noqa: F811
    writer = store_client_factory(mooncake_master)
    for key in KEYS:
        assert writer.put(key, b"kv" * 32) == 0
    env = dict(os.environ, PYTHONPATH=devenv.source_pythonpath(then=os.environ.get("PYTHONPATH")))
    started = time.monotonic()
    try:
        child = subprocess.run(
            [sys.executable, "-c", CHILD, str(next(_ports)), mooncake_master.rpc_address,
             str(mooncake_master.process.pid),
             *([] if resume_during_exit_s is None else [str(resume_during_exit_s)])],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=CHILD_S)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"the child did not exit within {CHILD_S} s: {(expired.stdout or b'')[-1000:]!r} "
                    f"{(expired.stderr or b'')[-3000:]!r}")
    finally:
        os.kill(mooncake_master.process.pid, signal.SIGCONT)  # whatever the child left
    exited = time.monotonic()
    assert child.returncode == 0, child.stdout[-2000:] + child.stderr[-4000:]
    assert "exiting at " in child.stdout, child.stdout
    dropped_s = float(child.stdout.split("dropped in ")[1].split(" s")[0])
    assert dropped_s < SHUTDOWN_S, child.stdout
    exit_s = exited - float(child.stdout.split("exiting at ")[1].split()[0])
    assert exit_s < SHUTDOWN_S, f"the interpreter took {exit_s:.1f} s to exit: {child.stdout}"
    assert exited - started < CHILD_S
