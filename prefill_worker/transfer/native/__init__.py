"""The native bootstrap protocol: the bootstrap server (``bootstrap``), what each message does
(``desk``), how statuses and the aux row are written (``dialect``), and the backend that owns
the sockets (``backend``). Imports NIXL and ZMQ: only ``transfer.factory`` imports it.
"""
