"""The process's open-file limit, raised to its hard limit at start.

Every peer connection is a file descriptor: routers' and decodes' ZMQ connections, HTTP
clients, and the TCP connections UCX accepts on the NIXL listener. UCX keeps an accepted
connection open until its peer speaks or closes it (a closed one is let go as the agent
progresses: ``nixl.push_thread``), and NIXL 1.5.1 gives no bound on them, so a soft limit
left at a distribution's 1024 turns a few hundred silent clients into refused decodes. The
hard limit is what an operator allows (systemd's ``LimitNOFILE``, a container's ulimit);
``prefill_worker_process_open_fds`` against ``..._max_fds`` shows how close the process is.
"""

from __future__ import annotations

import logging
import resource

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
