"""Logging set-up (text or one JSON object per line) and the per-request outcome line."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from prefill_worker.request import Outcome

_RESERVED = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record; ``extra={...}`` fields become top-level keys."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update({k: v for k, v in record.__dict__.items() if k not in _RESERVED})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def log_outcome(logger: logging.Logger, outcome: Outcome, trace_id: str | None = None) -> None:
    """One line per request outcome, with its id, timings and trace id (when traced)."""
    t = outcome.timings
    fields = {
        "request_id": outcome.request_id,
        "status": outcome.status.value,
        "reason": outcome.reason.value,
        "prompt_tokens": outcome.num_prompt_tokens,
        "cached_tokens": outcome.num_cached_tokens,
        "prefix_hit_tokens": outcome.num_prefix_hit_tokens,
        "first_token_id": outcome.first_token_id,
        "queue_s": round(t.queue_s, 6),
        "bootstrap_s": round(t.bootstrap_s, 6),
        "prefill_s": round(t.prefill_s, 6),
        "transfer_s": round(t.transfer_s, 6),
    }
    if outcome.error:
        fields["error"] = outcome.error
    if trace_id is not None:
        fields["trace_id"] = trace_id
    text = " ".join(f"{k}={v}" for k, v in fields.items())
    logger.info("request %s", text, extra=fields)
