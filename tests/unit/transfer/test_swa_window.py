"""Which pages each layer of a sliding-window model sends (``transfer.swa_window``): SGLang
0.5.23's swa payload range for a window decode, every page from the prefix on for a full pool."""

from __future__ import annotations

import pytest

from prefill_worker.transfer.swa_window import (
    FULL_POOL,
    SWA_UNSUPPORTED,
    WINDOW,
    decode_window_tokens,
    layer_pages,
    pages_sent,
    refusal,
)


def test_a_sliding_layer_sends_the_pages_of_its_last_window():
    # gpt-oss: sliding_window 128 -> the decode keeps 127 tokens; 1000 tokens, pages of 16:
    # window_start = 1000 - 127 = 873 -> page 54 (873 // 16); the last page is 62 (1000 / 16)
    window = decode_window_tokens(128)
    assert window == 127
    assert layer_pages(1000, 16, 0, window, WINDOW) == range(54, 63)
    assert layer_pages(1000, 16, 0, None, WINDOW) == range(0, 63)  # a full layer: all


def test_a_window_starting_on_a_page_boundary_and_a_short_prompt():
    assert layer_pages(64, 16, 0, 32, WINDOW) == range(2, 4)  # [32, 64)
    assert layer_pages(65, 16, 0, 32, WINDOW) == range(2, 5)  # [33, 65) from page 2
    assert layer_pages(20, 16, 0, 127, WINDOW) == range(0, 2)  # shorter than the window


def test_the_decodes_prefix_bounds_both_kinds():
    # SGLang: window_start = max(decode prefix, seq_len - window)
    assert layer_pages(1000, 16, 960, 127, WINDOW) == range(60, 63)
    assert layer_pages(1000, 16, 960, None, WINDOW) == range(60, 63)
    assert layer_pages(1000, 16, 100, 127, WINDOW) == range(54, 63)


def test_the_full_pool_mode_sends_every_layer_whole():
    assert layer_pages(1000, 16, 0, 127, FULL_POOL) == range(0, 63)
    assert layer_pages(1000, 16, 32, 127, FULL_POOL) == range(2, 63)


def test_a_gpt_oss_shaped_32k_prompt_sends_about_half():
    windows = [127 if i % 2 == 0 else None for i in range(24)]  # gpt-oss-20b: 24 layers
    full = pages_sent(windows, 32768, 16, 0, FULL_POOL)
    window = pages_sent(windows, 32768, 16, 0, WINDOW)
    assert full == 24 * 2048
    assert window == 12 * 2048 + 12 * 8  # [32641, 32768): pages 2040..2047
    assert window / full < 0.51


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="unknown swa send mode"):
        layer_pages(10, 16, 0, 4, "ring")
    with pytest.raises(ValueError, match="bad request span"):
        layer_pages(10, 16, 11, 4, WINDOW)
    assert refusal("sglang").startswith(f"{SWA_UNSUPPORTED}: the sglang protocol")


def test_a_protocol_not_proven_refuses_a_claimed_room():
    """SGLang's sends of a sliding-window model are proven against its decode
    (tests/interop/test_swa_landing.py), vLLM 0.34's too (tests/interop/test_vllm_hybrid.py:
    its backend refuses other versions itself); a protocol outside them is refused."""
    from prefill_worker.kv.aux import AuxPool
    from prefill_worker.kv.pages import PagePool
    from prefill_worker.transfer.base import KVPoll
    from prefill_worker.transfer.swa_window import guard_unproven
    from tests.unit.scheduler.fakes import FakeBackend

    names = ("native", "sglang", "vllm", "other")
    inner = {n: FakeBackend(PagePool(8), AuxPool(2), auto_want=True) for n in names}
    guarded = guard_unproven(inner)
    assert all(guarded[n] is inner[n] for n in ("native", "sglang", "vllm"))
    native, other = (guarded[n].create_sender(7, "r", 12) for n in ("native", "other"))
    assert native.poll() is not KVPoll.FAILED
    assert other.poll() is KVPoll.FAILED
    assert other.failure_reason() == refusal("other")
    assert inner["other"].senders["r"].worker_failure == refusal("other")
    assert not inner["other"].senders["r"].sent
