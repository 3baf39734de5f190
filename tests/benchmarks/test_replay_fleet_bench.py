"""`moonlease bench replay --engines 3` (2 prefill + 1 decode connectors on one real store) on a
tiny trace, routed by session and at random.

The assertions are about the fleet's figures and accounting — never about which mode wins.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.store

REPO = Path(__file__).resolve().parents[2]
MOONLEASE = [sys.executable, "-m", "moonlease_dev"]
MODES = ("leaseAll", "leaseAll+evict")


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fleet-trace") / "trace.jsonl.gz"
    generate = subprocess.run([*MOONLEASE, "bench", "generate", "--workload", "agentic-swa", "--seed", "3",
                               "--knob", "duration_s=420", "--knob", "sessions_per_min=4",
                               "--knob", "pause_s=60,300", "--out", str(path)],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
    assert generate.returncode == 0, generate.stderr[-3000:]
    return path


ROUTINGS = ("session", "random")


@pytest.fixture(scope="module")
def fleet_replays(trace: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, int, str]]:
    """Both routings' replays, run side by side (each sleeps much of its time until the trace's
    scaled arrivals): routing -> (report, exit status, output)."""
    started = {}
    try:
        for routing in ROUTINGS:
            folder = tmp_path_factory.mktemp(f"fleet-{routing}")
            log = (folder / "output.log").open("w")
            started[routing] = (folder, log, subprocess.Popen(
                [*MOONLEASE, "bench", "replay", "--trace", str(trace), "--capacities", "0.1",
                 "--modes", ",".join(MODES), "--wall-s-per-run", "3",
                 "--engines", "3", "--routing", routing, "--out", str(folder / "replay.md")],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True))
        done = {}
        for routing, (folder, log, process) in started.items():
            code = process.wait(timeout=300)
            log.close()
            done[routing] = (folder / "replay.md", code, (folder / "output.log").read_text())
        return done
    finally:
        for _, log, process in started.values():
            if process.poll() is None:
                process.kill()
                process.wait()
            log.close()


@pytest.fixture(params=ROUTINGS)
def fleet_run(request: pytest.FixtureRequest,
              fleet_replays: dict[str, tuple[Path, int, str]]) -> tuple[str, Path, dict[str, Any]]:
    routing = request.param
    out, code, output = fleet_replays[routing]
    assert code == 0, output[-6000:]
    return routing, out, json.loads(out.with_suffix(".json").read_text())


def test_fleet_figures_are_reported(fleet_run):
    routing, out, results = fleet_run
    (trace,) = results["traces"]
    assert (trace["engines"], trace["routing"]) == ("2p1d", routing)
    assert results["settings"]["engines"] == "3" and results["settings"]["routing"] == routing
    assert trace["kinds"]["resend"] > 0, "the preset re-sends prompts exactly"
    (capacity,) = trace["capacities"]
    markdown = out.read_text()
    assert f"## Fleet: `agentic-swa`, 2p1d engines, routing `{routing}`" in markdown
    for name in MODES:
        fleet = capacity["modes"][name]["fleet"]
        assert (fleet["engines"], fleet["routing"]) == ("2p1d", routing)
        assert sum(fleet["engine_requests"]) == trace["requests"]
        assert all(fleet["engine_requests"]), "both prefill engines served requests"
        assert 0.0 <= fleet["decode_hit_rate"] <= fleet["decode_ideal_rate"] <= 1.0
        assert f"| {capacity['fits']:.2f} | {name} |" in markdown
    assert capacity["modes"]["leaseAll"]["keys_removed"] == 0
    assert capacity["modes"]["leaseAll+evict"]["master"]["master_key_count"] > 0


def test_belady_is_at_least_every_mode(fleet_run):
    _, _, results = fleet_run
    (trace,) = results["traces"]
    (capacity,) = trace["capacities"]
    for name, mode in capacity["modes"].items():
        assert mode["hit_rate"] <= capacity["belady"]["plain"] + 1e-9, name
        assert mode["hit_rate"] <= trace["ideal_rate"]["plain"] + 1e-9, name
    assert capacity["belady_decode"]["plain"] <= trace["ideal_decode_rate"]["plain"] + 1e-9
