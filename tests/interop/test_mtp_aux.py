"""The MTP draft's first proposal as SGLang 0.5.23's decode reads it (``draft_child.py``, in a
child with SGLang on its path): the worker's drafting runner serves a prompt on a tiny random
DeepSeek-V3 with an MTP layer, its staging row (the speculating layout: the hidden state
[hidden] fp32) lands buffer by buffer in SGLang's own ``MetadataBuffers`` (item sizes equal to
SGLang's ``get_buf_infos``), and SGLang's ``build_eagle_disagg_draft_input`` builds its draft
input from that row: top-k probabilities, top-k ids and hidden state equal the reference
written from the model's definition (``tests/integration/model/test_mtp_draft.py``) within
1e-4, the bonus token is the first token, the room checks.

Not covered here (not built yet): the draft KV into a decode's draft pool over NIXL, and the
engine carrying the draft row to the SGLang transfer (docs/models.md, "MTP draft").
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
from tests.integration.model import test_mtp_draft
from tests.interop.conftest import ROOT, sglang_path
from tests.patience import patient

pytestmark = pytest.mark.interop

ROOM = 0x1234_5678_9ABC  # draft_child.ROOM


def test_sglang_builds_its_draft_input_from_the_rows_we_wrote(tmp_path: Path) -> None:
    sglang_path("0.5.23")  # skips when not installed
    target = with_mtp_layer(tmp_path)
    ids = prompt(40, seed=31)
    env = sglang_env(ROOT, "0.5.23")
    child = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "interop" / "draft_child.py"), str(target),
         str(test_mtp_draft.TOPK), ",".join(map(str, ids))],
        env=env, capture_output=True, text=True, timeout=patient(300), check=False,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    got = json.loads(child.stdout.strip().splitlines()[-1])
    hf = (hf_model(target), hf_model(tmp_path / "donor"))
    first, topk_p, topk_index, hidden, _ = test_mtp_draft.reference(
        hf, load_file(target / "model.safetensors"), ids
    )
    assert got["first_token"] == first and got["bonus_tokens"] == [first]
    assert got["topk_index"] == [topk_index.tolist()]
    torch.testing.assert_close(torch.tensor(got["topk_p"][0]), topk_p, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor(got["hidden_states"][0]), hidden, atol=1e-4, rtol=0)
    assert got["room"] == ROOM
