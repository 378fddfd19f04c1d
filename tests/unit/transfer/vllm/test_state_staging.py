"""A linear-attention hybrid's state in vLLM 0.34's GDN page layout (``state_staging``): conv
as ours, the recurrent matrix transposed to ``[Hv, Dv, Dk]`` and cast to the decode's
``mamba_ssm_cache_dtype``, padding untouched; the dtype vLLM's decode picks by default; the
write queued behind the request's repacks, the answer after it, every block back on every path.
vLLM's own decode reading the pages: tests/interop/test_vllm_linear.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from prefill_worker.kv.state_layout import StateComponent, StateRegions, StateTensor
from prefill_worker.transfer.base import KVPoll
from prefill_worker.transfer.vllm.sender import VllmSender
from prefill_worker.transfer.vllm.state_staging import (
    StagingRefused,
    StatePage,
    StateStaging,
    decode_ssm_dtype,
)
from tests.clocks import FakeClock
from tests.polling import wait_until
from tests.unit.transfer.vllm.test_sender import BLOCKS, _desk, _GatedRepacker

CONV, REC = (6, 3), (2, 4, 5)  # [conv_dim, kernel - 1], ours [Hv, Dk, Dv]: odd, unequal


def _state(
    conv_dtype: torch.dtype = torch.float32, num_slots: int = 3
) -> tuple[StateRegions, torch.Tensor, torch.Tensor]:
    conv = torch.randn(2, num_slots, *CONV).to(conv_dtype)  # [layers, slots, ...]
    rec = torch.randn(2, num_slots, *REC)  # fp32, as the worker keeps it
    name = str(conv_dtype).removeprefix("torch.")
    tensors = (
        StateTensor("conv", CONV, name, conv[0, 0].numel() * conv.element_size()),
        StateTensor("recurrent", REC, "float32", rec[0, 0].numel() * 4),
    )
    component = StateComponent("linear_state", (0, 2), tensors, num_slots)
    addrs = tuple(tuple(t[i].data_ptr() for i in range(2)) for t in (conv, rec))
    return StateRegions(component, addrs, "cpu"), conv, rec


def _page(staging: StateStaging, layer: int, block: int, dtype: torch.dtype) -> tuple:  # type: ignore[type-arg]
    page = staging.page_view(layer, block)
    conv_bytes, rec_bytes = staging.page.ssm_sizes
    conv = page[:conv_bytes].clone()
    rec = page[conv_bytes : conv_bytes + rec_bytes].clone().view(dtype).view(REC[0], REC[2], REC[1])
    return conv, rec, page[conv_bytes + rec_bytes :]


def test_the_state_lands_in_vllm_s_page_layout() -> None:
    """conv as ours, the recurrent matrix [Hv, Dv, Dk] (ours transposed), padding untouched."""
    state, conv, rec = _state()
    staging = StateStaging(state, num_blocks=4, page_bytes=512)
    assert staging.page == StatePage(72, 160, 512)
    assert staging.write(slot=2, block=3) == 2 * (72 + 160)
    for layer in range(2):
        got_conv, got_rec, pad = _page(staging, layer, 3, torch.float32)
        assert torch.equal(got_conv, conv[layer, 2].flatten().view(torch.uint8))
        assert torch.equal(got_rec, rec[layer, 2].transpose(1, 2))
        assert not pad.any() and not staging.page_view(layer, 2).any()
    with pytest.raises(StagingRefused, match="larger than a vLLM attention page"):
        StateStaging(state, num_blocks=4, page_bytes=200)


def test_a_bf16_model_s_state_is_cast_to_the_decode_s_ssm_dtype() -> None:
    """A bf16 model: conv bf16 bytes as ours; the fp32 recurrent matrix cast to bf16 (vLLM's
    default for Qwen3-Next) or kept fp32 (Qwen3.5's ``mamba_ssm_dtype``)."""
    state, conv, rec = _state(torch.bfloat16)
    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float32, "float32")):
        staging = StateStaging(state, num_blocks=2, page_bytes=512, ssm_dtype=name)
        assert staging.page.ssm_sizes == (36, 40 * dtype.itemsize)
        staging.write(slot=1, block=0)
        got_conv, got_rec, _ = _page(staging, 1, 0, dtype)
        assert torch.equal(got_conv, conv[1, 1].flatten().view(torch.uint8))
        assert torch.equal(got_rec, rec[1, 1].transpose(1, 2).to(dtype))
    with pytest.raises(StagingRefused, match="float8"):
        StateStaging(state, num_blocks=2, page_bytes=512, ssm_dtype="float8")


def test_the_decode_s_ssm_dtype_is_vllm_s_default_unless_set(tmp_path: Path) -> None:
    assert decode_ssm_dtype("auto", str(tmp_path), "bfloat16") == "bfloat16"  # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_next"}))
    assert decode_ssm_dtype("auto", str(tmp_path), "bfloat16") == "bfloat16"  # Qwen3-Next
    qwen35 = {"model_type": "qwen3_5", "text_config": {"mamba_ssm_dtype": "float32"}}
    (tmp_path / "config.json").write_text(json.dumps(qwen35))
    assert decode_ssm_dtype("auto", str(tmp_path), "bfloat16") == "float32"
    assert decode_ssm_dtype("float16", str(tmp_path), "bfloat16") == "float16"


def test_the_answer_waits_for_the_state_and_every_block_returns() -> None:
    """The state write is queued behind the repacks: the request succeeds (its answer, hence
    the decode's READ) only once it is done, its last block's pages then hold the slot's state;
    a request closed while its write is queued, or ended before staging, or never read (the
    lease), gives every block back."""
    repacker = _GatedRepacker()
    clock = FakeClock(100.0)
    desk, _ = _desk(clock, repacker)
    state, conv, rec = _state(num_slots=4)
    desk.state_staging = StateStaging(state, BLOCKS, desk.staging.layout.block_bytes)
    assert desk.tickets.open(3)
    sender = VllmSender(desk, 3, 40)  # two blocks
    assert sender.poll() is KVPoll.READY
    sender.send_pages([0, 1, 2], 0)
    sender.send_aux(2)  # its slot
    assert sender.poll() is KVPoll.TRANSFERRING and not desk.state_staging.page_view(0, 1).any()
    repacker.gate.set()
    wait_until(lambda: sender.poll().is_terminal, what="the repacks and the state write end")
    assert sender.poll() is KVPoll.SUCCESS
    params = desk.tickets.take(3)
    assert params is not None
    (blocks,) = params["remote_block_ids"]
    for layer in range(2):
        got_conv, got_rec, _ = _page(desk.state_staging, layer, blocks[-1], torch.float32)
        assert torch.equal(got_conv, conv[layer, 2].flatten().view(torch.uint8))
        assert torch.equal(got_rec, rec[layer, 2].transpose(1, 2))
    sender.close()
    clock.now += 40.0  # never read: the lease (30 s) and its grace (5 s) end
    desk.expire()
    assert desk.staging.num_free == BLOCKS and desk.holds.counts.expired == 1

    repacker.gate.clear()
    assert desk.tickets.open(4)
    closed = VllmSender(desk, 4, 40)
    assert closed.poll() is KVPoll.READY
    closed.send_aux(1)  # its write queued behind the closed gate
    closed.fail("aborted by the router")
    repacker.gate.set()
    closed.close()  # waits for the write, then frees
    assert desk.staging.num_free == BLOCKS and not desk.has_repacks()
    assert desk.tickets.open(5)
    early = VllmSender(desk, 5, 70)
    assert early.poll() is KVPoll.READY
    early.fail("engine_error")
    early.close()
    assert desk.staging.num_free == BLOCKS
    repacker.shutdown()
