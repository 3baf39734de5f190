"""The test bed's ports (`moonlease_dev.testbed.processes.free_port`) stay out of the kernel's
ephemeral range, where any outgoing connection may take a port a late-binding server was given."""

from __future__ import annotations

import socket

import pytest

from moonlease_dev.testbed import processes

pytestmark = pytest.mark.unit


def test_ports_come_from_below_the_ephemeral_range_and_bind() -> None:
    low, _ = processes._ephemeral_ports()
    ports = {processes.free_port() for _ in range(20)}
    assert all(processes.PORT_RANGE[0] <= port < min(processes.PORT_RANGE[1], low) for port in ports)
    assert len(ports) > 1  # random, not one fixed port every test bed server would share
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.pop()))


def test_a_port_taken_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held, socket.socket() as probe:
        held.bind(("127.0.0.1", 0))
        probe.bind(("127.0.0.1", 0))
        taken, free = held.getsockname()[1], probe.getsockname()[1]
        probe.close()  # free again: the second draw
        draws = iter([taken, free])
        monkeypatch.setattr(processes.random, "randrange", lambda low, high: next(draws))
        assert processes.free_port() == free


def test_no_room_below_the_ephemeral_range_falls_back_to_the_kernels_pick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(processes, "_ephemeral_ports", lambda: (processes.PORT_RANGE[0] + 10, 60999))
    monkeypatch.setattr(processes.random, "randrange", lambda low, high: pytest.fail("no draw without room"))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", processes.free_port()))
