"""A bad operator flag stops start-up with a message naming the flag (no operator runs); the
operator's one command line (`moonlease operator`) defaults to what `OperatorOptions` does."""

from __future__ import annotations

import pytest

from moonlease.cli import build_parser, main
from moonlease_operator.options import OperatorOptions

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("changes", "flag"), [
    ({"reconcile_interval": 0.0}, "--reconcile-interval"),
    ({"resync_interval": -1.0}, "--resync-interval"),
    ({"resync_interval": float("nan")}, "--resync-interval"),
    ({"listed_targets": -1}, "--listed-targets"),
])
def test_options_refuse_what_the_operator_cannot_run_with(changes, flag) -> None:
    with pytest.raises(ValueError, match=flag):
        OperatorOptions(**changes)
    OperatorOptions(listed_targets=0)  # 0: only counts, no list


@pytest.mark.parametrize("argv", [["--listed-targets", "-3"], ["--resync-interval", "0"]])
def test_a_bad_flag_stops_start_up_with_what_to_fix(argv, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["operator", *argv], plugins=())
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert argv[0] in error and "moonlease operator: error:" in error


def test_the_command_line_defaults_are_the_options_defaults() -> None:
    args = build_parser(()).parse_args(["operator"])
    defaults = OperatorOptions()
    assert (args.reconcile_interval, args.resync_interval, args.listed_targets, args.conflict_reverts,
            args.conflict_backoff) == (defaults.reconcile_interval, defaults.resync_interval,
                                       defaults.listed_targets, defaults.conflict_reverts, defaults.conflict_backoff)
