"""The bootstrap JSON Schema in ``docs/protocol.md``, generated from the Structs in ``wire.py``.

A docs tool, outside the worker's import graph. ``make docs`` runs::

    python -m prefill_worker.transfer.schemadoc docs/protocol.md

which rewrites the block between the two markers in place; a test fails when it is stale.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from prefill_worker.transfer import wire

BEGIN = "<!-- bootstrap-schema:begin -->"
END = "<!-- bootstrap-schema:end -->"


def render_schema_block() -> str:
    """The markers and, between them, the schema as a fenced JSON block."""
    schema = json.dumps(wire.json_schema(), indent=2, ensure_ascii=False)
    return f"{BEGIN}\n```json\n{schema}\n```\n{END}"


def with_current_schema(doc: str) -> str:
    """``doc`` with the block between the markers replaced by the current schema."""
    start, end = doc.index(BEGIN), doc.index(END) + len(END)
    return doc[:start] + render_schema_block() + doc[end:]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(
            "usage: python -m prefill_worker.transfer.schemadoc docs/protocol.md", file=sys.stderr
        )
        return 2
    path = Path(args[0])
    path.write_text(with_current_schema(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
