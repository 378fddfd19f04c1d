"""The last step of a worker process (the leader's ``serve`` and a follower rank): after every
component is closed, make the interpreter's own teardown quick.

Python's finalization runs full garbage collections over the whole heap (the torch and model
modules: hundreds of thousands of objects, each visited several times); measured on a loaded
2-core machine, that took 2-3 s between the worker's ``exit 0`` line and the end of its process,
and every restart waited for it. ``gc.freeze`` moves what is alive to a generation the
collector never scans, so those collections find nothing to walk. Nothing else is skipped:
non-daemon threads are still joined, ``atexit`` handlers run (logging's flush among them),
objects are still released by reference count, and native destructors run as before; the
worker's own cleanup (pools whole, peers told, sockets closed) is done before this, by its
closers. Only for a process about to exit: a frozen heap is never collected again.
"""

from __future__ import annotations

import gc


def prepare_exit() -> None:
    """Called once, by a process's main, when it is done and about to return its exit code."""
    gc.freeze()
