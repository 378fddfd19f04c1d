"""A draft's first proposal as SGLang 0.5.23's decode reads it (``draft_child.py``, one child
with SGLang on its path for every case): the worker's drafting runner serves a prompt, its
staging row (the speculating layout: the hidden state [hidden] fp32) lands buffer by buffer in
SGLang's own ``MetadataBuffers`` (item sizes equal to SGLang's ``get_buf_infos``), and SGLang's
``build_eagle_disagg_draft_input`` builds its draft input from that row: top-k probabilities,
top-k ids and hidden state equal the reference written from the model's definition within
1e-4, the bonus token is the first token, the room checks. Two drafts:

- DeepSeek-V3's MTP layer on a tiny random DeepSeek-V3 (``speculative_algorithm`` EAGLE;
  reference: ``tests/integration/model/test_mtp_draft.py``);
- an EAGLE-3 draft of a tiny random Llama, saved in SGLang's checkpoint format
  (``tests/eagle_checkpoints.py``; EAGLE3; reference: ``test_eagle_draft.py``): its top-k ids
  are the draft vocabulary's, which SGLang's draft step maps by ``d2t``, and its hidden state
  the one before the draft's norm.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from prefill_worker.testing.sglang_env import sglang_env
from tests.checkpoints import hf_model, prompt, with_mtp_layer
from tests.eagle_checkpoints import target_and_draft
from tests.integration.model import test_eagle_draft, test_mtp_draft
from tests.interop.conftest import ROOT, sglang_path
from tests.patience import patient

pytestmark = pytest.mark.interop

ROOM = 0x1234_5678_9ABC  # draft_child.ROOM
IDS = {"mtp": prompt(40, seed=31), "eagle3": prompt(40, seed=33)}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, dict], Path]:
    """(SGLang's draft input per kind, the checkpoints' root)."""
    sglang_path("0.5.23")  # skips when not installed
    root = tmp_path_factory.mktemp("draft_aux")
    mtp = with_mtp_layer(root / "mtp")
    target, draft = target_and_draft(root / "eagle", "eagle3")
    cases = [
        {"kind": "mtp", "target": str(mtp), "draft": None, "topk": test_mtp_draft.TOPK,
         "ids": IDS["mtp"]},
        {"kind": "eagle3", "target": str(target), "draft": str(draft),
         "topk": test_eagle_draft.TOPK, "ids": IDS["eagle3"]},
    ]  # fmt: skip
    child = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "interop" / "draft_child.py"), json.dumps(cases)],
        env=sglang_env(ROOT, "0.5.23"), capture_output=True, text=True, timeout=patient(300),
        check=False,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    lines = child.stdout.strip().splitlines()[-2:]
    return {case["kind"]: json.loads(line) for case, line in zip(cases, lines, strict=True)}, root


def check(got: dict, first: int, topk_p, topk_index, hidden) -> None:  # type: ignore[no-untyped-def]
    assert got["first_token"] == first and got["bonus_tokens"] == [first]
    assert got["topk_index"] == [topk_index.tolist()]
    torch.testing.assert_close(torch.tensor(got["topk_p"][0]), topk_p, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor(got["hidden_states"][0]), hidden, atol=1e-4, rtol=0)
    assert got["room"] == ROOM


def test_sglang_builds_its_draft_input_from_the_mtp_rows_we_wrote(served) -> None:
    got, root = served
    target = root / "mtp" / "target"
    hf = (hf_model(target), hf_model(root / "mtp" / "donor"))
    tensors = load_file(target / "model.safetensors")
    first, topk_p, topk_index, hidden, _ = test_mtp_draft.reference(hf, tensors, IDS["mtp"])
    check(got["mtp"], first, topk_p, topk_index, hidden)


def test_sglang_builds_its_eagle3_draft_input_from_the_rows_we_wrote(served) -> None:
    got, root = served
    tensors = load_file(root / "eagle" / "eagle3" / "model.safetensors")
    target = hf_model(root / "eagle" / "target")
    first, topk_p, topk_index, hidden, _, _ = test_eagle_draft.reference(
        "eagle3", target, tensors, IDS["eagle3"]
    )
    check(got["eagle3"], first, topk_p, topk_index, hidden)
