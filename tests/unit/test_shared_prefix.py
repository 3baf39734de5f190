"""The per-prefix reuse estimate retention `pin` pins by (`core.shared_prefix`): pure, no store."""

from __future__ import annotations

import pytest

from moonlease_connector.core.shared_prefix import SharedPrefixTracker

pytestmark = pytest.mark.unit

SYSTEM = ["s0", "s1", "s2"]


def session(name: str, turns: int) -> list[list[str]]:
    """A conversation's prompts: each turn extends the previous one."""
    prompts, context = [], list(SYSTEM)
    for turn in range(turns):
        context = context + [f"{name}-{turn}a", f"{name}-{turn}b"]
        prompts.append(list(context))
    return prompts


def test_a_system_prompt_is_shared_once_enough_sessions_continue_it() -> None:
    tracker = SharedPrefixTracker(min_continuations=3)
    depths = [tracker.observe_and_share(session(name, 1)[0]) for name in ("a", "b", "c", "d")]
    assert depths == [0, 0, 3, 3]  # the third distinct continuation makes the 3 blocks shared


def test_a_conversations_own_turns_are_not_shared() -> None:
    tracker = SharedPrefixTracker(min_continuations=2)
    assert [tracker.observe_and_share(p) for p in session("a", 4)] == [0, 0, 0, 0]
    assert tracker.shared_blocks(session("a", 4)[-1]) == 0


def test_a_branch_point_is_shared_and_deeper_than_the_system_prompt() -> None:
    tracker = SharedPrefixTracker(min_continuations=2)
    for name in ("a", "b"):
        tracker.observe(session(name, 1)[0])
    parent = session("a", 3)
    for prompt in parent:
        tracker.observe(prompt)
    branch = parent[0] + ["branch-x"]
    assert tracker.observe_and_share(branch) == len(parent[0])
    assert tracker.shared_blocks(parent[-1]) == len(parent[0])  # the parent shares it too
    assert tracker.shared_blocks(session("c", 1)[0]) == len(SYSTEM)


def test_memory_is_bounded_and_forgets_the_least_recently_seen_prefixes() -> None:
    tracker = SharedPrefixTracker(capacity=8, min_continuations=2)
    for name in ("a", "b"):
        tracker.observe(session(name, 1)[0])
    assert tracker.shared_blocks(session("a", 1)[0]) == 3
    for name in ("x", "y", "z"):
        tracker.observe([f"{name}{i}" for i in range(4)])
    assert len(tracker) == 8
    assert tracker.shared_blocks(session("a", 1)[0]) == 0  # forgotten: no longer pinned


@pytest.mark.parametrize("kwargs", [{"capacity": 0}, {"min_continuations": 1}])
def test_bad_bounds_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SharedPrefixTracker(**kwargs)
