"""vLLM's handshake, prefill side (``transfer.vllm.handshake``, ``profiles``): the hash against
values vLLM 0.33 and 0.34 computed, the metadata's wire shape per version, and the side
channel over real ZMQ, hostile input included. (tests/interop/test_vllm_pull.py checks the
same against vLLM itself.)"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
import zmq
from pydantic import ValidationError

from prefill_worker.service.schema import TransferConfig
from prefill_worker.transfer.vllm.handshake import (
    DEFAULT_SIDE_CHANNEL_PORT,
    GET_META_MSG,
    CompatFactors,
    SideChannel,
    compat_hash,
    encode_payload,
    side_channel_port,
)
from prefill_worker.transfer.vllm.profiles import PROFILES, LayerRegion, agent_metadata

# vLLM 0.33.0's compute_nixl_compatibility_hash for a 2-layer llama config.json at /tmp/vmodel
# (float32, 2 KV heads, head size 32), CPU_ATTN, default cache dtype, HMA on, pull.
VLLM_HASH = "74f7f8d2490ac0fba4f989c16d6448659a2ca63a2085376d292aa474f19c1847"
FACTORS = CompatFactors(
    model="/tmp/vmodel",
    dtype="float32",
    num_kv_heads=2,
    head_size=32,
    num_layers=2,
    attn_backend_name="CPU_ATTN",
)
# vLLM 0.34.0's compute_nixl_compatibility_hash (its decode connector's own compat_hash) for
# a 2-layer qwen3 config.json at /tmp/smoke-0.34.0/qwen3 (float32, 2 KV heads, head size 32),
# CPU_ATTN, default cache dtype, HMA on, pull.
VLLM_034_HASH = "08cf9446d542e9443c1e1685f9b543ba78429db8fe23417a44139c06ec3a55b2"
FACTORS_034 = CompatFactors("/tmp/smoke-0.34.0/qwen3", "float32", 2, 32, 2, "CPU_ATTN")
# vLLM 0.33.0's NixlAgentMetadata fields, in order (msgspec writes a map in field order).
VLLM_FIELDS = [
    "engine_id",
    "agent_metadata",
    "kv_caches_base_addr",
    "device_id",
    "num_blocks",
    "block_lens",
    "block_strides",
    "kv_cache_layout",
    "block_size",
    "ssm_sizes",
    "attn_backend_name",
    "physical_blocks_per_logical_kv_block",
    "region_num_blocks",
    "region_group_ids",
    "region_names",
    "region_mem_types",
    "dcp_size",
    "pcp_size",
    "ple_block_len",
    "region_members",
    "packed_member_layouts",
]


def test_hash_equals_vllms_for_the_same_config() -> None:
    assert compat_hash(FACTORS) == VLLM_HASH
    assert compat_hash(FACTORS.for_profile(PROFILES["0.33.0"])) == VLLM_HASH
    assert compat_hash(FACTORS_034.for_profile(PROFILES["0.34.0"])) == VLLM_034_HASH
    assert compat_hash(FACTORS_034) != VLLM_034_HASH  # a 0.33 payload: a 0.34 decode refuses
    assert compat_hash(CompatFactors(**{**_fields(FACTORS), "dtype": "torch.float32"})) == (
        VLLM_HASH
    )


@pytest.mark.parametrize(
    "change",
    [
        {"model": "/tmp/other"},
        {"dtype": "bfloat16"},
        {"num_kv_heads": 4},
        {"head_size": 64},
        {"num_layers": 3},
        {"attn_backend_name": "FLASH_ATTN"},
        {"cache_dtype": "fp8"},
        {"is_hma_enabled": False},
        {"transfer_mode": "push"},
        {"vllm_version": "0.34.0"},
        {"connector_version": 16},
    ],
)
def test_every_factor_changes_the_hash(change: dict[str, object]) -> None:
    assert compat_hash(CompatFactors(**{**_fields(FACTORS), **change})) != VLLM_HASH


def _fields(factors: CompatFactors) -> dict[str, object]:
    return {name: getattr(factors, name) for name in CompatFactors.__slots__}


def _metadata(version: str = "0.33.0") -> bytes:
    layers = [
        LayerRegion(f"model.layers.{i}.self_attn.attn", 4096 * (i + 1), 16384) for i in (0, 1)
    ]
    meta = agent_metadata(PROFILES[version], "prefill-0", b"blob", layers, 16, 32, "CPU_ATTN")
    return encode_payload(VLLM_HASH, meta)


def test_payload_carries_the_hash_and_vllms_metadata_fields_in_order() -> None:
    outer = msgspec.msgpack.decode(_metadata())
    assert list(outer) == ["compatibility_hash", "agent_metadata_bytes"]
    assert outer["compatibility_hash"] == VLLM_HASH
    inner = msgspec.msgpack.decode(outer["agent_metadata_bytes"])
    assert list(inner) == VLLM_FIELDS
    assert inner["kv_caches_base_addr"] == [4096, 8192]
    assert inner["block_lens"] == inner["block_strides"] == [16384, 16384]
    assert inner["region_num_blocks"] == [16, 16]
    assert inner["region_group_ids"] == [0, 0]
    assert inner["region_mem_types"] == ["DRAM", "DRAM"]
    assert (inner["kv_cache_layout"], inner["block_size"], inner["ssm_sizes"]) == (
        "LBHNC",
        32,
        [0, 0],
    )


def test_a_034_payload_names_each_regions_layer_and_its_group() -> None:
    """vLLM 0.34 pairs regions by the layers both sides hold: it raises unless
    ``region_members`` has one entry per region; ``layer_group_ids`` is new in v16."""
    inner = msgspec.msgpack.decode(
        msgspec.msgpack.decode(_metadata("0.34.0"))["agent_metadata_bytes"]
    )
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    assert list(inner) == [*VLLM_FIELDS[:-1], "layer_group_ids", VLLM_FIELDS[-1]]
    assert inner["region_members"] == [[name] for name in names]
    assert inner["region_names"] == names
    assert inner["layer_group_ids"] == dict.fromkeys(names, 0)
    assert inner["kv_caches_base_addr"] == [4096, 8192]
    v33 = msgspec.msgpack.decode(msgspec.msgpack.decode(_metadata())["agent_metadata_bytes"])
    assert v33["region_members"] == [] and "layer_group_ids" not in v33


def test_side_channel_port_adds_the_dp_index() -> None:
    assert side_channel_port(5600, 0) == 5600
    assert side_channel_port(5600, 3) == 5603


def test_the_side_channel_port_comes_from_config_with_vllms_default() -> None:
    assert TransferConfig().vllm_side_channel_port == DEFAULT_SIDE_CHANNEL_PORT == 5600
    assert TransferConfig(vllm_side_channel_port=6100).vllm_side_channel_port == 6100
    with pytest.raises(ValidationError, match="vllm_side_channel_port"):
        TransferConfig(vllm_side_channel_port=70000)


def test_the_versions_served_come_from_config_and_each_must_have_a_profile() -> None:
    assert TransferConfig().vllm_versions == ["0.33.0", "0.34.0"]
    assert TransferConfig(vllm_versions=["0.34.0"]).vllm_versions == ["0.34.0"]
    for bad, why in (
        (["0.32.0"], "no profile for"),
        (["0.34.0", "0.34.0"], "twice"),
        ([], "at least 1"),
    ):
        with pytest.raises(ValidationError, match=why):
            TransferConfig(vllm_versions=bad)


@pytest.fixture
def channel() -> Iterator[tuple[SideChannel, str]]:
    """Bound on port 0: every test here reaches it on the port it says the kernel picked."""
    side = SideChannel("127.0.0.1", 0, {(0, 0): _metadata()})
    assert side.port > 0
    yield side, f"tcp://127.0.0.1:{side.port}"
    side.close()


def _ask(side: SideChannel, address: str, message: bytes) -> list[bytes] | None:
    """A REQ socket as vLLM's decode uses it; -> the reply frames, or None when unanswered."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send(message)
        side.serve(timeout_ms=2000)
        return sock.recv_multipart() if sock.poll(200) else None
    finally:
        sock.close(linger=0)


def test_a_decode_gets_the_payload_and_our_clock(channel: tuple[SideChannel, str]) -> None:
    side, address = channel
    reply = _ask(side, address, msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
    assert reply is not None and len(reply) == 2
    assert reply[0] == _metadata()
    assert isinstance(msgspec.msgpack.decode(reply[1]), float)
    assert side.stats.num_served == 1 and not side.stats.refused


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        (b"\xc1garbage", "malformed"),
        (msgspec.msgpack.encode(("get_meta_msg", 0, 0)), "malformed"),  # str, not bytes
        (msgspec.msgpack.encode((GET_META_MSG, 0)), "malformed"),
        (msgspec.msgpack.encode((b"get_other", 0, 0)), "unknown_message"),
        (msgspec.msgpack.encode((GET_META_MSG, 0, 1)), "unknown_rank"),
        (msgspec.msgpack.encode((GET_META_MSG, 1, 0)), "unknown_rank"),
        (msgspec.msgpack.encode((b"x" * 300, 0, 0)), "too_large"),
    ],
    ids=["garbage", "str_message", "pair", "other_message", "other_tp", "other_pp", "large"],
)
def test_bad_requests_are_counted_unanswered_and_harmless(
    channel: tuple[SideChannel, str], message: bytes, reason: str
) -> None:
    side, address = channel
    assert _ask(side, address, message) is None
    assert side.stats.refused == {reason: 1} and side.stats.num_served == 0
    good = _ask(side, address, msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
    assert good is not None and good[0] == _metadata()


def test_wrong_frame_count_is_refused(channel: tuple[SideChannel, str]) -> None:
    side, address = channel
    sock = zmq.Context.instance().socket(zmq.DEALER)  # no empty delimiter frame
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sock.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
    side.serve(timeout_ms=2000)
    sock.close(linger=0)
    assert side.stats.refused == {"frames": 1}


def test_set_payload_replaces_what_a_rank_serves(channel: tuple[SideChannel, str]) -> None:
    side, address = channel
    side.set_payload(0, 1, b"other")
    reply = _ask(side, address, msgspec.msgpack.encode((GET_META_MSG, 0, 1)))
    assert reply is not None and reply[0] == b"other"


def test_a_taken_port_raises(channel: tuple[SideChannel, str]) -> None:
    _, address = channel
    port = int(address.rsplit(":", 1)[1])
    with pytest.raises(zmq.ZMQError):
        SideChannel("127.0.0.1", port, {})
