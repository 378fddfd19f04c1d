"""Kept for the decode SDK's import until it reads ``notif_tag`` from ``transfer.wire``."""

from prefill_worker.transfer.wire import notif_tag

__all__ = ["notif_tag"]
