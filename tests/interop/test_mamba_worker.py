"""A hybrid linear-attention model (Qwen3.5) in the real worker (``prefill-worker serve``,
SGLang's protocol and native together) to SGLang 0.5.23's own decode code: its
``HybridLinearKVPool`` (the full layers' KV) with the ``MambaPool`` its decode builds, and its
receiver. Two prompts over several chunks (70 and 37 tokens, chunks of 32) at once:

- both say Success; the full layers' K/V in the decode's pages and every linear layer's conv
  and temporal state in the slot each request named equal transformers' within 1e-4 (as its
  kernels read them: temporal ``[v_heads, head_v_dim, head_k_dim]``);
- byte for byte, the decode holds the worker's own slot after the declared transform (the
  recurrent matrix transposed; the conv state as is, the decode's conv dtype being fp32): the
  worker's own slot is what a native decode receives of the same prompt (each prefilled
  alone: fp32 state differs in its last bits with the requests sharing a forward step);
- a decode whose conv state is bfloat16 (SGLANG_MAMBA_CONV_DTYPE unset) against this worker
  (``transfer.sglang_mamba_conv_dtype=float32``) is refused at registration by name and
  counted; its room fails with the reason, and the other decodes go on;
- a decode of attention TP 2 (two rank processes, shared with ``test_decode_tp.py``) gets
  each rank its KV head and its share of the state (its q, k, v conv channels, 3 of the 6
  value heads), equal to transformers' and byte for byte the TP-1 decode's;
- the same two decode shapes from a worker of TP 2 (SGLang's protocol alone; its leader
  writes the state from its gathered whole slots, each rank its KV head): the same checks.

The workers' pages and aux rows (their state slots) are all back afterwards."""

from __future__ import annotations

import dataclasses
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from prefill_worker.ingress.client import BlockingRouterClient
from prefill_worker.kv.layout import KVLayout
from prefill_worker.request import OutcomeStatus
from prefill_worker.testing.sglang_decode import SglangDecodeProcess
from prefill_worker.transfer import RoomState
from tests.checkpoints import hf_model, make_checkpoint, prompt
from tests.integration.daemon.conftest import PAGE_SIZE
from tests.integration.daemon.test_hybrid_daemon import StateDecode
from tests.interop.conftest import TP_SIZE, assert_pools_whole, launch
from tests.interop.decodes import MambaSpec, SglangDecode, dump, dump_state, new_room

pytestmark = [pytest.mark.interop, pytest.mark.newest_sglang]

TOL = 1e-4
PAGE = PAGE_SIZE  # the native decode's (tests/integration/daemon/conftest.py)
FULL, LINEAR = (1, 4), (0, 2, 3)  # tests/checkpoints.py: the hybrids' layer_types
HEADS, DIM = 2, 16  # full layers' KV heads and head_dim
SHAPE = (2, 6, 12, 10, 4)  # key heads, value heads, head_k_dim, head_v_dim, conv kernel
PROMPTS = (70, 37)
REJECTS = re.compile(r'^prefill_worker_bootstrap_rejects_total\{reason="(\w+)"\} (\S+)$', re.M)


@pytest.fixture(scope="module")
def workers(sglang_version: str, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The worker at TP 1 (native and SGLang) and at TP 2 (SGLang: a group serves one
    protocol), started together; each waited for by the fixture that serves it."""
    if sglang_version != "0.5.23":
        pytest.skip("hybrid linear-attention models are proven against SGLang 0.5.23")
    tmp_path = tmp_path_factory.mktemp("mamba-worker")
    checkpoint = make_checkpoint("qwen3_5", tmp_path / "qwen3_5")
    settings = (
        "scheduler.optimistic_prefill=false",  # the same chunks for every decode
        "cache.num_aux_rows=4",
        "transfer.sglang_mamba_conv_dtype=float32",
    )
    one = launch(tmp_path, checkpoint, PAGE, "float32", "native,sglang", "layer_major", *settings)
    (tmp_path / "tp2").mkdir()
    group = launch(
        tmp_path / "tp2", checkpoint, PAGE, "float32", "sglang", "layer_major", *settings,
        f"parallel.tp_size={TP_SIZE}",
    )  # fmt: skip
    try:
        yield checkpoint, one, group
        for started in (one, group):
            assert started.worker.child.stop() == 0, started.worker.log()
    finally:
        one.worker.child.kill()
        group.worker.child.kill()


@pytest.fixture(scope="module")
def served(workers):  # type: ignore[no-untyped-def]
    checkpoint, one, _ = workers
    return checkpoint, one.ready()


@pytest.fixture(scope="module")
def served_tp2(workers):  # type: ignore[no-untyped-def]
    checkpoint, _, group = workers
    return checkpoint, group.ready()


def test_a_hybrid_models_state_lands_in_sglangs_mamba_pool(
    decode_process: SglangDecodeProcess, served, tmp_path: Path
) -> None:
    checkpoint, one = served
    layout = KVLayout(len(FULL) + len(LINEAR), HEADS, DIM, "float32", PAGE, 128)
    decode = SglangDecode(decode_process, one.sglang, layout, mamba=MambaSpec(LINEAR, SHAPE))
    prompts = [prompt(n, seed=40 + n) for n in PROMPTS]
    rooms = [new_room() for _ in prompts]
    client = BlockingRouterClient(one.worker.ingress)
    try:
        for room, ids in zip(rooms, prompts, strict=True):
            decode.want(room, len(ids))
        with ThreadPoolExecutor(len(prompts)) as pool:
            sent = [
                pool.submit(client.prefill, ids, r, timeout_s=60)
                for r, ids in zip(rooms, prompts, strict=True)
            ]
            assert all(f.result(60).status is OutcomeStatus.OK for f in sent)
        assert all(decode.wait(room) == ("Success", None) for room in rooms)
        assert len({decode.mamba_slots[room] for room in rooms}) == 2
        model = hf_model(checkpoint)
        for room, ids in zip(rooms, prompts, strict=True):
            check_against_transformers(
                model, dump(decode, room, tmp_path), dump_state(decode, room, tmp_path), ids
            )
        # Byte for byte, the same prompt alone twice (SGLang's room, then a native one): a
        # prompt's fp32 state differs in its last bits with what shares its forward steps
        # (torch's CPU softplus and sigmoid round a value differently in a vector's body and
        # its tail), and the pair above shares steps as their arrivals fall.
        solo = new_room()
        decode.want(solo, len(prompts[0]))
        assert client.prefill(prompts[0], solo, timeout_s=60).status is OutcomeStatus.OK
        assert decode.wait(solo) == ("Success", None)
        landed = dump_state(decode, solo, tmp_path)
        own = worker_slot(one.worker.bootstrap, client, prompts[0])
        for index in range(len(LINEAR)):  # the declared transform, byte for byte
            conv, temporal = own[0][index], own[1][index].transpose(-1, -2)
            same_bytes(landed[f"conv{index}"], conv, f"conv{index}")
            same_bytes(landed[f"temporal{index}"], temporal, f"temporal{index}")
        refuse_a_bf16_decode(decode_process, one, client)
    finally:
        client.close()
    assert_pools_whole(one.worker)


def test_an_attention_tp_2_decode_gets_each_ranks_heads_of_the_state(
    decode_process: SglangDecodeProcess,
    rank_processes: list[SglangDecodeProcess],
    served,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    """Each rank of a decode of attention TP 2 (one KV head, half the linear heads: its q, k
    and v conv channels and 3 of 6 value heads) gets its share, equal to transformers' and
    byte for byte the TP-1 decode's of the same prompt."""
    checkpoint, one = served
    ids = prompt(PROMPTS[0], seed=77)
    whole = KVLayout(len(FULL) + len(LINEAR), HEADS, DIM, "float32", PAGE, 128)
    tp1 = SglangDecode(decode_process, one.sglang, whole, mamba=MambaSpec(LINEAR, SHAPE))
    half = dataclasses.replace(whole, num_kv_heads=HEADS // TP_SIZE)
    ranks = [
        SglangDecode(p, one.sglang, half, mamba=MambaSpec(LINEAR, SHAPE)) for p in rank_processes
    ]
    client = BlockingRouterClient(one.worker.ingress)
    try:
        landed = [receive(client, [tp1], ids, tmp_path)[0], receive(client, ranks, ids, tmp_path)]
    finally:
        client.close()
    check_ranks(checkpoint, *landed, ids)
    assert_pools_whole(one.worker)


def test_a_tp_2_worker_sends_decodes_of_attention_tp_1_and_2_their_state(
    decode_process: SglangDecodeProcess,
    rank_processes: list[SglangDecodeProcess],
    served_tp2,  # type: ignore[no-untyped-def]
    tmp_path: Path,
) -> None:
    """A worker of TP 2 (each rank one KV head and half the linear heads; the leader gathers
    whole slots, ``model.state_gather``, and alone writes the state): a decode of attention
    TP 1 gets every KV head (one from each rank) and the whole state, equal to transformers';
    each rank of a decode of attention TP 2 its KV head (from the worker rank of that head)
    and its share of the state, equal to transformers' and byte for byte the TP-1 decode's."""
    checkpoint, group = served_tp2
    ids = prompt(PROMPTS[0], seed=78)
    whole = KVLayout(len(FULL) + len(LINEAR), HEADS, DIM, "float32", PAGE, 128)
    tp1 = SglangDecode(decode_process, group.sglang, whole, mamba=MambaSpec(LINEAR, SHAPE))
    half = dataclasses.replace(whole, num_kv_heads=HEADS // TP_SIZE)
    ranks = [
        SglangDecode(p, group.sglang, half, mamba=MambaSpec(LINEAR, SHAPE)) for p in rank_processes
    ]
    client = BlockingRouterClient(group.worker.ingress)
    try:
        landed = [receive(client, [tp1], ids, tmp_path)[0], receive(client, ranks, ids, tmp_path)]
    finally:
        client.close()
    check_against_transformers(hf_model(checkpoint), *landed[0], ids)
    check_ranks(checkpoint, *landed, ids)
    assert_pools_whole(group.worker)


def check_ranks(checkpoint, reference, per_rank, ids) -> None:  # type: ignore[no-untyped-def]
    """Each rank's (KV pages, state slot) of a decode of attention TP 2: its KV head and its
    share of the state equal transformers' and, byte for byte, the TP-1 decode's
    (``reference``) of the same prompt."""
    ref_kv, ref_state = reference
    with torch.no_grad():
        layers = hf_model(checkpoint)(torch.tensor([ids]), use_cache=True).past_key_values.layers
    k_heads, v_heads, dk, dv, kernel = SHAPE
    groups = (k_heads * dk, k_heads * dk, v_heads * dv)
    for rank, (kv, state) in enumerate(per_rank):
        n = len(ids)
        for index, layer in enumerate(FULL):  # its KV head: transformers', the TP-1 decode's
            got = as_fp32(kv[f"k{index}"]).view(-1, 1, DIM)[:n]
            expected = layers[layer].keys[0][rank : rank + 1].transpose(0, 1)
            torch.testing.assert_close(got, expected, atol=TOL, rtol=0)
            for plane in "kv":
                mine = kv[f"{plane}{index}"].reshape(-1, 1, DIM * 4)[:n]
                ref = ref_kv[f"{plane}{index}"].reshape(-1, HEADS, DIM * 4)[:n, rank : rank + 1]
                assert np.array_equal(mine, ref), (rank, plane, index)
        channels = torch.cat(
            [
                torch.arange(
                    start + rank * (size // TP_SIZE), start + (rank + 1) * (size // TP_SIZE)
                )
                for start, size in zip((0, groups[0], 2 * groups[0]), groups, strict=True)
            ]
        )
        heads = slice(rank * v_heads // TP_SIZE, (rank + 1) * v_heads // TP_SIZE)
        for index, layer in enumerate(LINEAR):
            conv = as_fp32(state[f"conv{index}"]).view(-1, kernel - 1)
            expected = layers[layer].conv_states[0][0, :, 1:][channels]
            torch.testing.assert_close(conv, expected, atol=TOL, rtol=0)
            ref_conv = as_fp32(ref_state[f"conv{index}"]).view(-1, kernel - 1)[channels]
            assert conv.numpy().tobytes() == ref_conv.numpy().tobytes()
            temporal = as_fp32(state[f"temporal{index}"]).view(-1, dv, dk)
            expected = layers[layer].recurrent_states[0][0][heads].transpose(-1, -2)
            torch.testing.assert_close(temporal, expected, atol=TOL, rtol=0)
            ref_temporal = as_fp32(ref_state[f"temporal{index}"]).view(v_heads, dv, dk)[heads]
            assert temporal.numpy().tobytes() == ref_temporal.contiguous().numpy().tobytes()


def receive(
    client: BlockingRouterClient, ranks: list[SglangDecode], ids: list[int], tmp_path: Path
):  # type: ignore[no-untyped-def]
    """One room into a decode of ``len(ranks)`` ranks: each rank's (KV pages, state slot),
    once every rank's receiver said Success."""
    room = new_room()
    for rank in ranks:
        rank.want(room, len(ids))
    assert client.prefill(ids, room, timeout_s=60).status is OutcomeStatus.OK
    with ThreadPoolExecutor(len(ranks)) as pool:
        states = list(pool.map(lambda rank: rank.wait(room), ranks))
    assert states == [("Success", None)] * len(ranks)
    return [(dump(rank, room, tmp_path), dump_state(rank, room, tmp_path)) for rank in ranks]


def check_against_transformers(model, kv, state, ids) -> None:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        layers = model(torch.tensor([ids]), use_cache=True).past_key_values.layers
    n = len(ids)
    for index, layer in enumerate(FULL):
        for kind, ref in (("k", layers[layer].keys), ("v", layers[layer].values)):
            got = as_fp32(kv[f"{kind}{index}"]).view(-1, HEADS, DIM)[:n]
            torch.testing.assert_close(got, ref[0].transpose(0, 1), atol=TOL, rtol=0)
    k_heads, v_heads, dk, dv, kernel = SHAPE
    conv_dim = 2 * k_heads * dk + v_heads * dv
    for index, layer in enumerate(LINEAR):
        conv = as_fp32(state[f"conv{index}"]).view(conv_dim, kernel - 1)
        torch.testing.assert_close(conv, layers[layer].conv_states[0][0, :, 1:], atol=TOL, rtol=0)
        temporal = as_fp32(state[f"temporal{index}"]).view(v_heads, dv, dk)
        expected = layers[layer].recurrent_states[0][0].transpose(-1, -2)  # [Hv, Dk, Dv] -> K last
        torch.testing.assert_close(temporal, expected, atol=TOL, rtol=0)


def worker_slot(bootstrap: str, client: BlockingRouterClient, ids: list[int]):  # type: ignore[no-untyped-def]
    """The worker's own state slot after ``ids``, as a native decode receives it (per linear
    layer conv ``[conv_dim, K - 1]`` and recurrent ``[Hv, Dk, Dv]``): its layout, unchanged."""
    native = StateDecode(bootstrap)
    room = new_room()
    native.want_state(room, len(ids), 3)
    try:
        with ThreadPoolExecutor(1) as pool:  # the decode is driven while it waits
            sent = pool.submit(client.prefill, ids, room, timeout_s=60)
            assert native.wait([room])[room].state is RoomState.DONE
            assert sent.result(60).status is OutcomeStatus.OK
        conv, recurrent = native.state
        return [t[3] for t in conv], [t[3] for t in recurrent]
    finally:
        native.close()


def refuse_a_bf16_decode(process: SglangDecodeProcess, one, client: BlockingRouterClient) -> None:  # type: ignore[no-untyped-def]
    """SGLang's default conv dtype against a worker staging fp32: refused by name, counted."""
    layout = KVLayout(len(FULL) + len(LINEAR), HEADS, DIM, "float32", PAGE, 128)
    spec = MambaSpec(LINEAR, SHAPE, conv_dtype="bfloat16")
    decode = SglangDecode(process, one.sglang, layout, mamba=spec)
    room, ids = new_room(), prompt(29, seed=9)
    decode.want(room, len(ids))
    result = client.prefill(ids, room, timeout_s=60)
    assert result.status is OutcomeStatus.FAILED, result
    assert "conv state slot is [648] bytes" in str(result.error), result.error
    state, reason = decode.wait(room)
    assert state == "Failed" and "SGLANG_MAMBA_CONV_DTYPE" in str(reason), reason
    counts = dict(REJECTS.findall(one.worker.http("/metrics")[1]))
    assert float(counts.get("layout_mismatch", 0)) >= 1, counts


def same_bytes(landed: np.ndarray, own: torch.Tensor, name: str) -> None:
    """The decode's raw ``landed`` is ``own`` (fp32) byte for byte; else how far apart."""
    if landed.tobytes() == raw(own):
        return
    got, want = as_fp32(landed), own.contiguous().view(-1).float()
    off = got != want
    raise AssertionError(
        f"{name}: {int(off.sum())} of {want.numel()} fp32 values differ, the largest by "
        f"{float((got - want).abs().max()):.3g} (at {off.nonzero()[:8, 0].tolist()})"
    )


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def as_fp32(raw: np.ndarray) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw.tobytes()), dtype=torch.float32)
