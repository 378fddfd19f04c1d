"""The NIXL side of transfer: the agent and its registrations (``agent``), one request's push
(``sender``), what a backend and its senders share (``context``), the backend that owns peers
and drives every sender (``backend``), what each bootstrap message does (``protocol``), and
the write handles NIXL would not release (``reaper``).

Imports NIXL (lazily, in ``agent``) and ZMQ (the bootstrap server): the scheduler never
imports this package; ``transfer.factory`` does, at start-up.
"""
