"""Tiny random EAGLE and EAGLE-3 drafts for a tiny random 4-layer Llama, saved as SGLang 0.5.23
loads them (``llama_eagle.py``: ``fc`` with its bias and ``layers.0.`` without an input norm;
``llama_eagle3.py``: the legacy ``midlayer.`` names, ``hidden_norm``, ``norm``, its own LM head
over a draft vocabulary and ``d2t``/``t2d``).

The draft's K/V geometry is the target's (2 heads of 16); its MLP width (96) is its own. The
EAGLE-3 draft reads the input of the target's layers 1, 2 and 3
(``eagle_aux_hidden_state_layer_ids`` [0, 1, 2]); its vocabulary is 96 of the target's 320
tokens (``d2t[i]``: target id of draft id i, minus i).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.checkpoints import make_checkpoint

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, WIDTH, VOCAB = 64, 4, 2, 16, 96, 320
DRAFT_VOCAB = 96
AUX_LAYER_IDS = [0, 1, 2]  # the target layers (1, 2, 3) whose input EAGLE-3 reads
LAYER = {"eagle": "layers.0.", "eagle3": "midlayer."}


def target_and_draft(root: Path, kind: str) -> tuple[Path, Path]:
    """(a 4-layer Llama under ``root / "target"``, its ``kind`` draft under ``root / kind``)."""
    target = root / "target"
    if not (target / "config.json").exists():
        make_checkpoint("llama", target, num_hidden_layers=4)
    draft = root / kind
    draft.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(45 if kind == "eagle" else 46)
    save_file(_tensors(kind, g), draft / "model.safetensors", metadata={"format": "pt"})
    (draft / "config.json").write_text(json.dumps(_config(kind)))
    return target, draft


def hot_token_ids() -> torch.Tensor:
    """EAGLE-3's draft vocabulary: target id of each draft id ``[DRAFT_VOCAB]``."""
    g = torch.Generator().manual_seed(47)
    return torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values


def _tensors(kind: str, g: torch.Generator) -> dict[str, torch.Tensor]:
    def randn(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    def norm() -> torch.Tensor:
        return torch.rand(HIDDEN, generator=g) + 0.5

    p, is_3 = LAYER[kind], kind == "eagle3"
    layer_in = 2 * HIDDEN if is_3 else HIDDEN
    out = {
        "fc.weight": randn(HIDDEN, 3 * HIDDEN if is_3 else 2 * HIDDEN, scale=0.15),
        p + "self_attn.q_proj.weight": randn(HEADS * HEAD_DIM, layer_in, scale=0.3),
        p + "self_attn.k_proj.weight": randn(KV_HEADS * HEAD_DIM, layer_in, scale=0.3),
        p + "self_attn.v_proj.weight": randn(KV_HEADS * HEAD_DIM, layer_in, scale=0.15),
        p + "self_attn.o_proj.weight": randn(HIDDEN, HEADS * HEAD_DIM, scale=0.15),
        p + "post_attention_layernorm.weight": norm(),
        p + "mlp.gate_proj.weight": randn(WIDTH, HIDDEN, scale=0.15),
        p + "mlp.up_proj.weight": randn(WIDTH, HIDDEN, scale=0.15),
        p + "mlp.down_proj.weight": randn(HIDDEN, WIDTH, scale=0.15),
    }
    if not is_3:  # EAGLE's fc has a bias; its checkpoint also holds an embedding SGLang drops
        return out | {
            "fc.bias": randn(HIDDEN, scale=0.2),
            "embed_tokens.weight": randn(VOCAB, HIDDEN, scale=1.0),
        }
    hot = hot_token_ids()
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[hot] = True
    return out | {
        p + "input_layernorm.weight": norm(),
        p + "hidden_norm.weight": norm(),
        "norm.weight": norm(),
        "lm_head.weight": randn(DRAFT_VOCAB, HIDDEN, scale=0.5),
        "d2t": hot - torch.arange(DRAFT_VOCAB),
        "t2d": t2d,
    }


def _config(kind: str) -> dict[str, object]:
    config: dict[str, object] = {
        "architectures": ["LlamaForCausalLMEagle3" if kind == "eagle3" else "LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": WIDTH,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 1,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if kind == "eagle3":
        config |= {
            "draft_vocab_size": DRAFT_VOCAB,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_LAYER_IDS},
        }
    return config
