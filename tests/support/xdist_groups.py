"""pytest plugin: `make test` runs on two pytest-xdist workers, with tests grouped onto workers.

Most tiers wait on servers and timers (Prometheus scrapes, kopf's intervals, the A/B tests'
5-second minimum), so two tests at a time overlap those waits. Some tests must share a process:

* `engines` (`vllm`): one vLLM engine at a time, on one worker. An engine takes every core it
  gets, and vLLM allows one per process (tests/fixtures/vllm.py's session-shared engine).
* `operator-api-calls`: tests/chart/test_rbac.py checks the API calls of the operator tests that
  ran before it in its process (tests/fixtures/kube.py records them), so all of them run there.
* `images` (`images`): the images are built once per process (tests/images/conftest.py).
* a module that sets `XDIST_EACH_TEST = True` (long tests that share no fixture beyond the
  session's: the upstream suites' subprocess runs of tests/compat) has each test go alone, so
  both workers share that module's tests instead of one worker running all of them at the end;
* every other test goes with its module, so a module-scoped fixture (a benchmark's run, an
  install) is set up once.

xdist's own `--dist loadgroup` puts the group into the test's node id, which pytest 9's
structured node ids ignore; so the workers write {node id: group} to a folder the controller
names, and the controller's scheduler (xdist's scope scheduler) reads its scopes from there.
The groups go out in the order above, then the tests that go alone, then the modules: the
long ones start at once, on different workers, and the short modules fill in around them.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

GROUPS: dict[str, Callable[[pytest.Item], bool]] = {
    "engines": lambda item: item.get_closest_marker("vllm") is not None,
    "operator-api-calls": lambda item: item.nodeid.startswith("tests/operator/") or bool(getattr(
        getattr(item, "module", None), "RUN_AFTER_OPERATOR_TESTS", False)),
    "images": lambda item: item.get_closest_marker("images") is not None,
}
_FOLDER_KEY = "moonlease_xdist_groups"


def _alone(item: pytest.Item) -> bool:
    return bool(getattr(getattr(item, "module", None), "XDIST_EACH_TEST", False))


def group_of(item: pytest.Item) -> str:
    """The first of `GROUPS` the test belongs to, else the test itself (`XDIST_EACH_TEST`),
    else its module."""
    found = next((name for name, member in GROUPS.items() if member(item)), None)
    if found is not None:
        return found
    return item.nodeid if _alone(item) else item.nodeid.split("::", 1)[0]


def _rank(item: pytest.Item) -> int:
    group = group_of(item)
    if group in GROUPS:
        return list(GROUPS).index(group)
    return len(GROUPS) if _alone(item) else len(GROUPS) + 1


def _workerinput(config: pytest.Config) -> dict[str, Any] | None:
    return getattr(config, "workerinput", None)


_folder = pytest.StashKey[Path]()


def pytest_configure(config: pytest.Config) -> None:
    """On the controller of a run on workers: the folder the workers write their groups to."""
    if _workerinput(config) is None and config.getoption("numprocesses", None):
        config.stash[_folder] = Path(tempfile.mkdtemp(prefix="moonlease-xdist-groups-"))


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(_folder, None)
    if folder is not None:
        for path in folder.iterdir():
            path.unlink()
        folder.rmdir()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """The controller tells each worker where to write its groups."""
    node.workerinput[_FOLDER_KEY] = str(node.config.stash[_folder])


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a worker, the groups first, in `GROUPS` order, then the tests that go alone (a stable
    sort: each group and module keeps its own order, tests/chart/conftest.py's included)."""
    if _workerinput(config) is not None:
        items.sort(key=_rank)


@pytest.hookimpl(tryfirst=True)  # before xdist's worker sends its collection to the controller
def pytest_collection_finish(session: pytest.Session) -> None:
    workerinput = _workerinput(session.config)
    if workerinput is None or _FOLDER_KEY not in workerinput:
        return
    folder = Path(workerinput[_FOLDER_KEY])
    groups = {item.nodeid: group_of(item) for item in session.items}
    partial = folder / f".{workerinput['workerid']}.json"
    partial.write_text(json.dumps(groups))
    partial.rename(folder / f"{workerinput['workerid']}.json")


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadgroup`: xdist's scope scheduler, its scopes our groups, in collection order."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    folder = config.stash[_folder]

    class GroupScheduling(LoadScopeScheduling):  # type: ignore[misc]
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # called first once every worker has collected
                written = sorted(folder.glob("gw*.json"))
                assert written, f"no worker wrote its test groups into {folder}"
                self.groups = json.loads(written[0].read_text())
            return self.groups.get(nodeid) or nodeid.split("::", 1)[0]

    config.option.loadscopereorder = False  # the workers' order: the groups first
    return GroupScheduling(config, log)
