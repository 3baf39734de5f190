"""A gate a test holds a prefill engine's saves behind (`tests.support.gated_saves`).

Safe to import anywhere: only the gate's location and its two moves. The engine that loads
`tests.support.gated_saves` as its connector module reads the directory from `SAVE_GATE_ENV`
(inherited from the test process); every save job waits while the directory exists without its
`open` file, and marks that it holds one (`held`). Without the variable, saves run as they would.
"""

from __future__ import annotations

from pathlib import Path

#: The environment variable naming the gate's directory.
SAVE_GATE_ENV = "MOONLEASE_TEST_SAVE_GATE"
#: How long one save job waits at a closed gate before it gives up and saves (a stuck test must
#: not hold an engine forever): longer than any wait of the test's own.
GATE_WAIT_LIMIT_S = 1200.0


def open_file(gate: Path) -> Path:
    return gate / "open"


def held_file(gate: Path) -> Path:
    return gate / "held"


def open_gate(gate: Path) -> None:
    gate.mkdir(parents=True, exist_ok=True)
    open_file(gate).touch()


def close_gate(gate: Path) -> None:
    gate.mkdir(parents=True, exist_ok=True)
    held_file(gate).unlink(missing_ok=True)
    open_file(gate).unlink(missing_ok=True)
