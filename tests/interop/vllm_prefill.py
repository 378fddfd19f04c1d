"""A minimal prefill for vLLM decodes, made of ``transfer.vllm.handshake`` (the metadata of the
version ``factors`` name, ``profiles``) and a NIXL-registered CPU region of known bytes: what
proves the decode harness and the handshake end to end without the worker.

Per layer one contiguous region in vLLM's LBHNC layout, ``[num_blocks, kv_heads, block_size,
2*head_dim]`` (K‖V per (head, token)), filled with seeded random bytes; one NIXL agent
(``transfer.nixl.agent.make_agent``, UCX on ``lo``) with the regions registered; the side
channel and the agent's notifications served by one thread (the agent has no progress thread:
this loop drives it, as the worker's loop does).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

from prefill_worker.transfer.nixl.agent import make_agent
from prefill_worker.transfer.vllm.handshake import (
    CompatFactors,
    SideChannel,
    compat_hash,
    encode_payload,
)
from prefill_worker.transfer.vllm.profiles import PROFILES, LayerRegion, agent_metadata


class MinimalPrefill:
    def __init__(
        self,
        engine_id: str,
        factors: CompatFactors,
        num_blocks: int,
        block_size: int,
        seed: int = 0,
        hash_override: str | None = None,
        metadata_version: str | None = None,  # the metadata's fields; None: the hash's version
    ) -> None:
        self.engine_id = engine_id
        shape = (num_blocks, factors.num_kv_heads, block_size, 2 * factors.head_size)
        generator = torch.Generator().manual_seed(seed)
        self.layers = [  # [num_blocks, kv_heads, block_size, 2*head_dim] float32, LBHNC
            torch.randint(
                0, 256, (*shape[:3], shape[3] * 4), dtype=torch.uint8, generator=generator
            ).view(torch.float32)
            for _ in range(factors.num_layers)
        ]
        self.agent = make_agent(f"vllm-prefill-{engine_id}", ["UCX"], "lo")
        block_bytes = self.layers[0][0].numel() * 4
        table = np.array([[t.data_ptr(), t.numel() * 4, 0] for t in self.layers], dtype=np.uint64)
        self.registration = self.agent.register_memory(table, "DRAM")
        regions = [
            LayerRegion(f"model.layers.{i}.self_attn.attn", t.data_ptr(), block_bytes)
            for i, t in enumerate(self.layers)
        ]
        meta = agent_metadata(
            PROFILES[metadata_version or factors.vllm_version],
            engine_id,
            self.agent.get_agent_metadata(),
            regions,
            num_blocks,
            block_size,
            factors.attn_backend_name,
        )
        payload = encode_payload(hash_override or compat_hash(factors), meta)
        self.side = SideChannel("127.0.0.1", 0, {(0, 0): payload})
        self.port = self.side.port
        self.notifs: list[bytes] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="vllm-prefill", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            self.side.serve(timeout_ms=5)
            for messages in self.agent.get_new_notifs().values():
                self.notifs.extend(messages)

    def block_bytes(self, block_ids: list[int]) -> list[np.ndarray]:
        """Per layer, the raw bytes of ``block_ids`` in that order (what a decode should hold)."""
        index = torch.tensor(block_ids, dtype=torch.long)
        return [t.index_select(0, index).view(torch.uint8).numpy() for t in self.layers]

    def kv_transfer_params(
        self, remote_request_id: str, block_ids: list[int], num_tokens: int
    ) -> dict[str, Any]:
        """What a prefill returns and vLLM's proxy copies into the decode request."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [block_ids],
            "remote_engine_id": self.engine_id,
            "remote_request_id": remote_request_id,
            "remote_host": "127.0.0.1",
            "remote_port": self.port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": num_tokens,
            "transfer_mode": "pull",
        }

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.side.close()
        self.agent.deregister_memory(self.registration)
