"""vLLM's own NixlConnector of each version (the decode half, ``vllm_decode``: 0.33 and 0.34)
against this repository's vLLM handshake (``transfer.vllm.handshake``, that version's
``profiles`` row) and a minimal prefill (``vllm_prefill``): the hash we compute equals vLLM's;
vLLM pulls our LBHNC blocks byte-exact with no load errors and notifies us; a wrong hash fails
the pull as vLLM's scheduler would see it (finished, its blocks in
``get_block_ids_with_load_errors()``); a waiting request's heartbeats reach us. One decode
process, shared with ``test_vllm_worker`` (``conftest.vllm_decode``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from prefill_worker.transfer.vllm.handshake import CompatFactors, compat_hash
from prefill_worker.transfer.vllm.profiles import PROFILES
from tests.interop.vllm_decode import VllmDecodeProcess
from tests.interop.vllm_prefill import MinimalPrefill
from tests.polling import wait_until

pytestmark = pytest.mark.interop

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 2, 2, 32, 32  # CPU_ATTN: block size 32k


def write_config(directory: Path, num_layers: int, num_kv_heads: int, head_dim: int) -> Path:
    """A llama config.json (no weights: the connector reads shapes only)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4 * head_dim,
        "intermediate_size": 8 * head_dim,
        "num_attention_heads": 4,
        "num_key_value_heads": num_kv_heads,
        "num_hidden_layers": num_layers,
        "head_dim": head_dim,
        "vocab_size": 256,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def model_dir(vllm_checkpoint: Path) -> Path:
    return vllm_checkpoint  # the shared decode's model: 2 layers, 2 KV heads of 32


@pytest.fixture(scope="module")
def decode(vllm_decode: VllmDecodeProcess) -> VllmDecodeProcess:
    return vllm_decode


def factors(model_dir: Path, version: str) -> CompatFactors:
    """The decode's factors as a decode of ``version`` hashes them."""
    base = CompatFactors(
        model=str(model_dir),
        dtype="float32",
        num_kv_heads=NUM_KV_HEADS,
        head_size=HEAD_DIM,
        num_layers=NUM_LAYERS,
        attn_backend_name="CPU_ATTN",
    )
    return base.for_profile(PROFILES[version])


@pytest.fixture
def prefill(
    model_dir: Path, decode: VllmDecodeProcess, request: pytest.FixtureRequest
) -> Iterator[MinimalPrefill]:
    """A prefill per test, each its own engine: vLLM keeps a handshaken engine's agent."""
    engine_id = f"prefill-{request.node.name}"
    ours = factors(model_dir, decode.version)
    served = MinimalPrefill(engine_id, ours, num_blocks=16, block_size=BLOCK_SIZE)
    yield served
    served.close()


def test_our_hash_equals_vllms(decode: VllmDecodeProcess, model_dir: Path, tmp_path: Path) -> None:
    ours = factors(model_dir, decode.version)
    assert decode.call("info")["compat_hash"] == compat_hash(ours)
    others = [factors(model_dir, v) for v in PROFILES if v != decode.version]
    assert all(compat_hash(other) != compat_hash(ours) for other in others)
    other = write_config(tmp_path / "wide", num_layers=3, num_kv_heads=4, head_dim=64)
    spec = {"model_dir": str(other), "dtype": "bfloat16", "attn_backend_name": "FLASH_ATTN"}
    wide = CompatFactors(str(other), "bfloat16", num_kv_heads=4, head_size=64, num_layers=3)
    assert decode.call("hash", spec=spec)["compat_hash"] == compat_hash(
        wide.for_profile(PROFILES[decode.version])
    )


def test_vllm_pulls_our_blocks_byte_exact(
    decode: VllmDecodeProcess, prefill: MinimalPrefill, tmp_path: Path
) -> None:
    remote_blocks = [5, 2, 9]  # scattered, out of order
    params = prefill.kv_transfer_params("req-a", remote_blocks, num_tokens=3 * BLOCK_SIZE - 7)
    outcome = decode.pull_and_wait("dec-a", params)
    assert outcome["finished"] and outcome["load_errors"] == []
    pulled = decode.blocks("dec-a", tmp_path / "a.npz")
    expected = prefill.block_bytes(remote_blocks)
    for layer, want in enumerate(expected):
        got = pulled[f"model.layers.{layer}.self_attn.attn"]
        assert got.shape == want.shape and np.array_equal(got, want), f"layer {layer}"
    wait_until(lambda: b"req-a:1" in prefill.notifs, 10, "vLLM's read notification")


def test_a_full_prefix_hit_only_notifies(
    decode: VllmDecodeProcess, prefill: MinimalPrefill
) -> None:
    params = prefill.kv_transfer_params("req-p", [4, 6], num_tokens=2 * BLOCK_SIZE)
    decode.call("pull", request_id="dec-p", params=params, num_local=0)
    wait_until(lambda: b"req-p:1" in prefill.notifs, 10, "vLLM's notification")
    assert decode.call("wait", request_id="dec-p", deadline_s=1)["load_errors"] == []


def test_a_wrong_hash_fails_the_pull_with_load_errors(
    decode: VllmDecodeProcess, model_dir: Path
) -> None:
    wrong = MinimalPrefill(
        "prefill-wrong", factors(model_dir, decode.version), 16, BLOCK_SIZE, hash_override="0" * 64
    )
    try:
        params = wrong.kv_transfer_params("req-w", [1, 2], num_tokens=40)
        outcome = decode.pull_and_wait("dec-w", params)
    finally:
        wrong.close()
    assert outcome["finished"]
    assert outcome["load_errors"] == sorted(outcome["blocks"]) and outcome["blocks"]
    assert wrong.side.stats.num_served == 1  # it answered; vLLM refused the hash


def test_a_034_decode_refuses_metadata_without_region_members(
    decode: VllmDecodeProcess, model_dir: Path
) -> None:
    """What the 0.34 profile adds is needed: the 0.34 hash over 0.33's metadata fields (no
    ``region_members``) passes vLLM 0.34's hash check and fails its region pairing."""
    if decode.version != "0.34.0":
        pytest.skip("v16 metadata is 0.34's")
    ours = factors(model_dir, decode.version)
    old = MinimalPrefill("prefill-v15", ours, 16, BLOCK_SIZE, metadata_version="0.33.0")
    try:
        params = old.kv_transfer_params("req-v15", [1, 2], num_tokens=40)
        outcome = decode.pull_and_wait("dec-v15", params)
    finally:
        old.close()
    assert outcome["finished"]
    assert outcome["load_errors"] == sorted(outcome["blocks"]) and outcome["blocks"]
    assert old.side.stats.num_served == 1
    assert "prefill-v15 did not advertise the layers of its KV regions" in (
        decode.log_path.read_text(errors="replace")
    )


def test_a_waiting_request_heartbeats(decode: VllmDecodeProcess, prefill: MinimalPrefill) -> None:
    params = prefill.kv_transfer_params("req-h", [3], num_tokens=10)
    decode.call("hold", request_id="dec-h", params=params, interval_s=0.1)
    try:
        wait_until(lambda: prefill.notifs.count(b"HB:req-h") >= 2, 20, "two heartbeats")
    finally:
        decode.call("release", request_id="dec-h")
