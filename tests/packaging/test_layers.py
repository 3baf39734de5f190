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


@pytest.mark.parametrize("package", ["core/rollout", "core/analysis"])
def test_the_planners_are_packages_of_small_modules_over_frozen_inputs(package: str) -> None:
    """The rollout planner and the A/B analysis: one concept per module, none over 500 lines,
    and every dataclass frozen (each step returns new values; nothing is written in place)."""
    import ast

    modules = sorted((REPO / "operator" / "moonlease_operator" / package).glob("*.py"))
    assert len(modules) > 3
    for path in modules:
        text = path.read_text(encoding="utf-8")
        assert len(text.splitlines()) <= 500, f"{path.name}: {len(text.splitlines())} lines"
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.ClassDef):
                continue
            for decorator in node.decorator_list:
                if isinstance(decorator, ast.Name) and decorator.id == "dataclass":
                    raise AssertionError(f"{path.name}: {node.name} is a mutable dataclass")
                if isinstance(decorator, ast.Call) and getattr(decorator.func, "id", "") == "dataclass":
                    frozen = [k for k in decorator.keywords if k.arg == "frozen"]
                    assert frozen and getattr(frozen[0].value, "value", False) is True, \
                        f"{path.name}: {node.name} is a mutable dataclass"
