"""The runner of a target with a draft model: the target's forward, its sampling, then the
draft's extend over the same chunks (speculative decoding under PD).

Per batch::

    target forward (K/V into the target pool) -> the states the draft reads [T, n hidden]
                (MTP, EAGLE: the final hidden state after the norm; EAGLE-3: three layers')
    sample the chunks that end their prompt -> first tokens
    draft ids = the batch's ids shifted by one per chunk; each chunk's last row takes the
                prompt token after it (ChunkPlan.next_token_id) or, on the prompt's last
                chunk, its sampled token
    draft extend (its latent rows into the draft pool, at the target's slots)
    each SampledToken carries the draft's proposal (batch.DraftRow), which is also written
                into ``draft_rows`` at the chunk's aux row (ChunkPlan.state_slot), where the
                transfer backends read it (``kv.draft_rows``)

The draft runs on every chunk, not only the last, because its KV must cover the whole
prompt; its cost is one more decoder layer and one LM head row per sampled chunk. A row
that could not be sampled (its request fails) feeds token 0 to the draft, whose proposal
for it is never sent.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from prefill_worker.batch import BatchOutput, BatchPlan, DraftRow, SampledToken
from prefill_worker.kv.draft_rows import DraftRows
from prefill_worker.model.attention import AttentionBackend
from prefill_worker.model.draft.mtp import DraftProposal, shifted_ids
from prefill_worker.model.hf_config import ModelSpec
from prefill_worker.model.kv_cache import KVCache
from prefill_worker.model.llama import ForwardInputs, ForwardOutput
from prefill_worker.model.parallel import broadcast_from_leader_
from prefill_worker.model.runner import Packed, Runner


class Draft(Protocol):
    """A draft model: what it reads from the target's forward, and its extend over it
    (``mtp.MTPDraft``, ``eagle.EagleDraft``)."""

    @property
    def spec(self) -> ModelSpec: ...  # its hidden size is the proposal's hidden state's

    def target_forward(
        self, target: Any, inputs: ForwardInputs, kv_cache: KVCache, attention: AttentionBackend
    ) -> tuple[ForwardOutput, torch.Tensor]: ...

    def extend(
        self,
        inputs: ForwardInputs,
        states: torch.Tensor,
        kv_cache: KVCache,
        attention: AttentionBackend,
    ) -> DraftProposal: ...


class DraftingRunner(Runner):
    """A ``Runner`` over a target and its draft (DeepSeek-V3's MTP layer, an EAGLE draft of
    a Llama), whose pool ``draft_kv`` (one layer, as many pages as the target's) takes the
    draft's rows at the target's slots."""

    def __init__(
        self,
        model: Any,  # the target: what ``draft.target_forward`` takes
        kv_cache: KVCache,
        attention: AttentionBackend,
        draft: Draft,
        draft_kv: KVCache,
    ) -> None:
        super().__init__(model, kv_cache, attention)
        assert draft_kv.layout.num_pages == kv_cache.layout.num_pages, "slots are shared"
        self.target, self.draft, self.draft_kv = model, draft, draft_kv
        self.on_draft_forward: Callable[[float], None] | None = None  # seconds per batch
        self.draft_rows: DraftRows | None = None  # the proposals by aux row, once attached

    @property
    def hidden_bytes(self) -> int:
        """A proposal's hidden state, in bytes (the draft's hidden size x the model dtype)."""
        return self.draft.spec.hidden_size * self.target.dtype.itemsize

    def run(self, plan: BatchPlan) -> BatchOutput:
        if not plan.chunks:
            return BatchOutput(plan.batch_id, ())
        with torch.inference_mode():
            packed = self.pack(plan)
            self.attention.plan(packed.batch)
            with self.kv_cache.mirroring(packed.mirror):
                out, states = self.draft.target_forward(
                    self.target, packed.inputs, self.kv_cache, self.attention
                )
        output = self.outputs(plan, out)
        started = time.perf_counter()
        rows = self._extend(plan, packed, states, output.sampled)
        if self.on_draft_forward is not None:
            self.on_draft_forward(time.perf_counter() - started)
        sampled = tuple(
            dataclasses.replace(s, draft=row) for s, row in zip(output.sampled, rows, strict=True)
        )
        self._keep(plan, sampled)
        return dataclasses.replace(output, sampled=sampled)

    def _keep(self, plan: BatchPlan, sampled: tuple[SampledToken, ...]) -> None:
        """Each sampled chunk's proposal into its aux row's draft row (not a failed one's)."""
        if self.draft_rows is None:
            return
        ending = [c for c in plan.chunks if c.sampling is not None]
        for chunk, token in zip(ending, sampled, strict=True):
            if token.error is None and token.draft is not None and chunk.state_slot is not None:
                self.draft_rows.write(chunk.state_slot, token.draft)

    def _extend(
        self,
        plan: BatchPlan,
        packed: Packed,
        states: torch.Tensor,  # [T, n hidden], what the draft reads of the target's
        sampled: tuple[SampledToken, ...],
    ) -> list[DraftRow]:
        device, tp = self.kv_cache.device, self.target.tp
        ends = np.cumsum([c.num_tokens for c in plan.chunks], dtype=np.int64)
        # Under TP only the leader samples (a follower's plan says that a chunk samples, not
        # how, nor the prompt token after a chunk): every rank takes the leader's next ids.
        next_ids = _next_ids(plan, sampled) if tp.rank == 0 else [0] * len(plan.chunks)
        with torch.inference_mode():
            next_tensor = torch.tensor(next_ids, dtype=torch.int64, device=device)  # [C]
            inputs = dataclasses.replace(
                packed.inputs,
                input_ids=shifted_ids(
                    packed.inputs.input_ids,
                    torch.from_numpy(ends).to(device),
                    broadcast_from_leader_(next_tensor, tp),
                ),
                logprob_rows=None,
                logprob_token_ids=None,
            )
            proposal = self.draft.extend(inputs, states, self.draft_kv, self.attention)
            return _rows(proposal)


def _next_ids(plan: BatchPlan, sampled: tuple[SampledToken, ...]) -> list[int]:
    """Each chunk's token after its last: the next prompt token, or the sampled one."""
    first = iter(sampled)
    out = []
    for chunk in plan.chunks:
        if chunk.sampling is not None:
            out.append(max(next(first).token_id, 0))  # -1: the row failed to sample
        elif chunk.next_token_id is None:
            raise ValueError(f"chunk of {chunk.request_id}: no next token for the draft")
        else:
            out.append(chunk.next_token_id)
    return out


def _rows(proposal: DraftProposal) -> list[DraftRow]:
    topk_p = proposal.topk_p.tolist()
    topk_index = proposal.topk_index.tolist()
    hidden = proposal.hidden.contiguous().cpu().view(torch.uint8).numpy()  # [R, hidden bytes]
    return [
        DraftRow(tuple(p), tuple(i), h.tobytes())
        for p, i, h in zip(topk_p, topk_index, hidden, strict=True)
    ]
