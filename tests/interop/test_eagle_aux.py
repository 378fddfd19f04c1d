"""The EAGLE-3 draft's first proposal as SGLang 0.5.23's decode reads it (``draft_child.py``, in
a child with SGLang on its path): the worker's drafting runner serves a prompt on a tiny random
Llama with a tiny random EAGLE-3 draft (``tests/eagle_checkpoints.py``, SGLang's checkpoint
format), its staging row (the hidden state [64] fp32) lands buffer by buffer in SGLang's own
``MetadataBuffers``, and SGLang's ``build_eagle_disagg_draft_input`` (``speculative_algorithm``
EAGLE3) builds its draft input from that row: top-k probabilities, top-k ids (the draft
vocabulary's, which SGLang's draft step maps by ``d2t``) and the pre-norm hidden state equal
the reference written from the draft's definition (``test_eagle_draft.reference``) within
1e-4; the bonus token is the first token, the room checks.
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
from tests.checkpoints import hf_model, prompt
from tests.eagle_checkpoints import target_and_draft
from tests.integration.model import test_eagle_draft
from tests.interop.conftest import ROOT, sglang_path
from tests.patience import patient

pytestmark = pytest.mark.interop

ROOM = 0x1234_5678_9ABC  # draft_child.ROOM


def test_sglang_builds_its_eagle3_draft_input_from_the_rows_we_wrote(tmp_path: Path) -> None:
    sglang_path("0.5.23")  # skips when not installed
    target, draft = target_and_draft(tmp_path, "eagle3")
    ids = prompt(40, seed=33)
    env = sglang_env(ROOT, "0.5.23")
    child = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "interop" / "draft_child.py"), str(target),
         str(test_eagle_draft.TOPK), ",".join(map(str, ids)), "eagle3", str(draft)],
        env=env, capture_output=True, text=True, timeout=patient(300), check=False,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    got = json.loads(child.stdout.strip().splitlines()[-1])
    tensors = load_file(draft / "model.safetensors")
    first, topk_p, topk_index, hidden, _, _ = test_eagle_draft.reference(
        "eagle3", hf_model(target), tensors, ids
    )
    assert got["first_token"] == first and got["bonus_tokens"] == [first]
    assert got["topk_index"] == [topk_index.tolist()]
    torch.testing.assert_close(torch.tensor(got["topk_p"][0]), topk_p, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor(got["hidden_states"][0]), hidden, atol=1e-4, rtol=0)
    assert got["room"] == ROOM
