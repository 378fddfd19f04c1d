"""docs/config.md is generated from the models; this fails when it is stale."""

from __future__ import annotations

from pathlib import Path

from prefill_worker.service.config import SECTIONS
from prefill_worker.service.configdoc import render_config_doc

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_config_doc_is_current() -> None:
    assert DOC.read_text() == render_config_doc(), "stale: run `make docs`"


def test_config_doc_names_every_field() -> None:
    text = render_config_doc()
    for section, model in SECTIONS.items():
        assert f"## `{section}`" in text
        for key in model.model_fields:
            assert f"| `{key}` |" in text
