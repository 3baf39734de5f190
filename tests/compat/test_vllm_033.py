"""vLLM 0.33.0: our adapters still match upstream's Mooncake store lookup, call for call.

vllm 0.33.0 needs a CUDA torch to serve, so it cannot run an engine here; its modules import on
the CPU torch. `make setup` installs them --no-deps into `.venv-vllm-0.33`; this test re-runs
the property tests against upstream's lookup (default, selective and last-hit-only lease) and junction
retention's (the junction equals the local coordinator's; junction tails in the save mask), and
last-hit-only's layout gate against 0.33.0's spec registry, in a subprocess with that folder
first on PYTHONPATH, so upstream's coordinator, worker and registry are 0.33.0's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moonlease_dev import devenv

pytestmark = pytest.mark.compat
REPO = Path(__file__).resolve().parents[2]
VLLM_033 = REPO / ".venv-vllm-0.33"
PROPERTY_TESTS = ["tests/unit/test_lookup_matches_upstream.py",
                  "tests/unit/test_selective_matches_upstream.py",
                  "tests/unit/test_last_hit_matches_upstream.py",
                  "tests/unit/test_last_hit_layout.py",
                  "tests/unit/test_junctions_match_vllm.py",
                  "tests/unit/test_junction_save_masks.py"]


def test_adapters_match_upstream_lookup_of_vllm_0_33() -> None:
    assert (VLLM_033 / "vllm" / "__init__.py").exists(), "run `make setup` (installs vLLM 0.33.0's modules)"
    # The checkout's source roots too: an editable install elsewhere (another checkout) must not
    # win (the test fixtures import the connector and the operator).
    env = {**os.environ, "PYTHONPATH": devenv.source_pythonpath(VLLM_033)}
    version = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__, vllm.__file__)"],
                             env=env, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert version.returncode == 0, version.stderr[-2000:]
    assert version.stdout.split()[0] == "0.33.0" and str(VLLM_033) in version.stdout

    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-p", "no:logging", *PROPERTY_TESTS],
                         env=env, capture_output=True, text=True, cwd=REPO, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout
