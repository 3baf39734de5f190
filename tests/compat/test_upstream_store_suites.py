"""vLLM's own Mooncake store unit tests pass with our connector, worker and scheduler in place.

Every Moonlease mode off. The six `tests/v1/kv_connector/unit/test_mooncake_store_*.py` suites
of each supported release come from that release's source distribution at test time
(`moonlease_dev.devenv.upstream_suites`: fetched once into the cache directory, never committed;
`make setup` pre-fetches them) and run in a subprocess with the plugin that binds our classes
to upstream's module attributes. vLLM 0.33.0's suites run against its modules in
`.venv-vllm-0.33` (first on PYTHONPATH), as in `test_vllm_033.py`. The pass count is checked
exactly, so a suite that silently stops collecting fails here too.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from moonlease_dev import devenv
from moonlease_dev.devenv.forced_mode import FORCED_MODES
from moonlease_dev.devenv.upstream_suites import (
    UNIT_DIR,
    ensure_model_stand_in,
    ensure_upstream_suites,
    suite_paths,
)

pytestmark = pytest.mark.compat
#: Under `make test` each test goes to whichever worker is free (tests/support/xdist_groups.py):
#: each one is a subprocess of a minute or more of CPU, and nothing is shared between them but
#: the suites' folder in the cache (fetched by `make setup`).
XDIST_EACH_TEST = True
REPO = Path(__file__).resolve().parents[2]
VLLM_033 = REPO / ".venv-vllm-0.33"
#: Tests in the six suites of each release; all pass here with upstream's own classes too
#: (`MOONLEASE_UPSTREAM_SUITES_AS_IS=1`).
EXPECTED_PASSED = {"0.32.0": 363, "0.33.0": 374}
OURS = ("moonlease_connector.adapters.vllm_connector.MooncakeStoreConnector, "
        "moonlease_connector.adapters.vllm_worker.MoonleaseStoreWorker, "
        "moonlease_connector.adapters.vllm_scheduler.MoonleaseStoreScheduler")


def run_suites(version: str, *, as_is: bool = False, forced_mode: str | None = None,
               extra_env: dict[str, str] | None = None,
               select: str | None = None) -> subprocess.CompletedProcess[str]:
    """The release's six suites in a subprocess, with our classes in place (`as_is`: upstream's)
    and, with `forced_mode`, that mode forced on (`moonlease_dev.devenv.forced_mode`); `select`: a
    pytest `-k` expression."""
    root = ensure_upstream_suites(version)
    first = [str(VLLM_033)] if version == "0.33.0" else []
    env = {**os.environ,
           "PYTHONPATH": devenv.source_pythonpath(*first, root),
           "HF_HUB_CACHE": str(ensure_model_stand_in()), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "MOONLEASE_UPSTREAM_SUITES_AS_IS": "1" if as_is else "0",
           # The suites use no installed pytest plugin (hypothesis, anyio, asyncio, xdist): not
           # loading them spares each run their imports and their assertion rewriting.
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    plugins = ["-p", "moonlease_dev.devenv.upstream_suites"]
    if forced_mode is not None:
        env["MOONLEASE_FORCED_MODE"] = forced_mode
        plugins += ["-p", "moonlease_dev.devenv.forced_mode"]
    env.update(extra_env or {})
    if select is not None:
        plugins += ["-k", select]
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", os.devnull,
         "--rootdir", str(root), f"--confcutdir={UNIT_DIR}", "-rfE", "--tb=short",
         *plugins, *suite_paths()],
        cwd=root, env=env, capture_output=True, text=True, timeout=1500)


@pytest.mark.parametrize("version", list(EXPECTED_PASSED))
def test_upstream_store_suites_pass_with_moonlease_in_place(version: str) -> None:
    if version == "0.33.0":
        assert (VLLM_033 / "vllm" / "__init__.py").exists(), "run `make setup` (installs vLLM 0.33.0's modules)"
    run = run_suites(version)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert f"store classes in place: {OURS}" in run.stdout, "our classes did not replace upstream's"
    summary = run.stdout.strip().splitlines()[-1]
    assert not re.search(r"\d+ (failed|error)", summary), summary
    passed = re.search(r"(\d+) passed", summary)
    assert passed is not None and int(passed.group(1)) == EXPECTED_PASSED[version], summary


#: The reviewed differences of each forced mode: test id -> why it fails by design
#: (`forced_mode_differences.toml`, beside this file). A test whose hit differs from
#: upstream's can never be one of them: the plugin reports hit differences by themselves.
DIFFERENCES = REPO / "tests" / "compat" / "forced_mode_differences.toml"
#: Every forced mode against every supported release.
FORCED_RUNS = [(mode, version) for mode in FORCED_MODES for version in EXPECTED_PASSED]
#: What proves each mode ran: the lease modes probe, the save modes run our send thread.
RAN = {"selective": "probed", "lastHitOnly": "probed", "junction": "send_threads",
       "skip": "send_threads", "pin+retry+evict": "send_threads"}
#: A difference whose reason starts with this is our code refusing what the suite builds
#: (a layout the mode cannot serve): the test must fail on that refusal, nothing else.
REFUSED = "refused"


def expected_differences(mode: str, version: str) -> dict[str, str]:
    """The mode's entries for this release (`[MODE."RELEASE"]`) and for every release
    (`[MODE.every-release]`)."""
    table = tomllib.loads(DIFFERENCES.read_text()).get(mode, {})
    entries = {**table.get("every-release", {}), **table.get(version, {})}
    for test, reason in entries.items():
        assert isinstance(reason, str) and len(reason.split()) >= 5, f"{mode} {test}: a reason, please"
    return entries


def forced_report(stdout: str) -> dict[str, Any]:
    line = next((x for x in stdout.splitlines() if x.startswith("forced mode report: ")), None)
    assert line is not None, "the forced-mode plugin did not report"
    return json.loads(line.removeprefix("forced mode report: "))


def failed_tests(stdout: str) -> set[str]:
    """The tests `-rfE` lists as FAILED or ERROR, by name (with parameters)."""
    return {m.group(2).rsplit("::", 1)[-1] for m in re.finditer(r"^(FAILED|ERROR) (\S+)", stdout, re.MULTILINE)}


def failure_texts(stdout: str) -> dict[str, str]:
    """Each failed test's `--tb=short` section, by name (with parameters; a class's prefix off)."""
    parts = re.split(r"^_+ (?:ERROR at \w+ of )?(\S+) _+$", stdout, flags=re.MULTILINE)
    texts: dict[str, str] = {}
    for header, text in zip(parts[1::2], parts[2::2], strict=True):
        name, bracket, params = header.partition("[")
        texts[name.rsplit(".", 1)[-1] + bracket + params] = text
    return texts


@pytest.mark.parametrize(("mode", "version"), FORCED_RUNS)
def test_upstream_store_suites_with_a_mode_forced_on(mode: str, version: str) -> None:
    """Every test passes but the reviewed differences, no lookup's hit differs from upstream's
    on the same store contents, and a difference listed as our refusal fails on that refusal."""
    if version == "0.33.0":
        assert (VLLM_033 / "vllm" / "__init__.py").exists(), "run `make setup` (installs vLLM 0.33.0's modules)"
    run = run_suites(version, forced_mode=mode)
    assert f"store classes in place: {OURS}" in run.stdout, run.stdout[-3000:] + run.stderr[-3000:]
    report = forced_report(run.stdout)
    assert report["mode"] == mode
    assert report["hit_differences"] == [], "a hit differs from upstream's (never an expected difference)"
    assert report["lookups"] > 0 and report[RAN[mode]] > 0, f"the mode never ran ({RAN[mode]}): {report}"
    expected = expected_differences(mode, version)
    failed = failed_tests(run.stdout)
    assert sorted(failed - expected.keys()) == [], run.stdout[-8000:]
    assert sorted(expected.keys() - failed) == [], "listed as a difference but passes now: take it off the list"
    texts = failure_texts(run.stdout)
    not_refused = sorted(test for test, reason in expected.items() if reason.startswith(REFUSED)
                         and "ConnectorConfigError" not in texts.get(test, ""))
    assert not_refused == [], f"listed as refused but failed otherwise: {not_refused}"
    summary = run.stdout.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed is not None and int(passed.group(1)) + len(failed) == EXPECTED_PASSED[version], summary


def test_a_wrong_hit_is_reported_as_a_hit_difference_never_only_as_a_failure() -> None:
    """The plugin tells a hit that differs from upstream's from every other failure: with our
    hits made one token short, the suites' lookup tests that assert a hit fail, and each of
    them is reported as a hit difference, so no list of expected differences could excuse it."""
    version = "0.32.0"
    run = run_suites(version, forced_mode="selective", extra_env={"MOONLEASE_FORCED_WRONG_HITS": "1"},
                     select="test_lookup_partial_prefix_returns_first_hit_length or "
                            "test_lookup_full_hit_with_eagle_pops_once_not_twice")
    report = forced_report(run.stdout)
    differing = {entry["test"].rsplit("::", 1)[-1] for entry in report["hit_differences"]}
    assert differing == {"test_lookup_partial_prefix_returns_first_hit_length",
                         "test_lookup_full_hit_with_eagle_pops_once_not_twice"}, report
    assert all(entry["ours"] == entry["upstream"] - 1 for entry in report["hit_differences"]), report
    assert failed_tests(run.stdout) == differing, run.stdout[-3000:]
