"""The product command line has no development commands of its own: the development package
adds `demo` and `bench` through the `moonlease.commands` entry points, and without it
`moonlease demo` says where they come from instead of argparse's bare "invalid choice"."""

from __future__ import annotations

import argparse
from importlib.metadata import EntryPoint

import pytest

from moonlease import cli
from moonlease_dev.cli import register

pytestmark = pytest.mark.unit


def test_without_the_development_package_demo_and_bench_point_to_it(capsys: pytest.CaptureFixture[str]) -> None:
    parser = cli.build_parser([])
    with pytest.raises(SystemExit):
        parser.parse_args(["demo"])
    capsys.readouterr()
    for argv in (["demo", "--quick"], ["bench", "replay"], ["bench"]):
        assert cli.main(argv, plugins=[]) == 2
        err = capsys.readouterr().err
        assert f"{argv[0]!r} is a development command" in err and "make setup" in err, err


def test_the_development_package_registers_demo_and_bench() -> None:
    parser = cli.build_parser([register])
    assert parser.parse_args(["demo", "--quick", "--interval", "6"]).interval == 6
    assert parser.parse_args(["bench", "generate", "--workload", "agentic-swa", "--out", "t.jsonl"]).bench_command \
        == "generate"
    with pytest.raises(SystemExit):
        parser.parse_args(["demo", "--interval", "4"])  # the same bounds as before the move


def test_an_entry_point_that_fails_to_load_leaves_the_product_commands_and_is_named_in_the_hint(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    points = [EntryPoint("broken", "moonlease_no_such_module:register", cli.PLUGIN_GROUP),
              EntryPoint("dev", "moonlease_dev.cli:register", cli.PLUGIN_GROUP)]
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group: [p for p in points if p.group == group])
    loaded, failures = cli.installed_plugins()
    assert loaded == [register]
    assert failures == ["broken (moonlease_no_such_module:register): ModuleNotFoundError: "
                        "No module named 'moonlease_no_such_module'"]
    monkeypatch.setattr(cli, "installed_plugins", lambda: ([], failures))
    assert cli.main(["demo"]) == 2
    assert "moonlease_no_such_module" in capsys.readouterr().err
    assert isinstance(cli.build_parser([]), argparse.ArgumentParser)


def test_bench_replay_refuses_an_eviction_ratio_outside_its_range_before_starting_anything() -> None:
    parser = cli.build_parser([register])
    assert parser.parse_args(["bench", "replay", "--eviction-ratio", "0.01"]).eviction_ratio == 0.01
    for ratio in ("0", "1.5", "-0.1"):
        with pytest.raises(SystemExit, match=r"--eviction-ratio .* in \(0, 1\]"):
            cli.main(["bench", "replay", "--eviction-ratio", ratio], plugins=[register])
