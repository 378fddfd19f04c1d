"""An FP8 KV pool served to vLLM decodes by the real worker process (``cache.kv_dtype:
fp8_e4m3``, ``transfer.vllm_kv_cache_dtype: fp8``): its side channel hashes the model dtype
(float32) and the cache dtype "fp8" apart, as an FP8 vLLM decode does; a prompt staged by the
forward itself (the KV mirror writes the FP8 bytes into the staging blocks) is READ by a
vLLM-shaped decode (tests/integration/vllm/decode.py) as transformers' K/V cast to e4m3 (the
same bytes, but for values at a rounding boundary: the adjacent code, at most 1 in 1000). The
prompt is one chunk: a later chunk attends over the first one's FP8 pages read back (as
SGLang's prefill does), so its deeper layers' K/V move off transformers' (docs/models.md).
vLLM's own connector against these bytes: tests/interop/test_vllm_fp8.py."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import numpy as np
import torch

from prefill_worker.transfer.vllm.handshake import CompatFactors, compat_hash
from prefill_worker.transfer.vllm.profiles import PROFILES
from tests.checkpoints import prompt
from tests.integration.daemon.conftest import free_port, start_worker
from tests.integration.daemon.test_daemon import hf_reference
from tests.integration.vllm.decode import PullDecode, handshake
from tests.patience import patient

MODEL, BLOCK, NUM_TOKENS = "tiny-llama", 32, 45
ASK = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None}


def _prefill(api: str, ids: list[int]) -> dict[str, object]:
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "kv_transfer_params": ASK}
    headers = {"Content-Type": "application/json"}
    request = urllib.request.Request(f"{api}/v1/completions", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=patient(60)) as response:
        return dict(json.loads(response.read())["kv_transfer_params"])


def test_a_vllm_decode_reads_the_fp8_bytes_of_the_forward(tmp_path: Path, checkpoint: Path) -> None:
    api_port, side_port = free_port(), free_port()
    worker = start_worker(
        tmp_path, checkpoint, "model.dtype=float32", "cache.kv_dtype=fp8_e4m3",
        "scheduler.chunk_size=64",
        "http_api.enabled=true", f"http_api.bind=127.0.0.1:{api_port}",
        f"http_api.served_model_name={MODEL}", "transfer.protocol=native,vllm",
        'transfer.vllm_versions=["0.34.0"]', f"transfer.vllm_side_channel_port={side_port}",
        f"transfer.vllm_block_size={BLOCK}", "transfer.vllm_staging_blocks=8",
        "transfer.vllm_attention_backend=CPU_ATTN", "transfer.vllm_kv_cache_dtype=fp8",
    )  # fmt: skip
    try:
        worker.child.wait_ready(120)
        config = json.loads((checkpoint / "config.json").read_text())
        heads = config["num_key_value_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        layers = config["num_hidden_layers"]
        fp8 = CompatFactors(
            MODEL, "float32", heads, head_dim, layers, "CPU_ATTN", cache_dtype="fp8"
        ).for_profile(PROFILES["0.34.0"])
        hash_, meta = handshake("127.0.0.1", side_port)
        assert hash_ == compat_hash(fp8)
        assert meta.block_lens == [heads * BLOCK * 2 * head_dim] * layers  # 1 byte a value
        decode = PullDecode(meta)
        ids = prompt(NUM_TOKENS, seed=5)
        params = _prefill(f"http://127.0.0.1:{api_port}", ids)
        (blocks,) = params["remote_block_ids"]  # type: ignore[misc]
        raw = decode.read(blocks, f"{params['remote_request_id']}:1")
        decode.close()
        lbhnc = raw.reshape(layers, len(blocks), heads, BLOCK, 2 * head_dim)
        got = torch.from_numpy(np.ascontiguousarray(lbhnc.transpose(0, 1, 3, 2, 4)))
        got = got.reshape(layers, -1, heads, 2 * head_dim)[:, :NUM_TOKENS].to(torch.int16)
        _, hf_kv = hf_reference(checkpoint, ids)
        want = torch.stack([torch.cat(kv, dim=-1) for kv in hf_kv])  # [L, n, heads, 2 D]
        want = want.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int16)
        differ = got != want
        assert ((got - want).abs()[differ] == 1).all()  # a rounding tie: the adjacent code
        assert int(differ.sum()) <= got.numel() // 1000 and want.any()
        assert worker.child.stop() == 0, worker.log()
    finally:
        worker.child.kill()
