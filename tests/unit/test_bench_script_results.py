"""What a benchmark script records about its run and how it saves it (`moonlease_dev.bench.script_results`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from moonlease_dev.bench.script_results import run_record, save_results

pytestmark = pytest.mark.unit


def test_the_record_names_the_command_without_a_dangling_space_and_the_results_land_side_by_side(
        tmp_path: Path) -> None:
    record = run_record("benchmarks/x.py", [], time.monotonic() - 2)
    assert record["command"] == "python benchmarks/x.py" and record["wall_s"] >= 2
    assert run_record("benchmarks/x.py", ["--seed", "3"], time.monotonic())["command"] \
        == "python benchmarks/x.py --seed 3"
    out = tmp_path / "report.md"
    markdown = save_results(out, {**record, "cells": [1]}, lambda results: f"# {results['command']}\n")
    assert out.read_text() == markdown == "# python benchmarks/x.py\n"
    assert json.loads(out.with_suffix(".json").read_text())["cells"] == [1]
