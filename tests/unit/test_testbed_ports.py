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


def test_a_port_taken_is_not_given_and_no_room_falls_back_to_the_kernels_pick(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(processes, "PORT_RANGE", (taken, taken + 1))  # no room: the kernel picks
        assert processes.free_port() != taken
