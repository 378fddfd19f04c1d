"""A hybrid model's KV-cache groups as vLLM 0.34 builds them (the layer-to-group rule of
``kv_cache_planning``; a sliding group's window's blocks, a mamba group's one state block),
what the handshake says of them, the answer's block list per group, a linear model's pull cut
one token short, and the refusal of a decode version or mode not proven to read them (400 at
the HTTP front, before a ticket opens). vLLM's own decode reading them: tests/interop/
test_vllm_hybrid.py, test_vllm_linear.py."""

from __future__ import annotations

import json
import re

import msgspec
import pytest

from prefill_worker.ingress.http.bodies import BadRequest, read_completion
from prefill_worker.ingress.http.pull import open_pulls, trim_pulls
from prefill_worker.request import PrefillRequest, SamplingParams
from prefill_worker.transfer.swa_window import SlidingLayers
from prefill_worker.transfer.vllm.desk import pull_params
from prefill_worker.transfer.vllm.groups import (
    FULL_ATTENTION,
    hma_groups,
    layer_names,
    linear_groups,
    one_group,
    sliding_groups,
)
from prefill_worker.transfer.vllm.profiles import PROFILES, PUSH, LayerRegion, agent_metadata
from prefill_worker.transfer.vllm.tickets import Tickets
from tests.clocks import FakeClock
from tests.unit.ingress.test_http_pull import PROXY_ASK
from tests.unit.transfer.vllm.test_sender import _desk, _staged

W = 24  # a window of 24 tokens over blocks of 32: cdiv(24, 32) + 1 = 2 blocks
S, F = W, FULL_ATTENTION


def _groups(windows: list[int | None], block_size: int = 32) -> tuple[int, ...]:
    return hma_groups(windows, block_size, [f"l{i}" for i in range(len(windows))]).layer_group


def test_layers_are_grouped_as_vllm_groups_them() -> None:
    assert _groups([S, F, S]) == (0, 2, 1)  # tiny gpt-oss: [L0] [L2] [L1]
    assert _groups([S, F, S, S]) == (0, 3, 1, 2)  # tiny Gemma 3: [L0] [L2] [L3] [L1]
    assert _groups([S, F] * 12) == (0, 1) * 12  # gpt-oss-20b: evens, odds
    assert _groups([S] * 5 + [F]) == (0, 1, 2, 3, 4, 5)  # Gemma 3's 5:1
    assert _groups([S] * 10 + [F] * 2) == (0, 1, 2, 3, 4) * 2 + (5, 5)  # 5 groups of 2 + full
    # 12 sliding + 13 full: under 1.5x, so groups of 13 (vLLM pads the sliding one)
    assert _groups([S, F] * 12 + [F]) == (0, 1) * 12 + (1,)
    assert _groups([F, S, S, S]) == (0, 1, 2, 3)  # the first layer's kind is group 0
    assert _groups([F] * 4) == (0,) * 4


def test_a_sliding_group_sends_the_blocks_its_window_needs() -> None:
    groups = hma_groups([S, F, S], 32, layer_names("GptOssForCausalLM", 3))
    assert groups.window_blocks == (2, 2, None) and groups.num_groups == 3
    assert groups.block_ids([7, 8, 9, 10]) == [[9, 10], [9, 10], [7, 8, 9, 10]]
    assert groups.block_ids([7]) == [[7], [7], [7]]
    assert hma_groups([64, F], 32, ["a", "b"]).window_blocks == (3, None)
    assert hma_groups([64, F], 16, ["a", "b"]).window_blocks == (5, None)
    assert groups.names[1] == "model.layers.1.attn.attn"
    assert layer_names("Gemma3ForCausalLM", 1) == ("model.layers.0.self_attn.attn",)
    assert one_group(["a", "b"]).block_ids([3, 4]) == [[3, 4]]
    with pytest.raises(ValueError, match="2 names for 3 layers"):
        hma_groups([S, F, S], 32, ["a", "b"])


def test_a_sliding_model_s_groups_come_from_its_config_window() -> None:
    layers = SlidingLayers((0, 2), 3, window_tokens=W - 1)  # swa_window keeps window - 1
    groups = sliding_groups(layers, "GptOssForCausalLM", 32)
    assert groups.layer_group == (0, 2, 1) and groups.window_blocks == (2, 2, None)
    assert sliding_groups(SlidingLayers((0,), 2, 32), "X", 32).window_blocks == (3, None)


def test_the_handshake_names_each_layer_s_group() -> None:
    groups = hma_groups([S, F, S], 32, layer_names("GptOssForCausalLM", 3))
    layers = [LayerRegion(groups.names[i], 4096 * i, 512, groups.layer_group[i]) for i in range(3)]
    meta = agent_metadata(PROFILES["0.34.0"], "e", b"agent", layers, 8, 32, "CPU_ATTN")
    fields = msgspec.to_builtins(meta)
    assert fields["region_group_ids"] == [0, 2, 1]
    assert fields["layer_group_ids"] == {
        "model.layers.0.attn.attn": 0,
        "model.layers.1.attn.attn": 2,
        "model.layers.2.attn.attn": 1,
    }
    assert fields["region_members"] == [[name] for name in groups.names]


def test_the_answer_lists_blocks_per_group() -> None:
    desk, _ = _desk(FakeClock(100.0))
    desk.groups = hma_groups([S, F], 32, ["a", "b"])
    _staged(desk, 5, 100, "0.34.0")  # 4 blocks
    params = desk.tickets.take(5)
    assert params is not None
    assert params["remote_block_ids"] == [[2, 3], [0, 1, 2, 3]]
    identity = desk.identities["0.34.0"]
    assert pull_params(identity, "h", [4], 3)["remote_block_ids"] == [[4]]  # one group


@pytest.mark.parametrize(
    ("version", "mode", "reason"),
    [
        ("0.33.0", "pull", "swa_unsupported: vLLM 0.33.0 decodes get no sliding-window"),
        (None, "pull", "swa_unsupported: vLLM 0.33.0 decodes"),  # none named: the first served
        ("0.34.0", PUSH, "swa_unsupported: vLLM's push mode does not carry sliding-window"),
    ],
)
def test_a_decode_not_proven_to_read_the_groups_is_refused_400_before_a_ticket_opens(
    version: str | None, mode: str, reason: str
) -> None:
    tickets = Tickets(4, ("0.33.0", "0.34.0"), ("pull", PUSH), needs_kv_groups=True)
    ask = {**PROXY_ASK, "transfer_mode": mode, **({"vllm_version": version} if version else {})}
    body = {"prompt": [1, 2], "kv_transfer_params": ask, "request_id": "r"}
    with pytest.raises(BadRequest, match=re.escape(reason)) as refused:
        open_pulls(tickets, read_completion(json.dumps(body).encode(), 8))
    assert refused.value.status == 400 and len(tickets) == 0
    assert tickets.why_refused("0.34.0") is None
    assert Tickets(4, ("0.33.0",)).why_refused("0.33.0") is None  # a model of one group
    assert "name vLLM 0.34.0" in (tickets.why_refused("0.33.0") or "")


def test_a_linear_model_s_groups_send_one_state_block_per_mamba_group() -> None:
    groups = linear_groups((0, 2, 3), 5, 32)  # tiny Qwen3-Next: vLLM's [L0 L3] [L2] [L1 L4]
    assert groups.layer_group == (0, 2, 1, 0, 2) and groups.window_blocks == (1, 1, None)
    assert groups.kv_layers == (1, 4) and groups.state_layers == (0, 2, 3)
    assert groups.names[0] == "model.layers.0.linear_attn"
    assert groups.names[1] == "model.layers.1.self_attn.attn"
    assert groups.block_ids([5, 6, 7]) == [[7], [7], [5, 6, 7]]


def test_a_vllm_pull_of_a_linear_model_is_cut_one_token_short() -> None:
    tickets = Tickets(4, ("0.34.0",), has_linear_state=True)
    body = {"prompt": [1, 2, 3], "kv_transfer_params": PROXY_ASK}
    prompts = read_completion(json.dumps(body).encode(), 8)
    plain = read_completion(json.dumps({"prompt": [1, 2, 3], "bootstrap_room": 5}).encode(), 8)
    requests = [_request([1, 2, 3]), _request([1, 2, 3])]
    trimmed = trim_pulls(tickets, [*prompts, *plain], requests)
    assert list(trimmed[0].token_ids) == [1, 2] and list(trimmed[1].token_ids) == [1, 2, 3]
    one = trim_pulls(tickets, prompts, [_request([9])])  # vLLM backs off only past one token
    assert list(one[0].token_ids) == [9]
    assert trim_pulls(Tickets(4), prompts, requests[:1]) == requests[:1]
    assert "state_unsupported: vLLM 0.33.0" in (
        Tickets(4, ("0.33.0", "0.34.0"), has_linear_state=True).why_refused(None) or ""
    )


def _request(ids: list[int]) -> PrefillRequest:
    return PrefillRequest("r", ids, SamplingParams(), False, 1, 0.0)
