"""The process's open-file limit, raised to its hard limit at start.

Every peer connection is a file descriptor: routers' and decodes' ZMQ connections, HTTP
clients, and the TCP connections UCX accepts on the NIXL listener. UCX keeps an accepted
connection open until its peer speaks or closes it (a closed one is let go as the agent
progresses: ``nixl.push_thread``), and NIXL 1.5.1 gives no bound on them: ``start_listener_
guard`` shuts down the ones that send nothing within ``transfer.ucx_silent_close_s``
(``nixl.listeners``), and a soft limit left at a distribution's 1024 would still turn a few
hundred clients that do speak into refused decodes. The
hard limit is what an operator allows (systemd's ``LimitNOFILE``, a container's ulimit);
``prefill_worker_process_open_fds`` against ``..._max_fds`` shows how close the process is.
"""

from __future__ import annotations

import logging
import resource
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from prefill_worker.transfer.nixl.listeners import ListenerGuard, SilentConnections

log = logging.getLogger(__name__)


def raise_fd_limit() -> int:
    """Set the soft ``RLIMIT_NOFILE`` to the hard one; the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft >= hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as exc:  # a sandbox that refuses: keep what was given
        log.warning("open-file limit left at %d (hard %d): %s", soft, hard, exc)
        return soft
    return hard


class _SilentConnectionsCollector(Collector):
    def __init__(self, silent: SilentConnections) -> None:
        self._silent = silent

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "prefill_worker_nixl_silent_connections_closed",
            "TCP connections on the NIXL/UCX listeners shut down for sending nothing within "
            "transfer.ucx_silent_close_s",
            value=self._silent.closed,
        )


def start_listener_guard(
    grace_s: float, registry: CollectorRegistry | None = None
) -> ListenerGuard | None:
    """Close the silent connections on this process's UCX listeners (``nixl.listeners``)
    every ``grace_s / 2`` (at most 5 s); None when ``grace_s`` is 0 (off)."""
    if grace_s <= 0:
        return None
    silent = SilentConnections(grace_s)
    if registry is not None:
        registry.register(_SilentConnectionsCollector(silent))
    return ListenerGuard(silent, min(5.0, grace_s / 2)).start()
