"""Ask a worker what its KV pool looks like, before building a pool to register with it.

One ``describe`` over a short-lived DEALER on the bootstrap address, answered by
``described`` (no registration needed; with CURVE on, only an allow-listed key gets an
answer): the worker's layout (layers, KV heads, head dim, dtype, page size, pool layout
kind, and its own page count, which a decode's need not match). For an MLA model the kind is
``mla``: one latent per token and layer, ``num_kv_heads`` 1 and ``head_dim`` the latent width
(``kv_lora_rank + qk_rope_head_dim``), the shape a decode's per-layer latent tensors take.
The same layout is in the worker's ``GET /readyz`` as ``kv_layout``. A hybrid model's
worker also names the state components a decode must register beside its KV pool
(``describe_state``: kind, layers, each tensor's item shape and dtype).
"""

from __future__ import annotations

import msgspec
import zmq

from prefill_worker.curve import CurveClientKeys, apply_client
from prefill_worker.kv.layout import KVLayout
from prefill_worker.kv.state_layout import StateComponent
from prefill_worker.transfer import wire


def describe_worker(
    bootstrap_addr: str, timeout_s: float = 10.0, *, curve: CurveClientKeys | None = None
) -> KVLayout:
    """The worker's pool layout; ``TimeoutError`` when it does not answer in ``timeout_s``
    (an older worker answers ``reject``: ``RuntimeError`` naming it)."""
    return _described(bootstrap_addr, timeout_s, curve).layout.to_kv()


def describe_state(
    bootstrap_addr: str, timeout_s: float = 10.0, *, curve: CurveClientKeys | None = None
) -> tuple[StateComponent, ...]:
    """The worker's state components (``num_items``: its own slots, which a decode's need not
    match); () for a model without state. Errors as ``describe_worker``."""
    state = _described(bootstrap_addr, timeout_s, curve).state
    return () if isinstance(state, msgspec.UnsetType) else tuple(p.component for p in state)


def _described(
    bootstrap_addr: str, timeout_s: float, curve: CurveClientKeys | None
) -> wire.Described:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if curve is not None:
            apply_client(sock, curve)
        sock.connect(bootstrap_addr)
        sock.send(wire.encode(wire.Describe()))
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no answer to describe from {bootstrap_addr} in {timeout_s:g} s")
        match wire.decode(sock.recv()):
            case wire.Described() as described:
                return described
            case other:
                raise RuntimeError(f"the worker at {bootstrap_addr} answered {other!r}")
    finally:
        sock.close(linger=0)
        ctx.term()
