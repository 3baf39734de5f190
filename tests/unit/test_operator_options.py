"""A bad operator flag stops start-up with a message naming the flag (no operator runs)."""

from __future__ import annotations

import pytest

from moonlease_operator.__main__ import main
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
        main(argv)
    assert exit_.value.code == 2
    assert argv[0] in capsys.readouterr().err
