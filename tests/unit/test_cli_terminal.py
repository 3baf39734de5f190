"""`moonlease --version`, and colour only on a terminal and never with NO_COLOR (no-color.org)."""

from __future__ import annotations

import io
import os
import pty
import subprocess
from importlib.metadata import version

import pytest

from moonlease.cli import main
from moonlease_dev.terminal import bold, use_color

pytestmark = pytest.mark.unit


def test_version_prints_the_installed_distribution(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"moonlease {version('moonlease')}"


def test_no_colour_off_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert bold("x", io.StringIO()) == "x"


def test_colour_on_a_terminal_unless_no_color(monkeypatch: pytest.MonkeyPatch) -> None:
    controller, terminal = pty.openpty()
    try:
        with os.fdopen(terminal, "w", closefd=False) as stream:
            monkeypatch.delenv("NO_COLOR", raising=False)
            assert use_color(stream) and bold("x", stream) == "\033[1mx\033[0m"
            monkeypatch.setenv("NO_COLOR", "1")
            assert not use_color(stream) and bold("x", stream) == "x"
            monkeypatch.setenv("NO_COLOR", "")  # empty: not set, per no-color.org
            assert use_color(stream)
    finally:
        os.close(controller)
        os.close(terminal)


@pytest.mark.parametrize("script", ["tools/setup.sh", "tools/images.sh"])
def test_the_shell_tools_print_no_escape_codes_into_a_pipe(script: str) -> None:
    """Their `say` is defined the same way; run it alone, stdout a pipe (not a terminal)."""
    source = open(script).read()
    say = next(line for line in source.splitlines() if line.startswith("say()"))
    out = subprocess.run(["bash", "-c", f"{say}\nsay hello"], capture_output=True, text=True, check=True).stdout
    assert out.endswith("] hello\n") and "\033" not in out
