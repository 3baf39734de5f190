"""`make lint` holds: ruff and mypy find nothing (mypy strict on the pure cores), and the import
layers written in pyproject.toml hold (pure cores import no I/O libraries)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]


def test_import_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint)], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: " in result.stdout and " broken" in result.stdout


def test_ruff_finds_nothing() -> None:
    ruff = Path(sys.executable).with_name("ruff")
    result = subprocess.run([str(ruff), "check", "--no-cache", "."], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_finds_nothing() -> None:
    """The whole product typed, the cores strictly (mypy.ini); its cache under .cache/mypy makes a
    rerun take seconds (a cold run about a minute of CPU)."""
    mypy = Path(sys.executable).with_name("mypy")
    result = subprocess.run([str(mypy)], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout


def test_no_package_shadows_the_standard_library() -> None:
    """`operator/` is a folder, never an importable package (it would shadow stdlib operator)."""
    assert not (REPO / "operator" / "__init__.py").exists()
    result = subprocess.run([sys.executable, "-c", "import operator; print(operator.__file__)"],
                            cwd=REPO, capture_output=True, text=True, check=True)
    assert "/lib/python3" in result.stdout and str(REPO) not in result.stdout
