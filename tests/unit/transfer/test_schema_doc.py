"""docs/protocol.md Part 2 embeds the bootstrap JSON Schema made from the wire Structs; this
fails when it is stale."""

from __future__ import annotations

import json
from pathlib import Path

from prefill_worker.transfer import schemadoc, wire

DOC = Path(__file__).resolve().parents[3] / "docs" / "protocol.md"


def test_protocol_doc_schema_is_current() -> None:
    text = DOC.read_text()
    assert text == schemadoc.with_current_schema(text), (
        "stale: run `python -m prefill_worker.transfer.schemadoc docs/protocol.md` (make docs)"
    )


def test_schema_names_every_message_by_its_type_tag() -> None:
    schema = wire.json_schema()
    assert schema["discriminator"]["propertyName"] == "type"
    tags = set(schema["discriminator"]["mapping"])
    assert tags == {
        "register", "want", "abort", "heartbeat", "bye", "describe",
        "registered", "status", "reject", "unknown_peer", "described",
    }  # fmt: skip
    want = schema["$defs"]["Want"]
    assert set(want["required"]) == {"type", "room", "dst_page_ids", "dst_aux_slot"} | {
        "num_cached_tokens"
    }


def test_the_block_sits_between_the_markers_once() -> None:
    text = DOC.read_text()
    assert text.count(schemadoc.BEGIN) == 1 and text.count(schemadoc.END) == 1
    block = text[text.index(schemadoc.BEGIN) : text.index(schemadoc.END)]
    body = block.split("```json\n", 1)[1].rsplit("```", 1)[0]
    assert json.loads(body) == wire.json_schema()
