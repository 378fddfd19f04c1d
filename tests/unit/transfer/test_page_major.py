"""The page-major pool layout on the transfer side (issue 17): one region of whole pages,
one descriptor per page run for every layer's K and V, the layout in the compatibility hash
and on the wire (left out when layer-major, so v1 bytes stay), refusals that name both
layouts, and the page-count helper a decode sizes its wants with."""

from __future__ import annotations

import dataclasses
import re

import msgpack
import msgspec
import numpy as np
import pytest

from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.transfer import num_want_pages, pagemap, wire
from prefill_worker.transfer.nixl.agent import region_tables
from prefill_worker.transfer.validate import BootstrapLimits, RejectReason, check_register
from tests.unit.transfer.test_pagemap import expand

LAYER = KVLayout(3, 2, 4, "float32", 4, 16)  # page_bytes = 4 * 2 * 4 * 4 = 128
PAGE = dataclasses.replace(LAYER, kind="page_major")
BASE = 1 << 30


def page_major_regions(layout: KVLayout = PAGE, base: int = BASE) -> KVRegions:
    k = tuple(base + 2 * layer * layout.page_bytes for layer in range(layout.num_layers))
    v = tuple(a + layout.page_bytes for a in k)
    return KVRegions(layout, k, v, "cpu", 5 << 30, 4)


def test_a_page_major_page_is_every_layer_and_one_region() -> None:
    assert (PAGE.num_regions, PAGE.region_page_bytes) == (1, 6 * 128)
    assert (LAYER.num_regions, LAYER.region_page_bytes) == (6, 128)
    assert PAGE.pool_bytes == LAYER.pool_bytes == 16 * 6 * 128
    assert page_major_regions().region_base_addrs == (BASE,)


def test_the_descriptor_table_has_one_entry_per_page() -> None:
    table = expand(pagemap.kv_descriptor_table(page_major_regions()))
    assert table.shape == (16, 3)
    assert table[5].tolist() == [BASE + 5 * 6 * 128, 6 * 128, 0]
    indices = pagemap.region_indices(np.array([3, 9]), PAGE.num_regions, PAGE.num_pages)
    assert indices.tolist() == [3, 9]  # two descriptors carry both pages of all 3 layers


def test_one_registration_covers_the_pool() -> None:
    kv, _ = region_tables(page_major_regions())
    assert kv.tolist() == [[BASE, PAGE.pool_bytes, 0]]


def test_the_layout_is_in_the_hash_and_layer_major_keeps_its_old_one() -> None:
    # the value main computed before page-major existed: old decodes still match
    assert LAYER.compat_hash() == "cda3f66c179a6eab"
    assert PAGE.compat_hash() != LAYER.compat_hash()
    assert dataclasses.replace(PAGE, num_pages=99).compat_hash() == PAGE.compat_hash()


def test_addresses_that_do_not_fit_a_page_major_pool_are_refused() -> None:
    regions = page_major_regions()
    with pytest.raises(ValueError, match="a page_major pool puts layer l's K"):
        KVRegions(PAGE, regions.v_base_addrs, regions.k_base_addrs, "cpu", 1, 1)
    with pytest.raises(ValueError, match="one address per layer needed"):
        KVRegions(PAGE, regions.k_base_addrs[:2], regions.v_base_addrs, "cpu", 1, 1)
    with pytest.raises(ValueError, match="pool layout 'diagonal'"):
        dataclasses.replace(PAGE, kind="diagonal")


def test_the_wire_carries_the_kind_only_when_page_major() -> None:
    metadata = wire.frame_metadata(b"md")
    page = wire.Register.of("d", metadata, page_major_regions(), PAGE.compat_hash())
    assert msgpack.unpackb(wire.encode(page))["layout"]["kind"] == "page_major"
    decoded = wire.decode(wire.encode(page))
    assert isinstance(decoded, wire.Register) and decoded.regions == page_major_regions()
    starts = tuple(BASE + i * LAYER.region_bytes for i in range(6))
    layer_regions = KVRegions(LAYER, starts[:3], starts[3:], "cpu", 5 << 30, 4)
    layer = wire.Register.of("d", metadata, layer_regions, LAYER.compat_hash())
    assert "kind" not in msgpack.unpackb(wire.encode(layer))["layout"]


def test_a_page_major_register_with_scattered_layers_is_a_wire_error() -> None:
    metadata = wire.frame_metadata(b"md")
    body = msgpack.unpackb(
        wire.encode(wire.Register.of("d", metadata, page_major_regions(), PAGE.compat_hash()))
    )
    body["v_base_addrs"] = [a + 4096 for a in body["v_base_addrs"]]
    with pytest.raises(wire.WireError, match=re.escape("these addresses do not - at `$.k_base")):
        wire.decode(msgpack.packb(body, use_bin_type=True))


def test_a_decode_of_the_other_layout_is_refused_naming_both() -> None:
    msg = wire.Register.of(
        "d", wire.frame_metadata(b"md"), page_major_regions(), PAGE.compat_hash()
    )
    refusal = check_register(msg, LAYER, BootstrapLimits())
    assert refusal is not None and refusal.reason is RejectReason.LAYOUT_MISMATCH
    assert refusal.message.startswith(
        "KV layout mismatch: the decode pool is page_major, this worker's is layer_major"
    )
    assert check_register(msg, PAGE, BootstrapLimits()) is None


def test_describe_and_described_round_trip() -> None:
    described = wire.Described(
        agent_name="prefill-1",
        layout=wire.Layout.of(PAGE),
        compat_hash=PAGE.compat_hash(),
        peer_timeout_s=10.0,
        heartbeat_interval_s=1.0,
    )
    for msg in (wire.Describe(), described):
        assert wire.decode(wire.encode(msg)) == msg
    assert described.layout.to_kv() == PAGE
    assert msgspec.msgpack.decode(wire.encode(wire.Describe())) == {"v": 1, "type": "describe"}


@pytest.mark.parametrize(
    ("prompt", "cached", "page_size", "pages"),
    [(1, 0, 16, 1), (16, 0, 16, 1), (17, 0, 16, 2), (40, 16, 16, 2), (32, 32, 16, 0)],
)
def test_num_want_pages(prompt: int, cached: int, page_size: int, pages: int) -> None:
    assert num_want_pages(prompt, cached, page_size) == pages


@pytest.mark.parametrize(
    ("prompt", "cached", "page_size", "why"),
    [
        (40, 8, 16, "num_cached_tokens 8 must be a multiple of 16 in [0, 40]"),
        (40, 48, 16, "num_cached_tokens 48 must be a multiple of 16 in [0, 40]"),
        (0, 0, 16, "num_prompt_tokens (0) and page_size (16) must be >= 1"),
    ],
)
def test_num_want_pages_names_a_caller_error(
    prompt: int, cached: int, page_size: int, why: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(why)):
        num_want_pages(prompt, cached, page_size)
