"""The indexer tensors of a DeepSeek-V3.2 / GLM-5 checkpoint, beside its DeepSeek-V3 ones
(``model.loader`` reads those): their names and shapes, and ``DSAModelWeights`` from them.

Per indexed layer, under ``model.layers.N.self_attn.indexer.``::

    wq_b.weight          [index_n_heads * index_head_dim, q_lora_rank]
    wk.weight            [index_head_dim, hidden]
    k_norm.weight/bias   [index_head_dim]
    weights_proj.weight  [index_n_heads, hidden]    the model's dtype; an fp16 model's in
                                                    fp32 (``loader.KEEP_IN_FP32``), as
                                                    transformers keeps it; the projection
                                                    runs in its dtype (``model.dsa``)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from prefill_worker.model.deepseek import MLAModelWeights
from prefill_worker.model.dsa import DSAModelWeights, IndexerWeights
from prefill_worker.model.hf_config import ModelSpec


def indexer_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every indexer tensor the checkpoint must hold, with its shape."""
    assert spec.indexer is not None and spec.mla is not None
    idx, hidden = spec.indexer, spec.hidden_size
    q_lora = spec.mla.q_lora_rank or 0  # hf_dsa refuses a DSA config without one
    shapes: dict[str, tuple[int, ...]] = {}
    for layer in idx.indexed_layers:
        p = f"model.layers.{layer}.self_attn.indexer."
        shapes |= {
            p + "wq_b.weight": (idx.num_heads * idx.head_dim, q_lora),
            p + "wk.weight": (idx.head_dim, hidden),
            p + "k_norm.weight": (idx.head_dim,),
            p + "k_norm.bias": (idx.head_dim,),
            p + "weights_proj.weight": (idx.num_heads, hidden),
        }
    return shapes


def fuse_dsa(
    spec: ModelSpec, mla: MLAModelWeights, get: Callable[[str], torch.Tensor]
) -> DSAModelWeights:
    """``mla``'s weights with every layer's indexer (None for a shared layer)."""
    assert spec.indexer is not None
    indexed = set(spec.indexer.indexed_layers)
    indexers = tuple(
        _indexer(get, f"model.layers.{i}.self_attn.indexer.") if i in indexed else None
        for i in range(spec.num_layers)
    )
    return DSAModelWeights(mla.embed, mla.layers, mla.norm, mla.lm_head, indexers)


def _indexer(get: Callable[[str], torch.Tensor], p: str) -> IndexerWeights:
    return IndexerWeights(
        wq_b=get(p + "wq_b.weight"),
        wk=get(p + "wk.weight"),
        k_norm=get(p + "k_norm.weight"),
        k_norm_bias=get(p + "k_norm.bias"),
        weights_proj=get(p + "weights_proj.weight"),
    )
