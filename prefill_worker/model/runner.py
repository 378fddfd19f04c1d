"""The model runner: turns a ``BatchPlan`` into tensors, runs the forward, samples.

Chunks are packed back to back without padding (``[T]`` tokens in plan order). Each token's
pool row is ``page_ids[pos // page_size] * page_size + pos % page_size``; the attention
backend is planned once per batch. Logits are computed only for the last token of chunks
whose ``sampling`` is set, i.e. the chunks that end their prompt, and prompt logprobs only for
the positions a chunk names (``logprob_from``, ``logprob_token_ids``): a batch where no chunk
asks builds nothing for them. The tokens of chunks with ``mirror_slots`` are also copied to
the KV cache's mirror, at those slots, during the same forward (``KVCache.mirroring``).
With a windowed sliding pool every chunk also names its sliding entries, and each token's row
there (``ForwardInputs.sliding_slots``) is found the same way from them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from prefill_worker.batch import (
    BatchOutput,
    BatchPlan,
    ChunkPlan,
    PromptLogprobs,
    SampledToken,
)
from prefill_worker.model.attention import AttentionBackend, AttentionBatch, ChunkSpan
from prefill_worker.model.deepseek import DeepseekV3LM
from prefill_worker.model.gdn import StateSpan
from prefill_worker.model.gemma3 import Gemma3LM
from prefill_worker.model.gpt_oss import GptOssLM
from prefill_worker.model.kv_cache import KVCache
from prefill_worker.model.kv_mirror import MirrorTargets
from prefill_worker.model.llama import CausalLM, ForwardInputs, ForwardOutput
from prefill_worker.model.moe.idle import idle_moe
from prefill_worker.model.qwen3_next import Qwen3NextLM
from prefill_worker.model.sampling import sample


class Packed(NamedTuple):
    """A plan as the forward takes it: its tensors, its attention batch, its mirrored tokens."""

    inputs: ForwardInputs
    batch: AttentionBatch
    mirror: MirrorTargets | None  # None: no chunk is mirrored


class Runner:
    """Implements ``prefill_worker.batch.ModelRunner`` for every family (Llama's
    ``CausalLM``, DeepSeek-V3's ``DeepseekV3LM``, the Qwen3-Next/Qwen3.5 hybrid's
    ``Qwen3NextLM``, whose chunks must each name a state slot)."""

    def __init__(
        self,
        model: CausalLM | DeepseekV3LM | Qwen3NextLM | GptOssLM | Gemma3LM,
        kv_cache: KVCache,
        attention: AttentionBackend,
    ) -> None:
        self.model = model
        self.num_state_slots = model.state.num_slots if isinstance(model, Qwen3NextLM) else 0
        self.kv_cache = kv_cache
        self.attention = attention
        self.page_size = kv_cache.layout.page_size
        self._synchronize = _device_sync(kv_cache.device)

    def run(self, plan: BatchPlan) -> BatchOutput:
        """Blocking: on return the pages hold the K/V (the transfer reads them next)."""
        if not plan.chunks:
            return BatchOutput(plan.batch_id, ())
        return self.outputs(plan, self.forward(plan))

    def run_idle(self) -> int:
        """A forward of no tokens (``model.moe.idle``): an attention-DP rank's step under
        expert parallelism while another rank runs a batch; the sparse layers run."""
        return idle_moe(self.model)

    def outputs(self, plan: BatchPlan, out: ForwardOutput) -> BatchOutput:
        """Sample the chunks that end their prompt; split the prompt logprobs."""
        prompt_logprobs = _split_logprobs(plan, out.token_logprobs)
        wanted = [c for c in plan.chunks if c.sampling is not None]
        if not wanted:
            self._synchronize()
            return BatchOutput(plan.batch_id, (), prompt_logprobs)
        with torch.inference_mode():
            samples = sample(out.logits, [c.sampling for c in wanted if c.sampling is not None])
        sampled = tuple(
            SampledToken(c.request_id, t, lp, error)
            for c, t, lp, error in zip(wanted, *samples, strict=True)
        )
        return BatchOutput(plan.batch_id, sampled, prompt_logprobs)

    def compute_logits(self, plan: BatchPlan) -> torch.Tensor:
        """Run the forward (K/V into pages); logits ``[R, vocab]`` of the sampled chunks."""
        return self.forward(plan).logits

    def forward(self, plan: BatchPlan) -> ForwardOutput:
        """Run the forward (K/V into pages): the sampled chunks' logits and the prompt
        logprobs the chunks asked for."""
        with torch.inference_mode():
            packed = self.pack(plan)
            self.attention.plan(packed.batch)
            with self.kv_cache.mirroring(packed.mirror):
                return self.model.forward(packed.inputs, self.kv_cache, self.attention)

    def pack(self, plan: BatchPlan) -> Packed:
        spans, ids, positions, slots, rows, sliding = [], [], [], [], [], []
        offset = 0
        for chunk in plan.chunks:
            span = self._span(chunk, offset)
            pos = np.arange(chunk.start, chunk.end, dtype=np.int64)
            spans.append(span)
            ids.append(np.asarray(chunk.token_ids, dtype=np.int64))
            positions.append(pos)
            slots.append(self._rows(span.page_ids, pos))
            if span.sliding_page_ids:
                sliding.append(self._rows(span.sliding_page_ids, pos))
            offset += chunk.num_tokens
            if chunk.sampling is not None:
                rows.append(offset - 1)
        device, all_ids = self.kv_cache.device, np.concatenate(ids)
        if all_ids.min() < 0 or all_ids.max() >= self.model.spec.vocab_size:
            raise ValueError(f"batch {plan.batch_id}: a token id is outside the vocabulary")
        inputs = ForwardInputs(
            input_ids=_to(all_ids, device),
            positions=_to(np.concatenate(positions), device),
            slots=_to(np.concatenate(slots), device),
            logits_rows=_to(np.asarray(rows, dtype=np.int64), device),
        )
        if any(chunk.logprob_token_ids for chunk in plan.chunks):
            logprob_rows, logprob_ids = self._logprob_rows(plan, spans)
            inputs = dataclasses.replace(
                inputs,
                logprob_rows=_to(logprob_rows, device),
                logprob_token_ids=_to(logprob_ids, device),
            )
        if self.num_state_slots:
            inputs = dataclasses.replace(inputs, state_spans=self._state_spans(plan, spans))
        if sliding:
            inputs = dataclasses.replace(inputs, sliding_slots=_to(np.concatenate(sliding), device))
        batch = AttentionBatch(tuple(spans), self.page_size, offset)
        return Packed(inputs, batch, _mirror_targets(plan, slots))

    def _state_spans(self, plan: BatchPlan, spans: list[ChunkSpan]) -> tuple[StateSpan, ...]:
        """Each chunk's rows and state slot (a hybrid model); one slot per chunk."""
        out, seen = [], set()
        for chunk, span in zip(plan.chunks, spans, strict=True):
            slot = chunk.state_slot
            if slot is None or not 0 <= slot < self.num_state_slots or slot in seen:
                raise ValueError(f"chunk of {chunk.request_id}: bad state slot {slot}")
            seen.add(slot)
            is_last = chunk.sampling is not None  # the chunk that ends the prompt
            out.append(StateSpan(span.q_start, span.q_end, slot, chunk.start == 0, is_last))
        return tuple(out)

    def _logprob_rows(
        self, plan: BatchPlan, spans: list[ChunkSpan]
    ) -> tuple[np.ndarray, np.ndarray]:
        """The packed rows of the positions that score a prompt token, and those tokens."""
        rows, ids = [], []
        for chunk, span in zip(plan.chunks, spans, strict=True):
            count = len(chunk.logprob_token_ids)
            if not count:
                continue
            if not chunk.start <= chunk.logprob_from <= chunk.end - count:
                raise ValueError(f"chunk of {chunk.request_id}: bad prompt-logprob positions")
            first = span.q_start + chunk.logprob_from - chunk.start
            rows.append(np.arange(first, first + count, dtype=np.int64))
            ids.append(np.asarray(chunk.logprob_token_ids, dtype=np.int64))
        all_ids = np.concatenate(ids)
        if all_ids.min() < 0 or all_ids.max() >= self.model.spec.vocab_size:
            raise ValueError(f"batch {plan.batch_id}: a token id is outside the vocabulary")
        return np.concatenate(rows), all_ids

    def _span(self, chunk: ChunkPlan, offset: int) -> ChunkSpan:
        num_pages = -(-chunk.end // self.page_size)
        if not 0 <= chunk.start < chunk.end or len(chunk.token_ids) != chunk.num_tokens:
            raise ValueError(f"chunk of {chunk.request_id}: bad range [{chunk.start}, {chunk.end})")
        if len(chunk.page_ids) < num_pages:
            raise ValueError(f"chunk of {chunk.request_id}: {num_pages} pages needed")
        page_ids = tuple(int(p) for p in chunk.page_ids[:num_pages])
        sliding = self._sliding_entries(chunk, num_pages)
        return ChunkSpan(
            offset, offset + chunk.num_tokens, chunk.start, chunk.end, page_ids, sliding
        )

    def _sliding_entries(self, chunk: ChunkPlan, num_pages: int) -> tuple[int, ...]:
        """The chunk's sliding entries: one per page with a windowed sliding pool (every
        page its window reads or writes held), none with a full one."""
        space = self.kv_cache.sliding
        if space is None:
            if chunk.sliding_page_ids:
                raise ValueError(f"chunk of {chunk.request_id}: sliding pages, no sliding pool")
            return ()
        entries = tuple(int(p) for p in chunk.sliding_page_ids[:num_pages])
        window = self.model.spec.sliding.window if self.model.spec.sliding else 1
        first = max(0, chunk.start - window + 1) // self.page_size
        if len(entries) < num_pages or not all(0 <= p < space.num_pages for p in entries[first:]):
            raise ValueError(
                f"chunk of {chunk.request_id}: sliding pages {first}..{num_pages - 1} needed"
            )
        return entries

    def _rows(self, page_ids: tuple[int, ...], positions: np.ndarray) -> np.ndarray:
        """Each position's pool row: ``page_ids[pos // page_size] * page_size + offset``."""
        pages = np.asarray(page_ids, dtype=np.int64)
        return pages[positions // self.page_size] * self.page_size + positions % self.page_size


def _mirror_targets(plan: BatchPlan, pool_slots: list[np.ndarray]) -> MirrorTargets | None:
    """The pool rows of the mirrored chunks' tokens (``pool_slots``: each chunk's, in plan
    order) and their mirror slots; None when no chunk is mirrored."""
    pool, mirror = [], []
    for chunk, chunk_slots in zip(plan.chunks, pool_slots, strict=True):
        if not chunk.mirror_slots:
            continue
        if len(chunk.mirror_slots) != chunk.num_tokens:
            raise ValueError(f"chunk of {chunk.request_id}: one mirror slot per token needed")
        pool.append(chunk_slots)
        mirror.append(np.asarray(chunk.mirror_slots, dtype=np.int64))
    if not pool:
        return None
    return MirrorTargets(np.concatenate(pool), np.concatenate(mirror))


def _split_logprobs(plan: BatchPlan, values: torch.Tensor | None) -> tuple[PromptLogprobs, ...]:
    """``values [L]`` (packed in plan order) as one ``PromptLogprobs`` per asking chunk."""
    if values is None:
        return ()
    flat: list[float] = values.tolist()
    out, at = [], 0
    for chunk in plan.chunks:
        count = len(chunk.logprob_token_ids)
        if count:
            out.append(PromptLogprobs(chunk.request_id, tuple(flat[at : at + count])))
            at += count
    return tuple(out)


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(array).to(device, non_blocking=True)


def _device_sync(device: torch.device) -> Callable[[], None]:
    """Waits for queued kernels: a no-op on CPU, where every op has finished on return."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None
