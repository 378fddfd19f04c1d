"""Keeps the JSON Schema in docs/protocol.md in step with the Structs (``make docs``).

``python -m prefill_worker.ingress.schemadoc docs/protocol.md`` rewrites the block between the
markers; ``tests/unit/ingress/test_protocol_doc.py`` fails while it is stale.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from prefill_worker.ingress.messages import json_schema

BEGIN = "<!-- router-schema:begin -->"
END = "<!-- router-schema:end -->"


def render_schema_block() -> str:
    body = json.dumps(json_schema(), indent=2, sort_keys=True)
    return f"{BEGIN}\n```json\n{body}\n```\n{END}"


def with_current_schema(doc: str) -> str:
    """``doc`` with the block between the markers replaced by the current schema."""
    start, end = doc.index(BEGIN), doc.index(END) + len(END)
    return doc[:start] + render_schema_block() + doc[end:]


def main(argv: list[str]) -> None:
    path = Path(argv[0])
    path.write_text(with_current_schema(path.read_text()))


if __name__ == "__main__":
    main(sys.argv[1:])
