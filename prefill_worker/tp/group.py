"""Joining the group: where this process is (``Placement``), rendezvous, the process groups.

Two ways to run, decided once at start-up from the environment the daemon was given::

    prefill-worker serve, tp_size N   this process is rank 0 (the leader); it starts ranks
                                      1..N-1 itself (``followers.py``) and rendezvous on
                                      127.0.0.1 through a TCPStore on a port it picked
    under torchrun (RANK, WORLD_SIZE  this process is one rank; torchrun started the others
    and LOCAL_RANK set)               and serves the rendezvous (``env://``)

Where the group listens. Every socket of a one-host group (the spawned one, or torchrun with a
loopback ``MASTER_ADDR``) is on loopback: the leader's TCPStore listens on a socket bound to
127.0.0.1 (``TCPStore`` alone binds every interface, and the store has no authentication), and
gloo and NCCL are given ``lo`` (gloo otherwise binds the address the host name resolves to).
A group across hosts is torchrun's, whose store it serves itself; it needs
``parallel.interface``, the (private) interface its collectives use, or it is refused at start.

Process groups: the model's collectives run on ``backend`` (NCCL on CUDA, gloo on CPU); the
steps on a gloo group (the same group on CPU). Both carry ``step_timeout_s``: a collective
waiting longer for a rank raises, which is how a stopped or hung rank is detected. The
default group keeps the (long) rendezvous timeout, for the one barrier after the model load.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from prefill_worker.model.parallel import TPGroup
from prefill_worker.tp.secret import prove_membership

LOOPBACK = "127.0.0.1"
LOOPBACK_INTERFACE = "lo"


@dataclass(frozen=True, slots=True)
class Placement:
    rank: int
    size: int
    local_rank: int  # this host's device index
    port: int  # the rendezvous store's (0: the leader picks one)
    is_torchrun: bool
    interface: str = LOOPBACK_INTERFACE  # the network interface gloo and NCCL bind

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @property
    def spans_hosts(self) -> bool:
        """A torchrun group whose rendezvous is off loopback."""
        return self.is_torchrun and self.interface != LOOPBACK_INTERFACE

    @staticmethod
    def from_environ(
        env: Mapping[str, str], tp_size: int, interface: str | None = None
    ) -> Placement | None:
        """None at TP 1 outside torchrun; ``ValueError`` when torchrun's world is not
        ``tp_size``, or spans hosts (a ``MASTER_ADDR`` off loopback) with no ``interface``
        (``parallel.interface``) named for it."""
        if "RANK" in env and "WORLD_SIZE" in env:
            size = int(env["WORLD_SIZE"])
            if size != tp_size:
                raise ValueError(f"torchrun started {size} ranks but parallel.tp_size is {tp_size}")
            rank = int(env["RANK"])
            local = int(env.get("LOCAL_RANK", rank))
            if size == 1:
                return None
            return Placement(rank, size, local, 0, True, _torchrun_interface(env, interface))
        return Placement(0, tp_size, 0, 0, False) if tp_size > 1 else None


def _torchrun_interface(env: Mapping[str, str], interface: str | None) -> str:
    master = env.get("MASTER_ADDR", LOOPBACK)
    if _is_loopback(master):
        return LOOPBACK_INTERFACE
    if interface is None:
        raise ValueError(
            f"torchrun's MASTER_ADDR {master} is not loopback: a group across hosts needs "
            "parallel.interface, the private network interface its collectives use (its "
            "rendezvous store has no authentication: keep it off public networks)"
        )
    return interface


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: taken as another host


@dataclass(frozen=True, slots=True)
class Timeouts:
    rendezvous_s: float
    step_s: float


@dataclass(frozen=True, slots=True)
class Membership:
    tp: TPGroup  # what the model is built with
    control: Any  # the gloo group the steps go over


def rank_device(name: str, placement: Placement) -> str:
    """The device this rank computes on: CPU stays CPU; CUDA is ``cuda:LOCAL_RANK``.
    ``ValueError`` (a configuration error) when the host has fewer devices than ranks."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if not name.startswith("cuda"):
        return name
    num_devices = torch.cuda.device_count()
    num_local = placement.size if not placement.is_torchrun else placement.local_rank + 1
    if num_devices < num_local:
        raise ValueError(
            f"parallel.tp_size {placement.size} needs {num_local} CUDA devices; "
            f"this host has {num_devices}"
        )
    return f"cuda:{placement.local_rank}"


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def open_store(placement: Placement, timeouts: Timeouts) -> dist.TCPStore | None:
    """The leader's rendezvous store on 127.0.0.1 (its port is ``store.port``); None under
    torchrun, which serves its own."""
    if placement.is_torchrun or not placement.is_leader:
        return None
    listener = socket.create_server((LOOPBACK, 0))  # the store serves on this socket alone
    port = listener.getsockname()[1]
    return dist.TCPStore(
        LOOPBACK, port, placement.size, is_master=True, timeout=_delta(timeouts.rendezvous_s),
        wait_for_workers=False, master_listen_fd=listener.detach(),
    )  # fmt: skip


def join(
    placement: Placement,
    device: str,
    timeouts: Timeouts,
    store: dist.TCPStore | None,
    secret: bytes,
) -> Membership:
    """Blocks until every rank joined (the leader bounds it from outside: ``followers``) and
    proved it holds the group's ``secret`` (``secret.prove_membership``: ``GroupAuthError``
    otherwise)."""
    backend = backend_for(device)
    # Read by gloo and NCCL when they make their sockets (torch has no argument for it).
    os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = placement.interface
    if placement.is_torchrun:
        timeout = _delta(timeouts.rendezvous_s)
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    else:
        if store is None:
            store = dist.TCPStore(
                LOOPBACK, placement.port, placement.size, is_master=False,
                timeout=_delta(timeouts.rendezvous_s),
            )  # fmt: skip
        dist.init_process_group(
            backend, store=store, rank=placement.rank, world_size=placement.size,
            timeout=_delta(timeouts.rendezvous_s),
        )  # fmt: skip
    try:
        model_group = dist.new_group(backend=backend, timeout=_delta(timeouts.step_s))
        control = model_group
        if backend != "gloo":
            control = dist.new_group(backend="gloo", timeout=_delta(timeouts.step_s))
        prove_membership(secret, placement.rank, placement.size, control)
    except BaseException:
        leave()  # the process may start again (the daemon in a test's process)
        raise
    return Membership(TPGroup(placement.rank, placement.size, model_group), control)


def agree_loaded(num_pages: int) -> None:
    """The barrier after every rank loaded its shard: the ranks' pools must hold the same
    pages (the leader's page ids index every rank's pool). On the default group (the
    rendezvous timeout: a load takes longer than a step)."""
    both = torch.tensor([num_pages, -num_pages], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MIN)
    low, high = int(both[0]), -int(both[1])
    if low != high:
        raise ValueError(f"the ranks' KV pools differ: {low} to {high} pages")


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _delta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)
