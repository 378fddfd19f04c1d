"""What a vLLM 0.34 decode of TP d lands from a worker of TP p, for the hybrid models: the
checks ``test_vllm_worker_tp``'s hybrid tests make on the blocks vLLM's own connector read.

Each decode rank's blocks are reassembled as a decode of TP 1 would hold them (its KV heads
side by side; its share of each linear layer's state, conv channel runs and value heads, put
back in vLLM's whole layout), then checked against transformers (fp32, 1e-4) and, byte for
byte, against the worker rank that computed each head and each share (its pool and its own
state pool, dumped on SIGUSR2 by ``testing.tp_ranks``).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tests.interop.test_vllm_worker import BLOCK, PAGE, _in_pool
from tests.interop.vllm_decode import OpenedDecode, VllmDecodeProcess

WINDOW = 24  # tests/checkpoints.py's sliding_window (gpt-oss)
KEPT = WINDOW - 1  # the positions transformers' sliding cache keeps (all a decode reads)


def open_ranks(ranks: Sequence[VllmDecodeProcess], name: str, **spec: Any) -> list[OpenedDecode]:
    """Another decode in each rank's process, all at once (a rank's connector may wait for
    the others while it is built)."""
    with ThreadPoolExecutor(len(ranks)) as pool:
        return list(pool.map(lambda rank: rank.open(name, **spec), ranks))


def pull(
    ranks: Sequence[VllmDecodeProcess | OpenedDecode],
    request_id: str,
    params: dict[str, Any],
    tmp_path: Path,
) -> list[dict[str, np.ndarray]]:
    """Every rank pulls ``params``, none with a load error; each rank's blocks."""
    for rank in ranks:
        rank.call("pull", request_id=request_id, params=params)
    landed = []
    for i, rank in enumerate(ranks):
        outcome = rank.call("wait", timeout_s=90, request_id=request_id, deadline_s=60)
        assert outcome["finished"] and outcome["load_errors"] == [], (i, outcome)
        landed.append(rank.blocks(request_id, tmp_path / f"{request_id}-{i}.npz"))
    return landed


def kv_heads(landed: Sequence[dict[str, np.ndarray]], name: str, dim: int) -> torch.Tensor:
    """A KV layer's blocks from every decode rank, its heads side by side, as tokens
    ``[blocks * 32, heads, 2 * dim]`` (fp32)."""
    raw = np.concatenate([np.ascontiguousarray(rank[name]) for rank in landed], axis=1)
    kv = torch.from_numpy(raw.view(np.float32))  # [blocks, heads, 32, 2D]
    return kv.transpose(1, 2).reshape(-1, kv.shape[1], 2 * dim)


def assert_heads_in_pools(
    tokens: torch.Tensor, pools: Sequence[tuple[np.ndarray, np.ndarray]], layer: int, where: str
) -> None:
    """Head r of ``tokens`` ([n, heads, 2D]) is in worker rank r's pool (a head each)."""
    dim = tokens.shape[-1] // 2
    for rank, (pool_k, pool_v) in enumerate(pools):
        head = tokens[:, rank : rank + 1]
        assert _in_pool(pool_k[layer], head[..., :dim], PAGE), f"K {where}, rank {rank}"
        assert _in_pool(pool_v[layer], head[..., dim:], PAGE), f"V {where}, rank {rank}"


def assert_swa(
    landed: Sequence[dict[str, np.ndarray]],
    sent: list[list[int]],
    group_of: dict[int, int],
    hf_kv: Any,
    pools: Sequence[tuple[np.ndarray, np.ndarray]],
    n: int,
) -> None:
    """A sliding-window model (gpt-oss): each layer's blocks (the full group's every one, a
    sliding group's its window's) hold transformers' K/V where transformers keeps them, and
    each head is its worker rank's, byte for byte."""
    full = max(group_of.values())  # the full layer's group: the last
    num_blocks = -(-n // BLOCK)
    for layer, (k_ref, v_ref) in enumerate(hf_kv):
        dim = k_ref.shape[2]
        tokens = kv_heads(landed, f"model.layers.{layer}.attn.attn", dim)
        first = (num_blocks - len(sent[group_of[layer]])) * BLOCK  # the blocks' first token
        tokens = tokens[: n - first]
        kept = n if group_of[layer] == full else min(n, KEPT)
        torch.testing.assert_close(tokens[-kept:, :, :dim], k_ref[-kept:], atol=1e-4, rtol=0)
        torch.testing.assert_close(tokens[-kept:, :, dim:], v_ref[-kept:], atol=1e-4, rtol=0)
        assert_heads_in_pools(tokens, pools, layer, f"{n} tokens, layer {layer}")


def whole_state(
    landed: Sequence[dict[str, np.ndarray]], name: str, spec: dict[str, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear layer's state page from every decode rank (its share: its q, k and v conv
    channels, its value heads' ``[Hv / d, Dv, Dk]``) as a decode of TP 1 holds it: conv
    ``[C, K - 1]`` (q of every rank, then k, then v) and recurrent ``[Hv, Dk, Dv]`` (fp32)."""
    d, taps = len(landed), spec["kernel"] - 1
    key, value = spec["key_dim"] // d, spec["value_dim"] // d
    heads, dk, dv = spec["num_v_heads"] // d, spec["dk"], spec["dv"]
    conv_bytes, rec_bytes = (2 * key + value) * taps * 4, heads * dv * dk * 4
    runs: list[list[torch.Tensor]] = [[], [], []]
    recurrent = []
    for rank in landed:
        page = np.ascontiguousarray(rank[name][0])  # the request's one state block
        conv = torch.from_numpy(page[:conv_bytes].copy().view(np.float32)).reshape(-1, taps)
        for run, part in zip(runs, conv.split([key, key, value]), strict=True):
            run.append(part)
        rec = page[conv_bytes : conv_bytes + rec_bytes].copy().view(np.float32)
        recurrent.append(torch.from_numpy(rec).reshape(heads, dv, dk).transpose(1, 2))
    return torch.cat([torch.cat(run) for run in runs]), torch.cat(recurrent)


def rank_share(
    conv: torch.Tensor, recurrent: torch.Tensor, spec: dict[str, int], rank: int, size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker rank ``rank`` of ``size``'s share of a whole state (its state pool's layout:
    ``[q_r | k_r | v_r]`` channels, its value heads ``[Hv / p, Dk, Dv]``)."""
    key, value = spec["key_dim"], spec["value_dim"]
    parts = conv.split([key, key, value])
    share = torch.cat([part.chunk(size)[rank] for part in parts])
    return share, recurrent.chunk(size)[rank]


def assert_state_in_ranks(
    states: Sequence[tuple[torch.Tensor, torch.Tensor]],
    dumps: Sequence[dict[str, torch.Tensor]],
    spec: dict[str, int],
    where: str,
) -> None:
    """Each linear layer's whole state (``states``, in the worker's linear-layer order) is,
    byte for byte, every worker rank's share of one slot, the same slot on every rank (the
    request's: the step names it to every rank)."""
    size = len(dumps)
    num_slots = dumps[0]["conv"].shape[1]
    for slot in range(num_slots):
        if all(
            _equal(share[0], dump["conv"][layer, slot])
            and _equal(share[1], dump["recurrent"][layer, slot])
            for layer, (conv, rec) in enumerate(states)
            for rank, dump in enumerate(dumps)
            for share in [rank_share(conv, rec, spec, rank, size)]
        ):
            return
    raise AssertionError(f"{where}: no state slot of the worker's ranks holds these bytes")


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte for byte (fp32 as int32: -0.0 and NaN compare as bytes)."""
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.int32), b.contiguous().view(torch.int32)
    )
