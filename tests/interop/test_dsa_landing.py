"""DeepSeek-V3.2 (MLA + the DSA indexer) in the real worker (``prefill-worker serve``,
SGLang's protocol) to SGLang 0.5.23's own decode code on its own ``DSATokenToKVPool`` (an MLA
pool and an FP8 index buffer per layer, registered as its ``dsa`` state component by
``setup_state_kv_args``; pages of 64, the size it requires; index keys of 128):

- a prompt of 150 tokens in three chunks (of 64): SGLang says Success; every layer's latent
  rows land within 1e-4 of transformers' (fp32); every layer's index page holds SGLang's
  quantization of transformers' index keys (``model.index_fp8``: e4m3 codes, then a scale per
  token): the scales within 1e-5, every code equal but where transformers' value sits on a
  rounding midpoint (there, the neighbouring code);
- a prompt sharing its first two pages (the worker's prefix cache serves them) whose first
  page the decode already holds: that page is left as it was, the rest lands as above, and
  the second page (sent from the worker's cached page both times) byte for byte as the first
  room's.

And from a worker of TP 2 (each rank computes the same latents and index keys; the leader
writes the index pages into every decode rank, the latent going from the worker rank the MLA
plan names): a decode of attention TP 1 and each rank of one of attention TP 2 (rank 1's
latent from worker rank 1) get the same checks against transformers, and byte for byte the
same pages as each other.

The workers' pages and aux rows are all back afterwards."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from prefill_worker.ingress.client import BlockingRouterClient
from prefill_worker.kv.layout import MLA, KVLayout
from prefill_worker.model.index_fp8 import quantize
from prefill_worker.request import OutcomeStatus
from prefill_worker.testing.sglang_decode import FILL_BYTE, SglangDecodeProcess
from tests.checkpoints import hf_model, make_checkpoint, prompt
from tests.integration.model.conftest import hf_index_keys, hf_mla_forward
from tests.interop.conftest import TP_SIZE, assert_pools_whole, launch
from tests.interop.decodes import SglangDecode, new_room

pytestmark = pytest.mark.interop

PAGE, LAYERS, LATENT, TOL = 64, 3, 40, 1e-4  # tests/checkpoints.py: kv_lora_rank 32 + rope 8
KEYS = PAGE * 128  # an index page: the keys, then the scales


@pytest.fixture
def served(sglang_version: str, tmp_path: Path):  # type: ignore[no-untyped-def]
    if sglang_version != "0.5.23":
        pytest.skip("DSA decodes are proven against SGLang 0.5.23")
    checkpoint = make_checkpoint("deepseek_v32", tmp_path / "dsa", index_head_dim=128)
    settings = ("scheduler.optimistic_prefill=false", f"scheduler.chunk_size={PAGE}")
    one = launch(tmp_path, checkpoint, PAGE, "float32", "sglang", "layer_major", *settings)
    try:
        yield checkpoint, one.ready()
        assert one.worker.child.stop() == 0, one.worker.log()
    finally:
        one.worker.child.kill()


def test_latents_and_fp8_index_pages_land_in_sglangs_dsa_pool(
    decode_process: SglangDecodeProcess, served, tmp_path: Path
) -> None:
    checkpoint, one = served
    layout = KVLayout(LAYERS, 1, LATENT, "float32", PAGE, 64, MLA)
    decode = SglangDecode(decode_process, one.sglang, layout, dsa=True)
    a = prompt(150, seed=7)
    b = a[: 2 * PAGE] + prompt(40, seed=8)
    client = BlockingRouterClient(one.worker.ingress)
    try:
        landed_a = land(decode, client, a, 0, tmp_path)
        landed_b = land(decode, client, b, PAGE, tmp_path)
    finally:
        client.close()
    hf = hf_model(checkpoint)
    check(landed_a, hf, a, 0)
    check(landed_b, hf, b, 1)
    for name in landed_a:  # page 1 of both: the worker's same cached page
        assert np.array_equal(landed_b[name][1], landed_a[name][1]), name
    assert_pools_whole(one.worker)


@pytest.fixture(scope="module")
def group(sglang_version: str, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    if sglang_version != "0.5.23":
        pytest.skip("DSA decodes are proven against SGLang 0.5.23")
    tmp_path = tmp_path_factory.mktemp("dsa-tp2")
    checkpoint = make_checkpoint("deepseek_v32", tmp_path / "dsa", index_head_dim=128)
    settings = (
        "scheduler.optimistic_prefill=false",
        f"scheduler.chunk_size={PAGE}",
        f"parallel.tp_size={TP_SIZE}",
    )
    one = launch(tmp_path, checkpoint, PAGE, "float32", "sglang", "layer_major", *settings)
    try:
        yield checkpoint, one.ready()
        assert one.worker.child.stop() == 0, one.worker.log()
    finally:
        one.worker.child.kill()


@pytest.mark.newest_sglang
def test_a_tp_2_worker_writes_every_decode_rank_its_latents_and_index_pages(
    decode_process: SglangDecodeProcess,
    rank_processes: list[SglangDecodeProcess],
    group,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    checkpoint, one = group
    layout = KVLayout(LAYERS, 1, LATENT, "float32", PAGE, 64, MLA)  # not split by rank
    tp1 = SglangDecode(decode_process, one.sglang, layout, dsa=True)
    ranks = [SglangDecode(p, one.sglang, layout, dsa=True) for p in rank_processes]
    ids = prompt(150, seed=9)
    client = BlockingRouterClient(one.worker.ingress)
    try:
        landed = [land(tp1, client, ids, 0, tmp_path), *land_ranks(ranks, client, ids, tmp_path)]
    finally:
        client.close()
    check_tp(landed[0], hf_model(checkpoint), ids)
    for rank, pages in enumerate(landed[1:]):
        assert pages.keys() == landed[0].keys()
        for name in pages:
            assert np.array_equal(pages[name], landed[0][name]), (rank, name)
    assert_pools_whole(one.worker)


def land_ranks(ranks: list[SglangDecode], client, ids: list[int], tmp_path: Path):  # type: ignore[no-untyped-def]
    """One room into a decode of ``len(ranks)`` ranks: each rank's pages, as ``land``."""
    room = new_room()
    for rank in ranks:
        rank.want(room, len(ids))
    result = client.prefill(ids, room, timeout_s=120)
    assert result.status is OutcomeStatus.OK, result
    assert [rank.wait(room) for rank in ranks] == [("Success", None)] * len(ranks)
    return [landed_pages(rank, room, tmp_path) for rank in ranks]


def land(decode: SglangDecode, client, ids: list[int], prefix: int, tmp_path: Path):  # type: ignore[no-untyped-def]
    """The room's pages as they landed, raw: ``k0``.. latents, ``ix0``.. index pages."""
    room = new_room()
    decode.want(room, len(ids), prefix_len=prefix)
    result = client.prefill(ids, room, timeout_s=120)
    assert result.status is OutcomeStatus.OK, result
    assert decode.wait(room) == ("Success", None)
    if prefix:
        assert result.num_prefix_hit_tokens == 2 * PAGE
    return landed_pages(decode, room, tmp_path)


def landed_pages(decode: SglangDecode, room: int, tmp_path: Path):  # type: ignore[no-untyped-def]
    path = tmp_path / f"{decode.id}-{room}.npz"
    decode.process.call("dump", id=decode.id, room=room, path=str(path))
    data = np.load(path)
    num_pages = len(decode.rooms[room][0])
    names = [n for n in data.files if re.fullmatch(r"(k|ix)[0-9]+", n)]
    return {n: data[n].reshape(num_pages, -1) for n in names}


def check(landed, hf, ids: list[int], first_page: int) -> None:  # type: ignore[no-untyped-def]
    """Pages before ``first_page`` (the decode's own) untouched; after: transformers'."""
    for name, pages in landed.items():
        assert (pages[:first_page] == FILL_BYTE).all(), name
    _, rows = hf_mla_forward(hf, ids)
    keys = hf_index_keys(hf, ids)
    start, length = first_page * PAGE, len(ids)
    assert tuple(keys) == tuple(range(LAYERS))  # DeepSeek-V3.2 indexes every layer
    for layer in range(LAYERS):
        latent = tokens(landed[f"k{layer}"], LATENT)[start:length]
        torch.testing.assert_close(latent, rows[layer][start:length], atol=TOL, rtol=0)
        check_index(landed[f"ix{layer}"][first_page:], keys[layer][start:length])


def check_tp(landed, hf, ids: list[int]) -> None:  # type: ignore[no-untyped-def]
    """As ``check`` (no prefix), but a TP-2 forward sums in another order, so an index score
    within rounding of the top-k boundary may choose another key for a token, whose rows in
    the layers after it then differ: at most 2 such tokens, none in layer 0 (its latent and
    index keys read the embeddings alone). This prompt has two (transformers' 12th and 13th
    scores of layer 1 are equal for tokens 82 and 110; 110 flipped in a run). A page written
    wrong or not at all is 64 tokens."""
    _, rows = hf_mla_forward(hf, ids)
    keys = hf_index_keys(hf, ids)
    n, chose_otherwise = len(ids), {}
    for layer in range(LAYERS):
        latent = tokens(landed[f"k{layer}"], LATENT)[:n]
        close = ((latent - rows[layer][:n]).abs() <= TOL).all(dim=1)
        chose_otherwise[layer] = torch.nonzero(~close).flatten().tolist()
    off = sorted({t for layer in chose_otherwise.values() for t in layer})
    assert not chose_otherwise[0] and len(off) <= 2, chose_otherwise
    keep = [t for t in range(n) if t not in off]
    for layer in range(LAYERS):
        latent = tokens(landed[f"k{layer}"], LATENT)[:n][keep]
        torch.testing.assert_close(latent, rows[layer][:n][keep], atol=TOL, rtol=0)
        check_index(landed[f"ix{layer}"], keys[layer][:n], keep)


def tokens(raw: np.ndarray, width: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw.tobytes()), dtype=torch.float32).view(-1, width)


def check_index(pages: np.ndarray, keys: torch.Tensor, keep: list[int] | None = None) -> None:
    """Index pages ``[n, 64 * 132]`` hold SGLang's quantization of ``keys [t, 128]`` (of the
    tokens ``keep``, when given)."""
    codes = pages[:, :KEYS].reshape(-1, 128)[: len(keys)]
    scales = pages[:, KEYS:].copy().view(np.float32).reshape(-1)[: len(keys)]
    if keep is not None:
        codes, scales, keys = codes[keep], scales[keep], keys[keep]
    want_codes, want_scales = quantize(keys)
    np.testing.assert_allclose(scales, want_scales.numpy(), rtol=1e-5, atol=0)
    differ = codes != want_codes.numpy()
    assert differ.mean() < 1e-3, f"{int(differ.sum())} codes differ"
    scaled = (keys / want_scales[:, None]).numpy()[differ]  # transformers' values there
    ours = codes[differ].view(np.int8).astype(np.int16)
    theirs = want_codes.numpy()[differ].view(np.int8).astype(np.int16)
    assert (np.abs(ours - theirs) == 1).all()  # neighbouring codes (same sign)
    low = fp8(np.minimum(ours, theirs))
    high = fp8(np.maximum(ours, theirs))
    midpoint = (low + high) / 2
    assert (np.abs(np.abs(scaled) - np.abs(midpoint)) <= 1e-2 * np.abs(high - low)).all()


def fp8(codes: np.ndarray) -> np.ndarray:
    as_bytes = torch.from_numpy(codes.astype(np.int8).view(np.uint8).copy())
    return as_bytes.view(torch.float8_e4m3fn).float().numpy()
