"""The child side of ``vllm_decode``: vLLM 0.33's own ``NixlConnector`` worker half as a
decode (kv_consumer) on the CPU, built as vLLM's model runner builds it but without an
engine. Runs only in the vLLM interop environment (``make vllm-deps``).

One decode per process (vLLM's distributed state is process-global): a ``ModelConfig`` from
a local ``config.json``, ``CacheConfig(block_size)`` with layout ``LBHNC``, a
``ParallelConfig(tensor_parallel_size)`` (``tp_size``, default 1: a decode of TP d is d such
processes, ``tp_rank`` 0..d-1, one ``dist_port``, each holding its ranks' KV heads), a
``KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_consumer",
kv_buffer_device="cpu")``, gloo ``init_distributed_environment(world_size=tp_size)``, per
layer a CPU tensor ``[num_blocks, kv_heads / tp_size, block_size, 2*head_dim]`` (LBHNC,
K‖V per (head, token)) filled with ``fill_byte``, ``register_kv_caches``. Every tick (and
while a command waits) the decode steps as vLLM's worker does once per engine step:
``bind_connector_metadata`` (new pulls, heartbeats when due), ``start_load_kv``, ``get_finished``,
``get_block_ids_with_load_errors``, ``clear_connector_metadata``.

A model with sliding-window layers (gpt-oss, Gemma 3) gets vLLM 0.34's hybrid KV-cache groups
(``vllm_child_groups``): each layer's spec, the groups from vLLM's own planner, a pull's
blocks per group clipped by vLLM's own scheduler half (a sliding group: its window's).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
import vllm.triton_utils as triton_utils
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import (
    NixlBaseConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlConnector,
    NixlPushConnector,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    HeartbeatInfo,
    NixlConnectorMetadata,
    compute_nixl_compatibility_hash,
)
from vllm.distributed.parallel_state import (
    ensure_model_parallel_initialized,
    init_distributed_environment,
)
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)

from prefill_worker.testing.nixl_progress import wake_on_events_only
from tests.interop.vllm_child_groups import SlidingGroups

TICK_S = 0.01  # between commands, one engine step per tick


def vllm_config(spec: dict[str, Any]) -> VllmConfig:
    """The decode's config: ``model_dir`` (a config.json), ``dtype``, ``block_size``."""
    model = ModelConfig(
        model=spec["model_dir"],
        tokenizer=spec["model_dir"],
        skip_tokenizer_init=True,
        dtype=spec.get("dtype", "float32"),
    )
    cache = CacheConfig(
        block_size=spec.get("block_size", 32), cache_dtype=spec.get("cache_dtype", "auto")
    )
    cache.kv_cache_layout = "LBHNC"  # init=False in 0.33: the engine core resolves it
    transfer = KVTransferConfig(
        kv_connector="NixlConnector",
        kv_role="kv_consumer",
        kv_buffer_device="cpu",
        engine_id=spec.get("engine_id", "vllm-decode"),
        kv_connector_extra_config={"transfer_mode": spec.get("transfer_mode", "pull")},
    )
    parallel = ParallelConfig(tensor_parallel_size=spec.get("tp_size", 1))
    with _no_triton_gate():
        return VllmConfig(
            model_config=model,
            cache_config=cache,
            kv_transfer_config=transfer,
            parallel_config=parallel,
        )


@contextlib.contextmanager
def _no_triton_gate() -> Iterator[None]:
    """vLLM 0.34 refuses an x86 CPU config without triton-cpu (its model runner's kernels
    need it); the connector alone runs no kernel, so the check is told Triton is there while
    the config is built (0.33 only warned)."""
    saved = triton_utils.HAS_TRITON
    triton_utils.HAS_TRITON = True
    try:
        yield
    finally:
        triton_utils.HAS_TRITON = saved


def compat_hash(spec: dict[str, Any]) -> str:
    """vLLM's own hash for a config (the decode's attention backend name is an input)."""
    return compute_nixl_compatibility_hash(vllm_config(spec), spec["attn_backend_name"])


@dataclass
class Hold:
    """A request waiting in the decode's queue: heartbeats every ``interval_s``."""

    engine_id: str
    info: HeartbeatInfo
    interval_s: float
    next_at: float = 0.0


@dataclass
class Pull:
    local_block_ids: list[int]  # every block, all groups
    is_finished: bool = False
    by_group: tuple[list[int], ...] = ()  # a sliding-window model's, per KV-cache group


class Decode:
    def __init__(self, spec: dict[str, Any], is_first: bool = True) -> None:
        """``is_first`` False: another decode in this process (``open``), of the first one's
        TP size and rank, sharing its distributed state (vLLM's TP group is the process's);
        its config is current while it is built."""
        self.spec, self.config = spec, vllm_config(spec)
        self.tp_size, tp_rank = int(spec.get("tp_size", 1)), int(spec.get("tp_rank", 0))
        if is_first:
            self._scope = set_current_vllm_config(self.config)
            self._scope.__enter__()  # for the life of the process, as a worker's is
            init_distributed_environment(
                world_size=self.tp_size,
                rank=tp_rank,
                distributed_init_method=f"tcp://127.0.0.1:{spec['dist_port']}",
                local_rank=tp_rank,
                backend="gloo",
            )
            ensure_model_parallel_initialized(self.tp_size, 1)
            self._connect(spec)
            return
        with set_current_vllm_config(self.config):
            self._connect(spec)

    def _connect(self, spec: dict[str, Any]) -> None:
        self.num_blocks = int(spec["num_blocks"])
        self.groups = SlidingGroups.of(self.config)  # None: one group of every layer
        self.caches = self._make_caches(int(spec["fill_byte"]))
        self.is_push = spec.get("transfer_mode", "pull") == "push"
        kind = NixlPushConnector if self.is_push else NixlConnector
        kv_config = self._kv_config()
        self.connector = kind(self.config, KVConnectorRole.WORKER, kv_config)
        if self.groups is not None:
            self.groups.attach(self.config, kv_config)
        self.connector.register_kv_caches(self.caches)
        self.side_channel = ("127.0.0.1", int(spec.get("side_channel_port", 0)))
        # at TP > 1 rank 0 serves every rank's payload once gathered (``serve``), as vLLM's
        # scheduler serves its workers'
        if self.is_push and self.tp_size == 1:
            self.serve_side_channel([self.handshake_payload()])
        self._registrations: dict[str, dict[str, Any]] = {}
        self._free = list(range(self.num_blocks))[::-1]  # handed out high ids first
        self.pulls: dict[str, Pull] = {}
        self.holds: dict[str, Hold] = {}
        self._pending: dict[str, tuple[tuple[list[int], ...], dict[str, Any]]] = {}
        self.load_errors: set[int] = set()

    def handshake_payload(self) -> bytes:
        """This rank's handshake payload, as its worker hands it to vLLM's scheduler."""
        worker = self.connector.connector_worker
        assert worker is not None and worker.xfer_handshake_metadata is not None
        return msgspec.msgpack.Encoder().encode(worker.xfer_handshake_metadata)

    def serve_side_channel(self, payloads: list[bytes]) -> None:
        """A push decode's own side channel, where the prefill fetches its metadata before it
        WRITEs: vLLM's scheduler-side listener, serving each rank's handshake payload (tp
        rank i: ``payloads[i]``; a decode of TP d gathers its ranks' into one listener)."""
        data = {(0, rank): payload for rank, payload in enumerate(payloads)}
        ready, self._stop = threading.Event(), threading.Event()
        host, port = self.side_channel
        listener = threading.Thread(
            target=NixlBaseConnectorScheduler._nixl_handshake_listener,
            args=(data, ready, self._stop, host, port),
            daemon=True,
        )
        listener.start()
        ready.wait()

    def _spec(self) -> FullAttentionSpec:
        model = self.config.model_config
        return FullAttentionSpec(
            block_size=self.config.cache_config.block_size,
            num_kv_heads=model.get_total_num_kv_heads() // self.tp_size,  # this rank's
            head_size=model.get_head_size(),
            dtype=kv_cache_dtype_str_to_dtype(self.config.cache_config.cache_dtype, model),
        )

    def layer_names(self) -> list[str]:
        if self.groups is not None:
            return list(self.groups.specs)
        num_layers = self.config.model_config.get_total_num_hidden_layers()
        return [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]

    def _kv_config(self) -> KVCacheConfig:
        page = self._spec().page_size_bytes
        tensors = [
            KVCacheTensor(page * self.num_blocks, [name], page * self.num_blocks, page)
            for name in self.layer_names()
        ]  # a mamba layer's page is padded to the attention page (``vllm_child_groups``)
        if self.groups is not None:
            groups = self.groups.kv_cache_groups
        else:
            groups = [KVCacheGroupSpec(self.layer_names(), self._spec())]
        return KVCacheConfig(self.num_blocks, tensors, groups, kv_cache_layout="LBHNC")

    def _make_caches(self, fill_byte: int) -> dict[str, torch.Tensor]:
        spec = self._spec()
        shape = (self.num_blocks, spec.num_kv_heads, spec.block_size, 2 * spec.head_size)
        caches = {}
        for name in self.layer_names():
            mamba = None if self.groups is None else self.groups.cache(name, self.num_blocks)
            cache = torch.empty(shape, dtype=spec.dtype) if mamba is None else mamba  # LBHNC
            cache.view(torch.uint8).fill_(fill_byte)
            caches[name] = cache
        return caches

    def info(self) -> dict[str, Any]:
        worker = self.connector.connector_worker
        assert worker is not None
        page = self._spec().page_size_bytes
        return {
            "engine_id": self.config.kv_transfer_config.engine_id,
            "compat_hash": worker.compat_hash,
            "attn_backend_name": worker.backend_name,
            "block_bytes": page,
            "num_blocks": self.num_blocks,
        }

    def pull(self, request_id: str, params: dict[str, Any], num_local: int | None) -> list[int]:
        """Blocks for the request (scattered, from the top), its pull bound on the next step;
        ``num_local=0`` is a full local prefix hit (vLLM only notifies the prefill)."""
        if self.groups is not None and num_local is None:
            by_group = self.groups.allocate(params["remote_num_tokens"], self._free)
            local = [block for group in by_group for block in group]
            self.pulls[request_id] = Pull(local, by_group=by_group)
            self._pending[request_id] = (by_group, params)
            return local
        count = len(params["remote_block_ids"][0]) if num_local is None else num_local
        if count > len(self._free):
            raise ValueError(f"{count} blocks wanted; {len(self._free)} free")
        local = [self._free.pop() for _ in range(count)][::-1]
        self.pulls[request_id] = Pull(local, is_finished=count == 0)
        groups = 1 if self.groups is None else len(self.groups.kv_cache_groups)
        self._pending[request_id] = ((local,) + ([],) * (groups - 1), params)
        return local

    def push(self, request_id: str, params: dict[str, Any], num_local: int | None) -> list[int]:
        """A push decode's request: blocks for the prompt's uncached tokens (``num_local``, or
        the whole prompt), and the registration vLLM's push scheduler stashes for them
        (``update_state_after_alloc``), sent to the prefill on the next step."""
        block = self.config.cache_config.block_size
        count = -(-params["remote_num_tokens"] // block) if num_local is None else num_local
        if count > len(self._free):
            raise ValueError(f"{count} blocks wanted; {len(self._free)} free")
        local = [self._free.pop() for _ in range(count)][::-1]
        self.pulls[request_id] = Pull(local)
        host, port = self.side_channel
        self._registrations[request_id] = {
            "request_id": request_id,
            "decode_engine_id": self.config.kv_transfer_config.engine_id,
            "decode_host": host,
            "decode_port": port,
            "decode_tp_size": self.tp_size,
            "local_block_ids": (local,),
            "remote_engine_id": params["remote_engine_id"],
            "remote_host": params["remote_host"],
            "remote_port": params["remote_port"],
            "remote_tp_size": params["tp_size"],
            "remote_pp_size": params.get("pp_size", 1),
        }
        self._pending[request_id] = ((local,), {**params, "remote_block_ids": ()})
        return local

    def hold(self, request_id: str, params: dict[str, Any], interval_s: float) -> None:
        info = HeartbeatInfo(
            req_ids={params["remote_request_id"]},
            host=params["remote_host"],
            port=params["remote_port"],
            tp_size=params.get("tp_size", 1),
        )
        self.holds[request_id] = Hold(params["remote_engine_id"], info, interval_s)

    def step(self) -> None:
        """One engine step of vLLM's worker, as far as the connector sees it."""
        meta = NixlConnectorMetadata()
        for request_id, (local, params) in self._pending.items():
            awaiting = any(local)
            meta.add_new_req_to_recv(request_id, local, params, awaiting_kvs=awaiting)
        self._pending.clear()
        if self._registrations:
            meta.push_registrations = dict(self._registrations)
            self._registrations.clear()
        now = time.monotonic()
        for hold in self.holds.values():
            if now >= hold.next_at:
                meta.heartbeat_by_engine[hold.engine_id] = hold.info
                hold.next_at = now + hold.interval_s
        self.connector.bind_connector_metadata(meta)
        self.connector.start_load_kv(None)  # type: ignore[arg-type]
        _, done_recving = self.connector.get_finished(set())
        self.connector.clear_connector_metadata()
        self.load_errors |= self.connector.get_block_ids_with_load_errors()
        for request_id in done_recving or ():
            self.pulls[request_id].is_finished = True

    def outcome(self, request_id: str) -> dict[str, Any]:
        """What vLLM's scheduler would see: finished, and which blocks failed to load."""
        pull = self.pulls[request_id]
        errors = sorted(self.load_errors & set(pull.local_block_ids))
        return {"finished": pull.is_finished, "load_errors": errors, "blocks": pull.local_block_ids}

    def blocks(self, request_id: str) -> dict[str, np.ndarray]:
        """The request's local blocks per layer (its group's), in its block order, raw bytes."""
        pull = self.pulls[request_id]
        out = {}
        for name, cache in self.caches.items():
            ids = pull.local_block_ids
            if pull.by_group and self.groups is not None:
                ids = pull.by_group[self.groups.group_of[name]]
            index = torch.tensor(ids, dtype=torch.long)
            out[name] = cache.index_select(0, index).contiguous().view(torch.uint8).numpy()
        return out

    def dump(self, request_id: str, path: str) -> None:
        np.savez(Path(path), **self.blocks(request_id))


def _handle(decodes: dict[str, Decode], command: dict[str, Any]) -> dict[str, Any]:
    """``command["decode"]``: which decode of this process (default the first, "main")."""
    op = command["op"]
    if op == "open":  # another decode, its spec the first's with ``spec``'s changes
        name, spec = command["name"], command["spec"]
        if {"tp_rank", "tp_size", "dist_port"} & set(spec):
            raise ValueError("a decode opened beside the first shares its TP rank and group")
        decodes[name] = Decode({**decodes["main"].spec, **spec}, is_first=False)
        return {}
    decode = decodes[command.get("decode", "main")]
    if op == "info":
        return decode.info()
    if op == "pull":
        local = decode.pull(command["request_id"], command["params"], command.get("num_local"))
        return {"blocks": local}
    if op == "push":
        local = decode.push(command["request_id"], command["params"], command.get("num_local"))
        return {"blocks": local}
    if op == "wait":
        return _wait(decode, command["request_id"], float(command.get("deadline_s", 30.0)))
    if op == "dump":
        decode.dump(command["request_id"], command["path"])
        return {}
    if op == "hold":
        decode.hold(command["request_id"], command["params"], float(command["interval_s"]))
        return {}
    if op == "release":
        del decode.holds[command["request_id"]]
        return {}
    if op == "hash":
        return {"compat_hash": compat_hash(command["spec"])}
    if op == "meta":  # a push decode rank's handshake payload, for rank 0's ``serve``
        return {"payload": decode.handshake_payload().hex()}
    if op == "serve":  # rank 0 of a push decode of TP > 1: every rank's payload, one channel
        decode.serve_side_channel([bytes.fromhex(p) for p in command["payloads"]])
        return {}
    if op == "quit":
        return {}
    raise ValueError(f"unknown op {op!r}")


def _wait(decode: Decode, request_id: str, timeout_s: float) -> dict[str, Any]:
    """Steps until vLLM reports the request finished (success or load error), or timeout."""
    deadline = time.monotonic() + timeout_s
    while not decode.pulls[request_id].is_finished and time.monotonic() < deadline:
        decode.step()
        time.sleep(0.005)  # an engine step's pacing; the deadline bounds the wait
    return decode.outcome(request_id)


def main(spec_json: str) -> None:
    """stdout carries one JSON reply per stdin command; vLLM's output goes to stderr. Between
    commands the decode keeps stepping (heartbeats of held requests go out)."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    wake_on_events_only()  # NIXL's progress thread idles at 1 ms polls otherwise (0.3 core)
    decodes = {"main": Decode(json.loads(spec_json))}
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], TICK_S)
        if not ready:
            for decode in decodes.values():
                decode.step()
            continue
        line = sys.stdin.readline()
        if not line:
            break
        command = json.loads(line)
        call = command.pop("call", None)  # echoed: the parent drops late answers
        try:
            reply = {"ok": True, **_handle(decodes, command)}
        except Exception as exc:  # the test reads the error; the child goes on
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        replies.write(json.dumps({**reply, "call": call}) + "\n")
        replies.flush()
        if command["op"] == "quit":
            break
    os._exit(0)  # NIXL's and vLLM's threads: do not wait for them


if __name__ == "__main__":
    main(sys.argv[1])
