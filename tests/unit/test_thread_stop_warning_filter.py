"""pyproject.toml's `filterwarnings` silences the SystemExit that `stop_transfer_threads` ends
upstream's transfer threads with (Python's own thread excepthook ignores it; pytest's reports
it) and nothing else: a real exception in a transfer thread must still warn. A small suite run
by a real pytest (subprocess) with exactly the project's filter."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

SUITE = """
import queue, threading
from moonlease_connector.adapters.vllm_threads import _StopRequest

def _run(target):
    thread = threading.Thread(target=target, name="KVCacheStoreSendingThread")
    thread.start()
    thread.join()

def test_stopped_by_our_request():
    requests = queue.Queue()
    requests.put(None)
    requests.get()
    _run(lambda: _StopRequest(requests).req_id)  # what upstream's handler reads first

def test_a_real_failure():
    def fail():
        raise ValueError("a real failure in a transfer thread")
    _run(fail)
"""


def test_only_our_stop_request_is_silenced(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    filters = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["filterwarnings"]
    assert filters, "pyproject.toml declares the filter"
    pytester.makeini("[pytest]\nfilterwarnings =\n" + "".join(f"    {line}\n" for line in filters))
    pytester.makepyfile(test_threads=SUITE)
    monkeypatch.setenv("PYTHONPATH", str(REPO / "connector"))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, warnings=1)
    result.stdout.fnmatch_lines(["*PytestUnhandledThreadExceptionWarning*KVCacheStoreSendingThread*",
                                 "*ValueError: a real failure in a transfer thread*"])
    assert "SystemExit" not in result.stdout.str()
