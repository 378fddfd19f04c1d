"""This worker as an SGLang PD prefill server, as far as SGLang decode servers can tell
(``transfer.protocol: sglang``; ``docs/sglang.md``).

The control frames and their parsing (``frames``); what is accepted (``accept``); SGLang's
metadata buffers mirrored (``aux``); the bootstrap routes (``bootstrap_http``); the control
sockets (``control``); what each message does (``desk``); one request's push (``sender``);
and the backend that owns them all (``backend``). Imports NIXL and ZMQ: only
``transfer.factory`` imports this package, at start-up.
"""
