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

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moonlease_dev.devenv.upstream_suites import (
    UNIT_DIR,
    ensure_model_stand_in,
    ensure_upstream_suites,
    suite_paths,
)

pytestmark = pytest.mark.compat
REPO = Path(__file__).resolve().parents[2]
VLLM_033 = REPO / ".venv-vllm-0.33"
#: Tests in the six suites of each release; all pass here with upstream's own classes too
#: (`MOONLEASE_UPSTREAM_SUITES_AS_IS=1`).
EXPECTED_PASSED = {"0.32.0": 363, "0.33.0": 374}
OURS = ("moonlease_connector.adapters.vllm_connector.MooncakeStoreConnector, "
        "moonlease_connector.adapters.vllm_worker.MoonleaseStoreWorker, "
        "moonlease_connector.adapters.vllm_scheduler.MoonleaseStoreScheduler")


def run_suites(version: str, *, as_is: bool = False) -> subprocess.CompletedProcess[str]:
    root = ensure_upstream_suites(version)
    first = [str(VLLM_033)] if version == "0.33.0" else []
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([*first, str(root), str(REPO), str(REPO / "connector")]),
           "HF_HUB_CACHE": str(ensure_model_stand_in()), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "MOONLEASE_UPSTREAM_SUITES_AS_IS": "1" if as_is else "0"}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", os.devnull,
         "--rootdir", str(root), f"--confcutdir={UNIT_DIR}", "-rfE", "--tb=short",
         "-p", "moonlease_dev.devenv.upstream_suites", *suite_paths()],
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
