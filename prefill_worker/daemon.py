"""Composition root: start-up → serve → drain → shutdown. (Built in the daemon issue.)"""

from __future__ import annotations

import logging

from prefill_worker.config import Config

log = logging.getLogger(__name__)


def run_daemon(config: Config) -> int:
    """Until the daemon lands: the configuration loads, and the worker says it cannot serve."""
    logging.basicConfig(level=config.daemon.log_level.upper())
    log.error("serve is not implemented yet; configuration for %s is valid", config.model.path)
    return 1
