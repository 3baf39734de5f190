"""`moonlease demo` runs end to end (shortened) and reports measured results."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.store, pytest.mark.operator]


def test_short_demo_completes_with_store_hits_and_a_settled_policy(tmp_path: Path) -> None:
    moonlease = Path(sys.executable).with_name("moonlease")
    run = subprocess.run([str(moonlease), "demo", "--prompts", "2", "--workdir", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    out = run.stdout
    hits = re.search(r"engine 2: (\d+) of (\d+) prompt tokens from the store", out)
    assert hits and int(hits.group(1)) > 0, out
    rows = re.findall(r"^\s+\d+\s+\d+\s+(\d+)\s+(yes|NO)$", out, flags=re.M)
    assert len(rows) == 2 and all(same == "yes" and int(cached) > 0 for cached, same in rows), out
    assert "phase Ready" in out and "Stopping everything" in out, out
    assert (tmp_path / "logs").is_dir()
