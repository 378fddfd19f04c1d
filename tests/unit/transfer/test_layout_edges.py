"""KV layouts: what ``/readyz`` publishes, hashes that tell page-major shapes apart, and the
words of a refused layout (found unpinned by mutation testing, `make mutation`)."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from prefill_worker.kv.layout import MLA, PAGE_MAJOR, VLLM_BLOCKS, KVLayout, KVRegions

OURS = KVLayout(2, 2, 8, "bfloat16", 4, 24)


def test_the_summary_names_every_field_and_the_hash() -> None:
    assert OURS.summary() == {
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 8,
        "dtype": "bfloat16",
        "page_size": 4,
        "num_pages": 24,
        "kind": "layer_major",
        "compat_hash": OURS.compat_hash(),
    }


def test_page_major_layouts_of_different_shapes_hash_apart() -> None:
    a = dataclasses.replace(OURS, kind=PAGE_MAJOR)
    b = dataclasses.replace(a, head_dim=16)
    assert len({OURS.compat_hash(), a.compat_hash(), b.compat_hash()}) == 3
    assert a.compat_hash() == dataclasses.replace(a, num_pages=7).compat_hash()


def test_an_unknown_kind_or_dtype_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError) as kind:
        dataclasses.replace(OURS, kind="ring")
    assert str(kind.value) == (
        "pool layout 'ring' is not one of layer_major, page_major, vllm_blocks, mla"
    )
    with pytest.raises(ValueError) as dtype:
        dataclasses.replace(OURS, dtype="int8")
    assert str(dtype.value) == ("dtype 'int8' is not one of float32, bfloat16, float16, fp8_e4m3")


def test_an_fp8_pool_is_one_byte_a_value_and_hashes_apart() -> None:
    fp8 = dataclasses.replace(OURS, dtype="fp8_e4m3")
    assert fp8.itemsize == 1 and fp8.page_bytes == 4 * 2 * 8 == OURS.page_bytes // 2
    assert fp8.pool_bytes == OURS.pool_bytes // 2
    assert fp8.compat_hash() != OURS.compat_hash()


def test_page_major_addresses_that_do_not_interleave_are_refused() -> None:
    layout = dataclasses.replace(OURS, kind=PAGE_MAJOR)
    page = layout.page_bytes
    with pytest.raises(ValueError) as refused:
        KVRegions(layout, (4096, 4096 + page), (4096 + page, 4096 + 3 * page), "cpu", 0, 0)
    assert str(refused.value) == (
        "k_base_addrs/v_base_addrs: a page_major pool puts layer l's K at "
        f"k_base_addrs[0] + 2l * page_bytes and its V page_bytes ({page}) later; "
        "these addresses do not"
    )


def test_an_mla_pool_is_one_latent_plane_per_layer() -> None:
    # DeepSeek-V3's row: kv_lora_rank 512 + qk_rope_head_dim 64 = 576 values per token per layer
    mla = KVLayout(61, 1, 576, "bfloat16", 1, 10, kind=MLA)
    assert (mla.planes, mla.num_regions) == (1, 61)
    assert mla.page_bytes == mla.region_page_bytes == mla.page_stride_bytes == 576 * 2
    assert mla.pool_bytes == 61 * 10 * 576 * 2
    mha = KVLayout(61, 128, 128, "bfloat16", 1, 10)
    assert mha.compat_hash() != mla.compat_hash()
    assert mla.summary()["kind"] == MLA
    with pytest.raises(ValueError, match="one latent per token"):
        KVLayout(2, 2, 576, "bfloat16", 1, 10, kind=MLA)
    small = dataclasses.replace(mla, num_layers=2)
    regions = KVRegions(small, (4096, 8192), (), "cpu", 0, 1)
    assert regions.region_base_addrs == (4096, 8192)
    with pytest.raises(ValueError, match="no V"):
        KVRegions(small, (4096, 8192), (1, 2), "cpu", 0, 1)


def test_a_vllm_blocks_pool_is_one_k_v_run_per_page_and_layer() -> None:
    """vLLM's LBHNC: per layer [pages, heads, page_size, 2 * head_dim], so a page of a layer is
    one region run of K and V (2 * page_bytes), a token 2 * head_dim items after the one before
    and a head page_size * 2 * head_dim; L regions, one per layer, each starting at its K."""
    lay = dataclasses.replace(OURS, kind=VLLM_BLOCKS)  # 2 layers, 2 heads of 8, bf16, pages of 4
    row = 8 * 2
    assert (lay.planes, lay.num_regions) == (2, 2)
    assert lay.page_bytes == 4 * 2 * row
    assert lay.region_page_bytes == lay.page_stride_bytes == 2 * lay.page_bytes
    assert (lay.token_stride_bytes, lay.head_stride_bytes) == (2 * row, 4 * 2 * row)
    assert (OURS.token_stride_bytes, OURS.head_stride_bytes) == (2 * row, row)
    assert lay.plane_span_bytes == 24 * 2 * lay.page_bytes - row  # V's last row ends the layer
    assert OURS.plane_span_bytes == 23 * OURS.page_stride_bytes + OURS.page_bytes
    assert lay.pool_bytes == OURS.pool_bytes == 2 * 2 * 24 * lay.page_bytes
    assert len({lay.compat_hash(), OURS.compat_hash(), PAGED.compat_hash()}) == 3
    base = 1 << 20
    k = (base, base + lay.region_bytes)
    regions = KVRegions(lay, k, tuple(a + row for a in k), "cpu", 0, 1)
    assert regions.region_base_addrs == k
    with pytest.raises(ValueError) as refused:
        KVRegions(lay, k, tuple(a + 2 * row for a in k), "cpu", 0, 1)
    assert str(refused.value) == (
        "k_base_addrs/v_base_addrs: a vllm_blocks pool puts each layer's V head_dim * "
        f"itemsize ({row}) bytes after its K; these addresses do not"
    )


PAGED = dataclasses.replace(OURS, kind=PAGE_MAJOR)

SCALED = KVLayout(2, 2, 8, "fp8_e4m3", 4, 24, kv_scales=(0.5, 0.25, 1.0, 2.0))


def test_kv_scales_are_a_k_and_a_v_per_layer_and_published() -> None:
    """An FP8 pool's checkpoint KV scales: every layer's K, then every V (docs/models.md)."""
    assert SCALED.scales_of(0) == (0.5, 1.0) and SCALED.scales_of(1) == (0.25, 2.0)
    other = dataclasses.replace(SCALED, kv_scales=(1.0, 2.0, 3.0, 4.0))  # built in the test
    assert other.scales_of(1) == (2.0, 4.0)
    assert dataclasses.replace(SCALED, kv_scales=()).scales_of(1) == (1.0, 1.0)
    assert SCALED.summary()["kv_scales"] == [0.5, 0.25, 1.0, 2.0]
    assert "kv_scales" not in dataclasses.replace(SCALED, kv_scales=()).summary()
    with pytest.raises(ValueError, match=r"^3 KV scales for 2 layers \(a K and a V each\)$"):
        dataclasses.replace(SCALED, kv_scales=(0.5, 0.25, 1.0))
    with pytest.raises(ValueError, match=r"^6 KV scales for 2 layers"):
        dataclasses.replace(SCALED, kv_scales=(0.5,) * 6)


def test_the_hash_covers_the_scales_as_docs_protocol_states() -> None:
    """docs/protocol.md: ``/scales=`` and the comma-joined ``repr`` of each scale."""
    key = "2/2/8/fp8_e4m3/4/scales=0.5,0.25,1.0,2.0"
    assert SCALED.compat_hash() == hashlib.sha256(key.encode()).hexdigest()[:16]
    unscaled = dataclasses.replace(SCALED, kv_scales=())
    assert unscaled.compat_hash() == hashlib.sha256(b"2/2/8/fp8_e4m3/4").hexdigest()[:16]


def test_a_windowed_pool_names_each_layers_page_count() -> None:
    """A windowed sliding pool (layer 0 slides, its own 5 pages): regions K0 K1 V0 V1 of 5,
    24, 5 and 24 pages, starting at 0, 5, 29 and 34 of a region-major list."""
    addrs = dict(k_base_addrs=(0x1000, 0x9000), v_base_addrs=(0x2000, 0xA000), device="cpu")
    regions = KVRegions(OURS, **addrs, aux_base_addr=0, num_aux_rows=1, layer_pages=(5, 24))
    assert regions.region_num_pages == (5, 24, 5, 24)
    assert regions.region_offsets == (0, 5, 29, 34)
    plain = KVRegions(OURS, **addrs, aux_base_addr=0, num_aux_rows=1)
    assert plain.region_num_pages == (24,) * 4 and plain.region_offsets == (0, 24, 48, 72)
    why = "layer_pages: one page count per layer, of a layer_major pool only"
    with pytest.raises(ValueError, match=why):
        KVRegions(OURS, **addrs, aux_base_addr=0, num_aux_rows=1, layer_pages=(5,))
    mla = dataclasses.replace(OURS, kind=MLA, num_kv_heads=1)
    with pytest.raises(ValueError, match=why):
        KVRegions(mla, (0x1000, 0x9000), (), "cpu", 0, 1, layer_pages=(5, 24))
