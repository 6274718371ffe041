"""The port helper behind the multi-node tests' rendezvous (longserve/testing/server_process.py): a port named before
its listener binds it is picked outside the kernel's ephemeral range, so that no server on `--port 0` and no
outgoing connection is handed it in the meantime."""

from __future__ import annotations

import socket

import pytest

from longserve.testing.server_process import ephemeral_ports, free_port


def test_free_ports_lie_below_the_kernels_own_range_and_bind():
    low, high = ephemeral_ports()
    if low <= 2048:
        pytest.skip("no ephemeral port range known here (not Linux)")
    assert low < high
    ports = [free_port() for _ in range(32)]
    assert all(1024 <= p < low for p in ports), ports
    with socket.socket() as s:  # free: a listener can take it
        s.bind(("127.0.0.1", ports[0]))
        s.listen()


def test_a_taken_port_is_not_handed_out():
    low, _ = ephemeral_ports()
    if low <= 2048:
        pytest.skip("no ephemeral port range known here (not Linux)")
    taken = []
    try:
        for _ in range(8):
            s = socket.socket()
            s.bind(("127.0.0.1", free_port()))
            s.listen()
            taken.append(s)
        held = {s.getsockname()[1] for s in taken}
        assert len(held) == 8
        assert not held & {free_port() for _ in range(64)}
    finally:
        for s in taken:
            s.close()
