"""The vLLM pull path over real NIXL (UCX on loopback) and the real side channel (ZMQ),
decode side played by a bare NIXL agent doing what vLLM's NixlConnector does: handshake
(``get_meta_msg``: the hash and the metadata it decodes), READ the staged blocks named by
the answer's params with the notification ``<remote_request_id>:<consumers>``, or send
``HB:`` and notification-only messages. The bytes read are vLLM's LBHNC of our pool; every staging
block returns to the pool on every path. (vLLM's own connector against the worker:
tests/interop.)"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.options import Hooks, NixlOptions, VllmIdentity, VllmOptions
from prefill_worker.transfer.vllm.backend import VllmBackend
from prefill_worker.transfer.vllm.channel import serve_side_channels
from prefill_worker.transfer.vllm.handshake import CompatFactors, compat_hash
from prefill_worker.transfer.vllm.profiles import PROFILES
from prefill_worker.transfer.vllm.tickets import Tickets
from tests.integration.vllm.decode import PullDecode, handshake
from tests.polling import wait_until

L, H, D, PS, PAGES, BS, BLOCKS = 2, 2, 8, 16, 40, 32, 12
MODEL = "tiny-llama"


class Clock:
    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[VllmBackend, torch.Tensor, Clock]]:
    pool = torch.randn(L, 2, PAGES, PS, H, D)
    lay = KVLayout(L, H, D, "float32", PS, PAGES)
    k = tuple(pool[i, 0].data_ptr() for i in range(L))
    v = tuple(pool[i, 1].data_ptr() for i in range(L))
    clock = Clock()
    nixl = NixlOptions(None, ("UCX",), "lo")
    identity = VllmIdentity(MODEL, "CPU_ATTN")
    options = VllmOptions(
        "127.0.0.1", 0, BS, BLOCKS, read_grace_s=1.0, identity=identity, nixl=nixl
    )
    backend = VllmBackend(
        KVRegions(lay, k, v, "cpu", 0, 0),
        options,
        Tickets(16),
        serve_side_channels,
        Hooks(clock=clock),
    )
    yield backend, pool, clock
    backend.close()


@pytest.fixture(scope="module")
def decode(served: tuple[VllmBackend, torch.Tensor, Clock]) -> Iterator[PullDecode]:
    backend = served[0]
    port = int(backend.bootstrap_endpoint.rpartition(":")[2])
    hash_, meta = handshake("127.0.0.1", port, backend.poll)
    want = CompatFactors(MODEL, "float32", H, D, L, attn_backend_name="CPU_ATTN")
    assert hash_ == compat_hash(want)
    assert meta.kv_cache_layout == "LBHNC" and meta.block_size == BS
    assert meta.num_blocks == BLOCKS and meta.engine_id == backend.registration.engine_id
    assert meta.block_lens == [H * BS * 2 * D * 4] * L
    d = PullDecode(meta)
    yield d
    d.close()


def test_each_version_has_its_side_channel_hash_and_fields(
    served: tuple[VllmBackend, torch.Tensor, Clock],
) -> None:
    """The first version (0.33) on the bootstrap endpoint, each one on the port its answers
    name: its own hash (version and connector version in it), its own metadata fields (v16
    names each region's layer and its group), the same registration behind both."""
    backend = served[0]
    want = CompatFactors(MODEL, "float32", H, D, L, attn_backend_name="CPU_ATTN")
    endpoints = backend.endpoints
    assert set(endpoints) == {"vllm_side_channel_0.33.0", "vllm_side_channel_0.34.0"}
    assert backend.bootstrap_endpoint == endpoints["vllm_side_channel_0.33.0"]
    metas = {}
    for version, profile in PROFILES.items():
        port = int(endpoints[f"vllm_side_channel_{version}"].rpartition(":")[2])
        assert backend.desk.identities[version].side_channel_port == port
        hash_, metas[version] = handshake("127.0.0.1", port, backend.poll)
        assert hash_ == compat_hash(want.for_profile(profile)), version
    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    v33, v34 = metas["0.33.0"], metas["0.34.0"]
    assert v33.region_members == [] and v33.layer_group_ids == {}
    assert v34.region_members == [[name] for name in names]
    assert v34.layer_group_ids == dict.fromkeys(names, 0)
    assert v33.kv_caches_base_addr == v34.kv_caches_base_addr
    assert v33.agent_metadata == v34.agent_metadata


def _polled(backend: VllmBackend, value: Callable[[], int]) -> Callable[[], int]:
    """``value`` after a turn of the backend (the engine turns it every NOTIFY_POLL_S)."""

    def turned() -> int:
        backend.poll()
        return value()

    return turned


def _prefill(backend: VllmBackend, room: int, n: int, page_ids: list[int]) -> dict[str, Any]:
    """What the engine does for one request, then the params the HTTP answer would carry."""
    assert backend.desk.tickets.open(room)
    sender = backend.create_sender(room, f"r{room}", n)
    assert sender.poll() is KVPoll.READY
    sender.send_pages(page_ids, 0)
    sender.send_aux(0)
    wait_until(lambda: sender.poll().is_terminal, what="the repack ends")
    assert sender.poll() is KVPoll.SUCCESS
    sender.close()
    params = backend.desk.tickets.take(room)
    assert params is not None
    return dict(params)


def _lbhnc(pool: torch.Tensor, page_ids: list[int], n: int) -> np.ndarray:
    tokens = pool[:, :, page_ids].flatten(2, 3)[:, :, :n]  # [L, 2, n, H, D]
    blocks = -(-n // BS)
    out = torch.zeros(L, blocks * BS, H, 2 * D)
    out[:, :n, :, :D], out[:, :n, :, D:] = tokens[:, 0], tokens[:, 1]
    return out.view(L, blocks, BS, H, 2 * D).transpose(2, 3).numpy()


@pytest.mark.parametrize("n", [1, 33, 300])
def test_a_read_gets_our_kv_in_lbhnc_and_its_notice_frees_the_blocks(
    served: tuple[VllmBackend, torch.Tensor, Clock], decode: PullDecode, n: int
) -> None:
    backend, pool, _ = served
    page_ids = [(7 * i + 3) % PAGES for i in range(-(-n // PS))]
    params = _prefill(backend, 100 + n, n, page_ids)
    (blocks,) = params["remote_block_ids"]
    assert len(blocks) == -(-n // BS) and backend.desk.staging.num_free == BLOCKS - len(blocks)
    got = decode.read(blocks, f"{params['remote_request_id']}:1").view(np.float32)
    want = _lbhnc(pool, page_ids, n)
    assert np.array_equal(got.reshape(L, len(blocks), H, BS, 2 * D), want)
    free = _polled(backend, lambda: backend.desk.staging.num_free)
    wait_until(lambda: free() == BLOCKS, 5.0, "the blocks freed")
    assert len(backend.desk.holds) == 0


def test_notification_only_heartbeat_and_lease(
    served: tuple[VllmBackend, torch.Tensor, Clock], decode: PullDecode
) -> None:
    backend, _, clock = served
    counts = backend.desk.holds.counts
    hit = _prefill(backend, 1, 20, [0, 1])  # the decode had it all: a notice, no READ
    decode.notify(f"{hit['remote_request_id']}:1")
    free = _polled(backend, lambda: backend.desk.staging.num_free)
    wait_until(lambda: free() == BLOCKS, 5.0, "the blocks freed")
    kept = _prefill(backend, 2, 20, [0, 1])
    never = _prefill(backend, 3, 20, [2, 3])
    clock.offset += 25.0
    beats = counts.heartbeats
    decode.notify(f"HB:{kept['remote_request_id']}")
    heartbeats = _polled(backend, lambda: counts.heartbeats)
    wait_until(lambda: heartbeats() > beats, 5.0, "the heartbeat")
    clock.offset += 6.0  # past the lease: `never` expires, `kept` lives on its heartbeat
    backend.poll()
    assert kept["remote_request_id"] in backend.desk.holds
    assert never["remote_request_id"] not in backend.desk.holds and counts.expired == 1
    clock.offset += 15.0  # past the heartbeat's extension and the read grace
    backend.poll()
    assert counts.expired == 2 and backend.desk.staging.num_free == BLOCKS
    unknown = counts.unknown_notifications
    decode.notify(f"{never['remote_request_id']}:1")  # a decode reading late: ignored
    unknowns = _polled(backend, lambda: counts.unknown_notifications)
    wait_until(lambda: unknowns() > unknown, 5.0, "the late notice")
    assert backend.desk.staging.num_free == BLOCKS


def test_a_restart_registers_a_newer_generation_and_forgets_old_holds(
    served: tuple[VllmBackend, torch.Tensor, Clock], decode: PullDecode
) -> None:
    """A restarted worker (a second backend over the same engine id): its answers carry a
    larger registration generation (vLLM re-handshakes), its hold ids never match the
    previous run's, and a notification for one of those is counted as unknown."""
    backend, pool, _ = served
    old = _prefill(backend, 900, 20, [4, 5])
    lay = KVLayout(L, H, D, "float32", PS, PAGES)
    k = tuple(pool[i, 0].data_ptr() for i in range(L))
    v = tuple(pool[i, 1].data_ptr() for i in range(L))
    options = VllmOptions(
        "127.0.0.1", 0, BS, BLOCKS, engine_id=old["remote_engine_id"], nixl=backend_nixl()
    )
    restarted = VllmBackend(
        KVRegions(lay, k, v, "cpu", 0, 0), options, Tickets(4), serve_side_channels
    )
    try:
        new = _prefill(restarted, 900, 20, [4, 5])
        assert new["remote_engine_id"] == old["remote_engine_id"]
        assert new["remote_registration_generation"] > old["remote_registration_generation"]
        assert new["remote_request_id"] != old["remote_request_id"]
        restarted.desk.notify("d0", f"{old['remote_request_id']}:1".encode())
        assert restarted.desk.holds.counts.unknown_notifications == 1
        assert len(restarted.desk.holds) == 1
    finally:
        restarted.close()
    assert restarted.desk.staging.num_free == BLOCKS  # closing returned its held blocks
    backend.desk.notify("d0", f"{old['remote_request_id']}:1".encode())
    assert backend.desk.staging.num_free == BLOCKS


def backend_nixl() -> NixlOptions:
    return NixlOptions(None, ("UCX",), "lo")
