"""An idle step under expert parallelism across attention-DP ranks: a forward of no tokens.

Attention-DP ranks run different batches, but every sparse layer's exchange
(``model.moe.alltoall``) is a collective over all of them: while any rank runs a forward,
every other rank must run the same sequence of exchanges, in layer order, even with no
tokens of its own, because the busy rank's tokens may need its experts (SGLang's idle
batches). Attention and the dense layers run no collective at TP 1, so an idle rank runs only
the sparse layers' blocks over an empty ``[0, hidden]`` input: routing nothing, sending
nothing, computing its experts over the rows the other ranks send it.
"""

from __future__ import annotations

from typing import Any

import torch

from prefill_worker.model.moe.base import MoEWeights
from prefill_worker.model.moe.block import moe_mlp


def idle_moe(model: Any) -> int:
    """Run each sparse layer's block of ``model`` (``CausalLM`` or ``DeepseekV3LM``: their
    ``weights.layers``, ``spec.moe``, ``experts`` and ``tp``) over no tokens; the number of
    sparse layers run (each one exchange)."""
    spec = model.spec
    assert spec.moe is not None, "an idle step runs a mixture-of-experts model's exchanges"
    empty = model.weights.embed.new_empty((0, spec.hidden_size))
    count = 0
    with torch.inference_mode():
        for layer in model.weights.layers:
            if isinstance(layer.mlp, MoEWeights):
                moe_mlp(empty, layer.mlp, spec.moe, model.experts, model.tp)
                count += 1
    return count
