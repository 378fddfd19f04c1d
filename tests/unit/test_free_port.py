"""``free_port`` draws outside the kernel's ephemeral range (where outgoing connections take
their local port, so one cannot take ours between the check and the child's bind), hands
each port out once, and only ports that are free."""

from __future__ import annotations

import socket

from prefill_worker.testing.launch import ephemeral_range, free_port


def test_ports_are_below_the_ephemeral_range_free_and_never_repeated() -> None:
    low, _ = ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < low for p in ports)
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # raises if it was not free


def test_a_run_of_ports_is_free_below_the_range_and_never_handed_out_again() -> None:
    """``free_port(n)``: n consecutive ports (a worker's vLLM side channels, one per version)."""
    low, _ = ephemeral_range()
    firsts = [free_port(3) for _ in range(20)]
    runs = [p for first in firsts for p in range(first, first + 3)]
    singles = [free_port() for _ in range(50)]
    assert len(set(runs + singles)) == len(runs) + len(singles)
    assert all(1024 <= p < low for p in runs)
    for port in runs[:6]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # raises if it was not free
