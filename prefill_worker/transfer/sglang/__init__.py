"""SGLang's PD protocol only, as far as SGLang decode servers can tell
(``transfer.protocol: sglang``; docs/sglang.md): the control frames (``frames``), what is
accepted (``accept``), SGLang's metadata buffers mirrored (``aux``), the bootstrap routes
(``bootstrap_http``), the control sockets (``control``), what each message does (``desk``),
how statuses and the aux row are written (``dialect``), this worker's NIXL side (``local``)
and the backend that owns the sockets (``backend``). Imports NIXL and ZMQ: only
``transfer.factory`` imports it, at start-up.
"""
