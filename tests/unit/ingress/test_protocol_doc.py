"""docs/protocol.md names every reason and reject code the worker can send, and embeds the
current JSON Schema of the router messages."""

from __future__ import annotations

from pathlib import Path

from prefill_worker.ingress.messages import RejectCode
from prefill_worker.ingress.schemadoc import BEGIN, END, with_current_schema
from prefill_worker.request import FinishReason

DOC = (Path(__file__).resolve().parents[3] / "docs" / "protocol.md").read_text()


def test_every_finish_reason_is_documented() -> None:
    missing = [r.value for r in FinishReason if f"`{r.value}`" not in DOC]
    assert not missing, f"docs/protocol.md lacks result reasons {missing}"


def test_every_reject_code_is_documented() -> None:
    missing = [c.value for c in RejectCode if f"`{c.value}`" not in DOC]
    assert not missing, f"docs/protocol.md lacks reject codes {missing}"


def test_the_router_schema_is_current() -> None:
    assert DOC.count(BEGIN) == 1 and DOC.count(END) == 1
    assert with_current_schema(DOC) == DOC, "stale: run `make docs`"
