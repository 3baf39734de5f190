"""What `moonlease status` says the operator waits for, and the command that unblocks it."""

from __future__ import annotations

from typing import Any

import pytest

from moonlease.status_view import build_status_view, render_status

pytestmark = pytest.mark.unit


def policy(status: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": "p", "namespace": "ns"}, "status": status}


def test_an_awaited_master_restart_names_the_approval_annotation() -> None:
    view = build_status_view(policy({"phase": "AwaitingApproval", "pendingApproval": "abc123"}))
    assert view.waiting is not None
    assert view.waiting.command == "kubectl -n ns annotate mlp p --overwrite moonlease.io/approve-master-restart=abc123"


def test_a_measuring_test_waits_without_a_command_and_says_when_its_source_fails() -> None:
    view = build_status_view(policy({"phase": "Analyzing", "abTest": {
        "phase": "Measuring", "verdict": "Error", "progress": "4/30", "conditions": [
            {"metric": "externalHitRate", "control": 0.3, "treatment": 0.35, "effect": 0.05, "outcome": "Inconclusive"}]}}))
    assert view.waiting is not None and view.waiting.command is None
    assert "4/30" in view.waiting.on and "resumes when it answers" in view.waiting.on
    text = render_status(view)
    assert "verdict (so far Error), samples 4/30" in text
    assert "[-, -]" in text  # no bounds yet


@pytest.mark.parametrize("phase, command", [
    ("Paused", "kubectl -n ns patch mlp p --type=merge -p '{\"spec\":{\"rollout\":{\"paused\":false}}}'"),
    ("Degraded", "kubectl -n ns edit mlp p"),
    ("Ready", None),
])
def test_each_phase_says_what_unblocks_it(phase: str, command: str | None) -> None:
    view = build_status_view(policy({"phase": phase}))
    assert (view.waiting.command if view.waiting else None) == command
