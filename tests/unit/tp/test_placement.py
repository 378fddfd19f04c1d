"""Where a TP group's sockets bind (``tp.group.Placement``): loopback for a group on one host,
the configured interface for torchrun across hosts, refused without one."""

from __future__ import annotations

import pytest

from prefill_worker.tp.group import Placement

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}


def test_the_group_serve_starts_binds_loopback() -> None:
    placement = Placement.from_environ({}, 2, interface="eth1")
    assert placement is not None and placement.interface == "lo"
    assert Placement.from_environ({}, 1) is None


@pytest.mark.parametrize("master", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_torchrun_on_loopback_binds_loopback(master: str) -> None:
    placement = Placement.from_environ({**TORCHRUN, "MASTER_ADDR": master}, 2, "eth1")
    assert placement is not None and placement.interface == "lo"
    assert (placement.rank, placement.local_rank, placement.is_torchrun) == (1, 1, True)


@pytest.mark.parametrize("master", ["10.0.0.5", "node-0"])
def test_torchrun_across_hosts_binds_the_configured_interface(master: str) -> None:
    placement = Placement.from_environ({**TORCHRUN, "MASTER_ADDR": master}, 2, "eth1")
    assert placement is not None and placement.interface == "eth1"


def test_torchrun_across_hosts_without_an_interface_is_refused() -> None:
    with pytest.raises(ValueError, match=r"parallel\.interface"):
        Placement.from_environ({**TORCHRUN, "MASTER_ADDR": "10.0.0.5"}, 2)
