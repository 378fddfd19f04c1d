"""Child of ``test_draft_aux.py``, run with a pinned SGLang on its
path: this worker's drafting runner serves a prompt, its SGLang staging row
(``transfer.sglang.aux``, the speculating layout) is written buffer by buffer into SGLang's
own ``MetadataBuffers`` at the descriptors a NIXL WRITE would use, then SGLang's decode reads
the row as ``decode.py`` does and its ``build_eagle_disagg_draft_input`` builds the first draft
input. Prints one JSON line.

    python tests/interop/draft_child.py '[{"kind": ..., "target": ..., "draft": ..., "topk": ...,
                                           "ids": [...]}, ...]'

One line per case, in order (SGLang is imported once for all). ``kind``: ``mtp``
(DeepSeek-V3's MTP layer, ``draft`` null), ``eagle`` or ``eagle3`` (a Llama target, its draft
checkpoint at ``draft``).
"""

from __future__ import annotations

import ctypes
import json
import sys
from types import SimpleNamespace

import torch
from sglang.srt import runtime_context
from sglang.srt.disaggregation.utils import MetadataBuffers
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.eagle_disaggregation import build_eagle_disagg_draft_input

from prefill_worker.batch import BatchPlan, ChunkPlan
from prefill_worker.kv.aux import AuxRow
from prefill_worker.model import build
from prefill_worker.request import SamplingParams
from prefill_worker.transfer.sglang.aux import AuxStaging, remote_descs, spec_row_dtype

ROOM, SLOT, PAGE_SIZE = 0x1234_5678_9ABC, 3, 16


def serve(path: str, topk: int, ids: list[int], kind: str, draft_path: str | None):  # type: ignore[no-untyped-def]
    """(sampled token, the staging with its row 1 filled, the draft's hidden size)."""
    runner, _, _ = build(
        path, dtype="float32", device="cpu", page_size=PAGE_SIZE, num_pages=32,
        draft=kind, draft_topk=topk, draft_path=draft_path,
    )  # fmt: skip
    pages = list(range(1, 1 + -(-len(ids) // PAGE_SIZE)))
    chunk = ChunkPlan("r", ids, 0, len(ids), pages, SamplingParams())
    sampled = runner.run(BatchPlan(0, (chunk,))).sampled[0]
    staging = AuxStaging(2, spec_row_dtype(runner.hidden_bytes))
    aux = AuxRow(sampled.token_id, sampled.logprob, len(ids), 0)
    staging.fill(1, aux, ROOM, sampled.draft)
    return sampled, staging, runner.hidden_bytes // 4


def land(staging: AuxStaging, buffers: MetadataBuffers) -> None:
    """What a NIXL WRITE of the row does: each buffer's bytes to the decode's row SLOT."""
    ptrs, _, lens = buffers.get_buf_infos()
    assert tuple(lens) == staging.item_bytes, (lens, staging.item_bytes)
    for (src, size, _), (dst, dst_size, _) in zip(
        staging.local_descs(1), remote_descs(tuple(ptrs), SLOT, tuple(lens)), strict=True
    ):
        assert size == dst_size
        ctypes.memmove(int(dst), int(src), int(size))


def decode_reads(buffers: MetadataBuffers, hf_config, vocab_size: int):  # type: ignore[no-untyped-def]
    """SGLang's decode: the row into its request (decode.py), then the first draft input."""
    row = buffers.get_buf(SLOT)
    output_id, output_topk_p, output_topk_index, output_hidden_states = (
        row[0], row[9], row[10], row[11],
    )  # fmt: skip
    req = SimpleNamespace(
        output_topk_p=output_topk_p,
        output_topk_index=output_topk_index,
        hidden_states_tensor=output_hidden_states,
        output_dsa_topk_indices=row[12],
    )
    batch = SimpleNamespace(
        reqs=[req],
        device="cpu",
        model_config=SimpleNamespace(hf_config=hf_config, vocab_size=vocab_size),
        enable_overlap=False,
    )
    last = torch.tensor([int(output_id[0])])
    return build_eagle_disagg_draft_input(batch, last, None), int(row[-1][0])


def run_case(case: dict) -> dict:  # type: ignore[type-arg]
    """One case: {"kind", "target", "draft" (None for mtp), "topk", "ids"}."""
    kind, path, draft_path, topk = case["kind"], case["target"], case["draft"], case["topk"]
    sampled, staging, hidden_size = serve(path, topk, case["ids"], kind, draft_path)
    args = ServerArgs(
        model_path=path, disaggregation_mode="decode", disaggregation_transfer_backend="nixl",
        device="cpu", speculative_algorithm="EAGLE3" if kind == "eagle3" else "EAGLE",
        speculative_draft_model_path=draft_path, speculative_eagle_topk=topk,
        speculative_num_steps=3, speculative_num_draft_tokens=4,
    )  # fmt: skip
    runtime_context.publish(args, role="test")
    buffers = MetadataBuffers(8, hidden_size, torch.float32, max_sampling_mask_tokens=16)
    land(staging, buffers)
    arch = "DeepseekV3ForCausalLM" if kind == "mtp" else "LlamaForCausalLM"
    hf_config = SimpleNamespace(architectures=[arch])
    draft_input, room = decode_reads(buffers, hf_config, 320)
    return {
        "first_token": sampled.token_id,
        "bonus_tokens": draft_input.bonus_tokens.tolist(),
        "topk_p": draft_input.topk_p.tolist(),
        "topk_index": draft_input.topk_index.tolist(),
        "hidden_states": draft_input.hidden_states.tolist(),
        "room": room,
    }


def main() -> None:
    for case in json.loads(sys.argv[1]):
        print(json.dumps(run_case(case)), flush=True)


if __name__ == "__main__":
    main()
