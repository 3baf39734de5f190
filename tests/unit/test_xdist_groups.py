"""`make test`'s worker groups (tests/support/xdist_groups.py), on a small suite run on two real
pytest-xdist workers: engine tests share one worker, the operator tests share one with the
module that reads their calls (which runs after them), a module's tests stay together, and the
tests of a module that lets each go alone (`XDIST_EACH_TEST`) spread over both workers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

RECORD = """
import json, os, pathlib, time
import pytest

def record(name):
    with open(os.environ["GROUPS_LOG"], "a") as log:
        log.write(json.dumps([name, os.environ["PYTEST_XDIST_WORKER"], time.monotonic()]) + "\\n")
    time.sleep(0.1)
"""


def test_groups_share_a_worker_and_the_operator_calls_reader_runs_last(pytester: pytest.Pytester,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    log = pytester.path / "groups.log"
    monkeypatch.setenv("GROUPS_LOG", str(log))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    pytester.makeconftest('pytest_plugins = ["tests.support.xdist_groups"]\n' + RECORD)
    pytester.makeini("[pytest]\nmarkers =\n    vllm: engines\n")
    for name in ("engine_a", "engine_b"):
        pytester.makepyfile(**{f"test_{name}": "from conftest import record\nimport pytest\n" + "".join(
            f"@pytest.mark.vllm\ndef test_{i}():\n    record('{name}')\n" for i in range(4))})
    for name in ("plain_a", "plain_b", "plain_c"):
        pytester.makepyfile(**{f"test_{name}": "from conftest import record\n" + "".join(
            f"def test_{i}():\n    record('{name}')\n" for i in range(4))})
    operator = pytester.path / "tests" / "operator"  # no package: the real `tests` stays importable
    operator.mkdir(parents=True)
    for name in ("op_a", "op_b"):
        (operator / f"test_{name}.py").write_text("from conftest import record\n" + "".join(
            f"def test_{i}():\n    record('{name}')\n" for i in range(3)))
    # long tests that go alone: with one second each, both workers, free by then, take some
    pytester.makepyfile(test_alone="from conftest import record\nimport time\nXDIST_EACH_TEST = True\n" + "".join(
        f"def test_{i}():\n    record('alone')\n    time.sleep(1.0)\n" for i in range(4)))
    pytester.makepyfile(test_0_reads_calls="from conftest import record\nRUN_AFTER_OPERATOR_TESTS = True\n"
                        "def test_reads():\n    record('reader')\n")
    # what tests/chart/conftest.py does in the real suite: the reader goes last
    (pytester.path / "conftest.py").write_text((pytester.path / "conftest.py").read_text() + """
def pytest_collection_modifyitems(config, items):
    late = [i for i in items if getattr(i.module, "RUN_AFTER_OPERATOR_TESTS", False)]
    items[:] = [i for i in items if i not in late] + late
""")

    result = pytester.runpytest_subprocess("-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4 * 2 + 4 * 3 + 3 * 2 + 1 + 4)
    runs = [json.loads(line) for line in log.read_text().splitlines()]
    workers: dict[str, set[str]] = {}
    for name, worker, _ in runs:
        workers.setdefault(name, set()).add(worker)
    alone = workers.pop("alone")
    assert all(len(w) == 1 for w in workers.values()), workers  # each module on one worker
    assert len(alone) == 2, alone  # the module that lets each test go alone: on both
    assert workers["engine_a"] == workers["engine_b"]
    assert workers["op_a"] == workers["op_b"] == workers["reader"]
    reader_at = next(at for name, _, at in runs if name == "reader")
    assert all(at < reader_at for name, _, at in runs if name in ("op_a", "op_b"))
    assert len({w for ws in workers.values() for w in ws}) == 2  # and both workers had work
