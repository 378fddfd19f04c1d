"""The vLLM side channel as the backend starts it: the ZMQ ROUTER where decodes fetch this
worker's NIXL metadata and compatibility hash (vLLM's ``get_meta_msg``). The server, the
hash and the ``NixlAgentMetadata`` encoding are ``handshake.py``'s; this module only hands
it the staging registration (``backend.PullRegistration``)."""

from __future__ import annotations

import importlib

from prefill_worker.transfer.vllm.backend import PullRegistration, SideChannel
from prefill_worker.transfer.vllm.staging import StagingRefused


def serve_side_channel(host: str, port: int, registration: PullRegistration) -> SideChannel:
    """The side channel bound on ``host:port`` (0: a free port), serving ``registration``.
    ``StagingRefused`` when this build has no side channel."""
    try:
        importlib.import_module("prefill_worker.transfer.vllm.handshake")
    except ImportError as exc:
        raise StagingRefused(
            "transfer.protocol vllm: this build has no vLLM side channel "
            "(prefill_worker/transfer/vllm/handshake.py)"
        ) from exc
    raise StagingRefused("transfer.protocol vllm: the side channel is not wired to handshake.py")
