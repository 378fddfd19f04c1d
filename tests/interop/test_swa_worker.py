"""Sliding-window models in the real worker (``prefill-worker serve``, SGLang's protocol) to
SGLang 0.5.23's own decode code, a prompt past the window (70 tokens, window 24, pages of 16,
three chunks):

- gpt-oss to a decode with hybrid SWA memory (its ``SWAKVPool``: the full layer in its KV
  pool, the sliding layers' window pages in its SWA pool) and to one without
  (``--disable-hybrid-swa-memory``: every layer in its KV pool): both say Success, the K/V
  that landed equal transformers' (every position of the full layer, the last 23 of a sliding
  one: what the decode reads), and the window pages are byte for byte the full-pool decode's;
- Gemma 3, which SGLang runs on a full pool: every layer lands as a dense model's;
- gpt-oss from a worker with a windowed sliding pool (``cache.sliding_pool=windowed``: its
  sliding layers in their own page space, the last window kept): the window pages land byte
  for byte as the full-pool worker's, and a decode without a hybrid SWA pool (which wants
  every sliding page) is refused by name and counted.

The worker's pages (both page spaces) and aux rows are all back afterwards."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from prefill_worker.ingress.client import BlockingRouterClient
from prefill_worker.kv.layout import KVLayout
from prefill_worker.request import OutcomeStatus
from prefill_worker.testing.sglang_decode import SglangDecodeProcess
from prefill_worker.transfer.swa_window import WINDOW, layer_pages
from tests.checkpoints import hf_model, make_checkpoint, prompt
from tests.interop.conftest import assert_pools_whole, launch
from tests.interop.decodes import SglangDecode, dump, new_room

pytestmark = pytest.mark.interop

REJECTS = re.compile(r'^prefill_worker_bootstrap_rejects_total\{reason="(\w+)"\} (\S+)$', re.M)
SLIDING_USED = re.compile(r"^prefill_worker_sliding_pages_used (\S+)$", re.M)
PAGE, KEPT, TOL = 16, 23, 1e-4  # a decode keeps sliding_window - 1 = 23 tokens
SHAPES = {  # layers, KV heads, head_dim, sliding layers (tests/checkpoints.py)
    "gpt_oss": (3, 2, 12, (0, 2)),
    "gemma3": (4, 2, 16, (0, 2, 3)),
}


@pytest.fixture(params=list(SHAPES))
def family(request: pytest.FixtureRequest, sglang_version: str) -> str:
    if sglang_version != "0.5.23":
        pytest.skip("sliding-window models are proven against SGLang 0.5.23")
    return str(request.param)


@pytest.fixture
def served(family: str, tmp_path: Path) -> Iterator[tuple[Path, object]]:
    checkpoint = make_checkpoint(family, tmp_path / family)
    settings = ("scheduler.optimistic_prefill=false",)  # the same chunks for both decodes
    one = launch(tmp_path, checkpoint, PAGE, "float32", "sglang", "layer_major", *settings)
    try:
        yield checkpoint, one.ready()
        assert one.worker.child.stop() == 0, one.worker.log()
    finally:
        one.worker.child.kill()


def test_a_prompt_past_the_window_lands_in_both_pools(
    decode_process: SglangDecodeProcess, family: str, served, tmp_path: Path
) -> None:
    checkpoint, one = served
    num_layers, heads, dim, sliding = SHAPES[family]
    layout = KVLayout(num_layers, heads, dim, "float32", PAGE, 64)
    ids = prompt(70, seed=5)
    with torch.no_grad():
        cache = hf_model(checkpoint)(torch.tensor([ids]), use_cache=True).past_key_values
    reference = [(c.keys[0].transpose(0, 1), c.values[0].transpose(0, 1)) for c in cache.layers]
    decodes = {"full": SglangDecode(decode_process, one.sglang, layout)}
    if family == "gpt_oss":  # SGLang runs Gemma 3 on a full pool only
        swa = (sliding, KEPT, 32)
        decodes["swa"] = SglangDecode(decode_process, one.sglang, layout, swa=swa)
    client = BlockingRouterClient(one.worker.ingress)
    landed = {}
    try:
        for name, decode in decodes.items():
            room = new_room()
            decode.want(room, len(ids))
            result = client.prefill(ids, room, timeout_s=60)
            assert result.status is OutcomeStatus.OK, result
            assert decode.wait(room) == ("Success", None)
            landed[name] = (dump(decode, room, tmp_path), decode.swa_pages.get(room))
    finally:
        client.close()
    full, _ = landed["full"]
    for layer in range(num_layers):  # the full pool: every layer, every page
        check(full[f"k{layer}"], full[f"v{layer}"], reference[layer], layer in sliding, heads, dim)
    if "swa" in landed:
        check_swa(landed["swa"], full, reference, sliding, num_layers, (heads, dim))
    assert_pools_whole(one.worker)


@pytest.mark.parametrize("family", ["gpt_oss"], indirect=True)  # Gemma 3: refused at start
def test_a_windowed_worker_sends_its_window_pages(
    decode_process: SglangDecodeProcess, family: str, served, tmp_path: Path
) -> None:
    """The same prompt from the full-pool worker and a windowed one to decodes with a hybrid
    SWA pool: the same bytes land (every full layer, each sliding layer's window pages); a
    full-pool decode is refused by the windowed worker."""
    checkpoint, one = served
    num_layers, heads, dim, sliding = SHAPES[family]
    layout = KVLayout(num_layers, heads, dim, "float32", PAGE, 64)
    settings = ("scheduler.optimistic_prefill=false", "cache.sliding_pool=windowed")
    (tmp_path / "windowed").mkdir()
    windowed = launch(tmp_path / "windowed", checkpoint, PAGE, "float32", "sglang",
                      "layer_major", *settings)  # fmt: skip
    try:
        other = windowed.ready()
        ids = prompt(70, seed=5)
        landed = {}
        for name, worker in (("full", one), ("windowed", other)):
            decode = SglangDecode(decode_process, worker.sglang, layout, swa=(sliding, KEPT, 32))
            client = BlockingRouterClient(worker.worker.ingress)
            try:
                room = new_room()
                decode.want(room, len(ids))
                result = client.prefill(ids, room, timeout_s=60)
                assert result.status is OutcomeStatus.OK, result
                assert decode.wait(room) == ("Success", None)
                landed[name] = (dump(decode, room, tmp_path), decode.swa_pages[room])
            finally:
                client.close()
        (full, full_pages), (got, got_pages) = landed["full"], landed["windowed"]
        assert len(got_pages) == len(full_pages) == 3
        assert sorted(got) == sorted(full)
        row = heads * dim * 4  # one token of one layer's K (or V), fp32
        for key in full:  # the full layers in its KV pool, the window in its SWA pool
            first = layer_pages(70, PAGE, 0, KEPT, WINDOW).start if key.startswith("swa_") else 0
            num_bytes = (70 - first * PAGE) * row  # a last page's tail holds no token
            assert got[key].tobytes()[:num_bytes] == full[key].tobytes()[:num_bytes], key
        refuse_a_full_pool_decode(decode_process, other, layout)
        assert_pools_whole(other.worker)
        text = other.worker.http("/metrics")[1]
        assert [float(v) for v in SLIDING_USED.findall(text)] == [0.0], text
        assert other.worker.child.stop() == 0, other.worker.log()
    finally:
        windowed.worker.child.kill()


def refuse_a_full_pool_decode(process: SglangDecodeProcess, one, layout: KVLayout) -> None:  # type: ignore[no-untyped-def]
    """A decode without a hybrid SWA pool wants every sliding page: refused, counted."""
    decode = SglangDecode(process, one.sglang, layout)
    client = BlockingRouterClient(one.worker.ingress)
    try:
        room, ids = new_room(), prompt(40, seed=7)
        decode.want(room, len(ids))
        result = client.prefill(ids, room, timeout_s=60)
        assert result.status is OutcomeStatus.FAILED, result
        assert "hybrid SWA memory off" in str(result.error), result.error
        state, reason = decode.wait(room)
        assert state == "Failed" and "sliding_pool windowed" in str(reason), reason
    finally:
        client.close()
    counts = dict(REJECTS.findall(one.worker.http("/metrics")[1]))
    assert float(counts.get("unsupported", 0)) >= 1, counts


def check_swa(landed, full, reference, sliding, num_layers, shape) -> None:  # type: ignore[no-untyped-def]
    """Full layers in its KV pool in order; each sliding layer's window pages in its SWA
    pool, equal to transformers' and byte for byte to the full-pool decode's."""
    arrays, swa_pages = landed
    window = layer_pages(70, PAGE, 0, KEPT, WINDOW)
    assert len(swa_pages) == len(window) == 3  # tokens 47..69: pages 2 to 4 of 5
    for index, layer in enumerate(i for i in range(num_layers) if i not in sliding):
        for kind in "kv":
            assert np.array_equal(arrays[f"{kind}{index}"], full[f"{kind}{layer}"])
    for index, layer in enumerate(sliding):
        for kind in "kv":
            got = arrays[f"swa_{kind}{index}"]
            assert np.array_equal(got, full[f"{kind}{layer}"][window.start : window.stop])
        k, v = (tokens(arrays[f"swa_{kind}{index}"], *shape) for kind in "kv")
        offset = window.start * PAGE
        k_ref, v_ref = reference[layer]
        torch.testing.assert_close(k[70 - KEPT - offset : 70 - offset], k_ref, atol=TOL, rtol=0)
        torch.testing.assert_close(v[70 - KEPT - offset : 70 - offset], v_ref, atol=TOL, rtol=0)


def check(k_raw, v_raw, ref, is_sliding: bool, heads: int, dim: int) -> None:  # type: ignore[no-untyped-def]
    """Landed K/V (pages from the prompt's first) equal transformers' where it keeps them."""
    k_ref, v_ref = ref
    kept = k_ref.shape[0]
    assert kept == (KEPT if is_sliding else 70)
    for raw, want in ((k_raw, k_ref), (v_raw, v_ref)):
        got = tokens(raw, heads, dim)[70 - kept : 70]
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)


def tokens(raw: np.ndarray, heads: int, dim: int) -> torch.Tensor:
    """Page bytes ``[pages, page_bytes]`` as fp32 ``[tokens, heads, dim]``."""
    return torch.frombuffer(bytearray(raw.tobytes()), dtype=torch.float32).view(-1, heads, dim)
