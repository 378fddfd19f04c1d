"""MLA prefill attention, decompressed (what ``model.mla`` runs) against absorbed, on the CPU.

One layer's attention of DeepSeek-V3's head shape (kv_lora_rank 512, qk_nope 128, qk_rope 64,
v 128) with 16 heads (DeepSeek-V3's 128 over a TP of 8), fp32, over a prompt of ``n`` new
tokens after ``m - n`` cached ones (whose latent rows are read back from the pool either way):

    decompressed  k_nope, v = latent @ kv_b (per chunk);  SDPA at head width 192 / 128
    absorbed      q_lat = q_nope @ W_UK;  SDPA over the shared [latent | k_rope] at width
                  576 / 512;  out = out_lat @ W_UV

Both give the same output (checked to 1e-3 relative each point). Writes one JSON line per
(n, m): the best-of-3 seconds of each and their ratio (absorbed / decompressed).

    python bench/mla_forms.py [--threads N]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

HEADS, RANK, NOPE, ROPE, V = 16, 512, 128, 64, 128
SCALE = (NOPE + ROPE) ** -0.5


def decompressed(q: torch.Tensor, rows: torch.Tensor, kv_b: torch.Tensor) -> torch.Tensor:
    """``q [n, H, nope + rope]``, ``rows [m, r + rope]`` -> ``[n, H, v]`` (``model.mla``'s form)."""
    m = rows.shape[0]
    kv = F.linear(rows[:, :RANK], kv_b).view(m, HEADS, NOPE + V)
    k = q.new_empty(m, HEADS, NOPE + ROPE)
    k[..., :NOPE] = kv[..., :NOPE]
    k[..., NOPE:] = rows[:, None, RANK:]
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, kv[..., NOPE:]))  # 4-D: flash
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=_mask(q.shape[0], m), scale=SCALE)
    return out[0].transpose(0, 1)


def absorbed(q: torch.Tensor, rows: torch.Tensor, kv_b: torch.Tensor) -> torch.Tensor:
    """The same through the latent: ``kv_b``'s key half folded into q, its value half after."""
    n, m = q.shape[0], rows.shape[0]
    w = kv_b.view(HEADS, NOPE + V, RANK)
    q_lat = torch.einsum("nhd,hdr->hnr", q[..., :NOPE], w[:, :NOPE])  # [H, n, r]
    q_full = torch.cat([q_lat, q[..., NOPE:].transpose(0, 1)], dim=-1)  # [H, n, r + rope]
    k = rows[None].expand(HEADS, m, RANK + ROPE)
    v = rows[None, :, :RANK].expand(HEADS, m, RANK)
    out_lat = F.scaled_dot_product_attention(
        q_full[None], k[None], v[None], attn_mask=_mask(n, m), scale=SCALE
    )[0]  # 4-D: the CPU's flash kernel
    return torch.einsum("hnr,hvr->nhv", out_lat, w[:, NOPE:])  # [n, H, v]


def _mask(n: int, m: int) -> torch.Tensor:
    """Query i (position m - n + i) sees keys j <= m - n + i."""
    return torch.arange(m)[None, :] <= torch.arange(m - n, m)[:, None]


def best_of(fn: Callable[[], torch.Tensor], runs: int = 3) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    kv_b = torch.randn(HEADS * (NOPE + V), RANK, generator=g) * RANK**-0.5
    for n, m in ((2048, 2048), (512, 2048), (64, 2048), (1, 2048)):
        q = torch.randn(n, HEADS, NOPE + ROPE, generator=g)
        rows = torch.randn(m, RANK + ROPE, generator=g)
        with torch.inference_mode():
            ref, alt = decompressed(q, rows, kv_b), absorbed(q, rows, kv_b)
            torch.testing.assert_close(alt, ref, rtol=1e-3, atol=1e-3)
            t_dec = best_of(lambda q=q, rows=rows: decompressed(q, rows, kv_b))
            t_abs = best_of(lambda q=q, rows=rows: absorbed(q, rows, kv_b))
        line = {"bench": "mla_forms", "new_tokens": n, "kv_tokens": m, "heads": HEADS,
                "threads": args.threads, "decompressed_s": round(t_dec, 4),
                "absorbed_s": round(t_abs, 4), "ratio": round(t_abs / t_dec, 2)}  # fmt: skip
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
