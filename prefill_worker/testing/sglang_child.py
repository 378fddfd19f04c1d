"""The child side of ``sglang_decode``: SGLang's decode-side classes, built as an SGLang
decode server builds them, on the CPU. Imported only in the interop environment, by
``sglang_decode``'s child entry and ``sglang_peer``; it imports neither (the fill byte of a
harness decode comes in as an argument).

Per decode (``Decodes.handle({"op": "new", ...})``): ``MHATokenToKVPool`` (per layer, K and
V ``[pages * page_size + page_size, heads, dim]``, page 0 padding), or for ``kind`` ``mla``
``MLATokenToKVPool`` (per layer one latent ``[pages * page_size + page_size, 1, head_dim]``,
and the manager told ``is_mla_backend`` as an MLA decode's is; ``dsa``: ``DSATokenToKVPool``,
that MLA pool with an FP8 index buffer per layer ``[pages, page_size * 132]`` uint8, its
``dsa`` state component registered by ``setup_state_kv_args``), ``MetadataBuffers`` with
SGLang's defaults (the ten buffers), a ``KVArgs`` filled as ``decode.py`` fills it, and a
``NixlKVManager`` in decode mode (it starts SGLang's own listener and heartbeat threads); the
harness's decodes (``Decodes``) then fill their KV pool with a byte no write leaves behind.
Per room: ``NixlKVReceiver(manager, bootstrap_addr, room)``, ``init``, ``send_metadata``.

Version shims (0.5.20-0.5.23), all test-side: state buffers registered as the host memory
they are (``_state_in_host_memory``), a ``ServerArgs`` published as the process's context,
the parallel ranks that a launcher would set overridden (to 0, or to one rank of an
attention-TP group: ``attn_tp``, the process being that rank), and 0.5.20's DP-attention
globals set to one rank. NIXL's progress threads (one per decode's agent) wake on events, not
every millisecond (``nixl_progress``): a process holds many decodes.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from sglang.srt import runtime_context
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.nixl.conn import NixlKVManager, NixlKVReceiver
from sglang.srt.disaggregation.utils import DisaggregationMode, MetadataBuffers
from sglang.srt.layers import dp_attention
from sglang.srt.server_args import ServerArgs

from prefill_worker.testing.nixl_progress import wake_on_events_only
from prefill_worker.testing.sglang_pools import (
    DTYPES,
    dsa_pool,
    kv_pool,
    mamba_pool,
    named,
    swa_pool,
)

_HELD: list[Any] = []
_POLL_NAMES = {
    int(getattr(KVPoll, name)): name
    for name in ("Failed", "Bootstrapping", "WaitingForInput", "Transferring", "Success")
}


def publish(model_path: str, attn_tp: tuple[int, int] = (0, 1)) -> Any:
    """``attn_tp``: (rank, size) of this process in the decode's attention TP group."""
    wake_on_events_only()
    _state_in_host_memory()
    args = ServerArgs(
        model_path=model_path,
        disaggregation_mode="decode",
        disaggregation_transfer_backend="nixl",
        device="cpu",
    )
    runtime_context.publish(args, role="test")
    rank, size = attn_tp
    tp = {} if size == 1 else {"tp_size": size, "moe_tp_size": size, "tp_rank": rank}
    ranks = runtime_context.get_parallel().override(
        attn_tp_rank=rank, attn_tp_size=size, attn_cp_rank=0, attn_dp_rank=0, **tp
    )
    ranks.__enter__()  # for the life of the process, as a launcher's ranks are
    _HELD.append(ranks)  # a collected context manager would restore the old ranks
    if getattr(dp_attention, "_ATTN_DP_SIZE", 0) is None:  # 0.5.20 keeps them in globals
        dp_attention._ATTN_DP_SIZE, dp_attention._ATTN_DP_RANK = 1, 0
    return args


def _state_in_host_memory() -> None:
    """SGLang (0.5.23) registers its state buffers (a hybrid SWA pool's) with NIXL as VRAM
    whatever memory they are in; here they are host tensors, which NIXL on a machine without
    CUDA registers only as DRAM (as SGLang's KV buffers here, named DRAM by ``KVArgs``)."""
    register = NixlKVManager.register_buffer_to_engine

    def in_host_memory(manager: Any) -> None:
        real = manager.agent.register_memory

        def as_dram(addrs: Any, mem_kind: str, *args: Any, **kwargs: Any) -> Any:
            return real(addrs, "DRAM" if mem_kind == "VRAM" else mem_kind, *args, **kwargs)

        manager.agent.register_memory = as_dram
        try:
            register(manager)
        finally:
            manager.agent.register_memory = real

    NixlKVManager.register_buffer_to_engine = in_host_memory


class Decode:
    """One SGLang decode rank: its pools, its manager, its rooms."""

    def __init__(self, spec: dict[str, Any], server_args: Any, engine_rank: int = 0) -> None:
        self.bootstrap = spec["bootstrap"]
        self._engine_rank = engine_rank  # its attention TP rank
        self.page_size = spec["page_size"]
        self.is_mla = spec.get("kind") in ("mla", "dsa")
        self.is_dsa = spec.get("kind") == "dsa"  # its index pages: ``state_indices[0]``
        self._num_layers = spec["num_layers"]
        self.kv_cache_dtype = str(spec.get("kv_cache_dtype", "auto"))  # its --kv-cache-dtype
        # A hybrid SWA pool (``sliding_layers`` given): the full layers' pool, and the
        # sliding layers' in ``swa_pages`` pages of their own, as SGLang's decode builds it
        # for gpt-oss (``SWAKVPool``; its state component registered by ``setup_state_kv_args``).
        self.sliding_layers = list(spec.get("sliding_layers") or [])
        self.window_tokens = spec.get("window_tokens", 0)
        # A hybrid linear-attention model's pool (``linear_layers`` given): the full layers'
        # KV and a ``MambaPool`` of ``mamba_slots`` slots (``sglang_pools.mamba_pool``).
        self.linear_layers = list(spec.get("linear_layers") or [])
        if self.is_dsa:
            self.pool = dsa_pool(spec)
        elif self.sliding_layers:
            self.pool = swa_pool(spec)
        elif self.linear_layers:
            self.pool = mamba_pool(spec)
        else:
            self.pool = kv_pool(spec, self.is_mla)
        # A speculating decode (``draft_layers`` > 0): its draft pool, the target's geometry,
        # and metadata rows whose hidden state is ``spec_hidden_size`` values of ``spec_dtype``.
        num_draft_layers = int(spec.get("draft_layers", 0))
        draft_spec = {**spec, "num_layers": num_draft_layers}
        self.draft_pool = kv_pool(draft_spec, self.is_mla) if num_draft_layers else None
        self.meta = MetadataBuffers(
            spec["num_aux_rows"],
            hidden_size=int(spec.get("spec_hidden_size", 16)),
            hidden_states_dtype=DTYPES[spec.get("spec_dtype", "float32")],
            max_sampling_mask_tokens=16,
        )
        mode = DisaggregationMode.DECODE
        self.manager = NixlKVManager(self._kv_args(), mode, server_args, self.is_mla)
        # Descending, every other page: a scattered map, and page order bugs show.
        self._free_pages = list(range(spec["num_pages"] - 1, 0, -2))
        self._free_pages += list(range(spec["num_pages"] - 2, 0, -2))
        self._next_aux, self._num_aux_rows = 0, spec["num_aux_rows"]
        swa_pages = spec.get("swa_pages", 0)
        self._free_swa = list(range(swa_pages - 1, 0, -2)) + list(range(swa_pages - 2, 0, -2))
        self.rooms: dict[int, tuple[list[int], int, Any]] = {}
        self.swa_rooms: dict[int, list[int]] = {}  # a hybrid SWA pool's window pages
        slots = int(spec.get("mamba_slots", 0))  # scattered, as the pages; slot 0 never named
        self._free_mamba = list(range(slots - 1, 0, -2)) + list(range(slots - 2, 0, -2))
        self.mamba_rooms: dict[int, int] = {}  # a mamba pool's slot per room

    def fill(self, byte: int) -> None:
        """Every byte of the KV pool: what no write leaves behind (a test reads it back)."""
        for _, buf in self._buffers() + self._index_buffers():
            buf.view(torch.uint8).fill_(byte)
        for _, buf in self._mamba_buffers():
            buf.view(torch.uint8).fill_(byte)
        if self.draft_pool is not None:  # a hidden row no write may touch shows it
            self.meta.output_hidden_states.view(torch.uint8).fill_(byte)

    def _buffers(self) -> list[tuple[str, Any]]:
        """("k0", K of layer 0), ... ("v0", ...): the latents as k of an MLA pool; a hybrid
        SWA pool's full layers, then its sliding layers as ("swa_k0", ...); then a draft
        pool's ("dk0", ...)."""
        draft = [] if self.draft_pool is None else named(self.draft_pool, self.is_mla, "d")
        if self.sliding_layers:
            full, swa = self.pool.full_kv_pool, self.pool.swa_kv_pool
            return named(full, False, "") + named(swa, False, "swa_") + draft
        if self.linear_layers:
            return named(self.pool.full_kv_pool, False, "") + draft
        return named(self.pool, self.is_mla, "") + draft

    def _mamba_buffers(self) -> list[tuple[str, Any]]:
        """("conv0", conv state of linear layer 0, ``[slots + 1, conv_dim, kernel - 1]``),
        ..., ("temporal0", ``[slots + 1, v_heads, head_v_dim, head_k_dim]``), ...: a mamba
        pool's, as its decode's kernels read them; none for other pools."""
        if not self.linear_layers:
            return []
        cache = self.pool.mamba_pool.mamba_cache
        conv = [(f"conv{i}", t) for i, t in enumerate(cache.conv[0])]
        return conv + [(f"temporal{i}", t) for i, t in enumerate(cache.temporal)]

    def _index_buffers(self) -> list[tuple[str, Any]]:
        """("ix0", the index buffer of layer 0), ...: a DSA pool's, ``[pages, page bytes]``."""
        if not self.is_dsa:
            return []
        return [(f"ix{i}", buf) for i, buf in enumerate(self.pool.index_k_with_scale_buffer)]

    def _kv_args(self) -> Any:
        args = KVArgs()
        args.engine_rank, args.pp_rank, args.system_dp_rank = self._engine_rank, 0, 0
        args.kv_cache_dtype_str, args.kv_layout = self.kv_cache_dtype, None
        ptrs, lens, item_lens = self.pool.get_contiguous_buf_infos()
        args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = ptrs, lens, item_lens
        num_draft_entries = 0
        if self.draft_pool is not None:  # appended after the target's, as decode.py does
            draft_ptrs, draft_lens, draft_item_lens = self.draft_pool.get_contiguous_buf_infos()
            ptrs, lens = list(ptrs) + draft_ptrs, list(lens) + draft_lens
            item_lens, num_draft_entries = list(item_lens) + draft_item_lens, len(draft_ptrs)
            args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = ptrs, lens, item_lens
        args.kv_data_mem_kinds = ["DRAM"] * len(ptrs)
        args.kv_layer_ids, args.num_draft_entries = [], num_draft_entries
        args.page_size = self.page_size
        args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = self.meta.get_buf_infos()
        for name in (
            "state_types",
            "state_data_ptrs",
            "state_data_lens",
            "state_item_lens",
            "state_dim_per_tensor",
            "state_slice_outer_counts",
            "state_layer_ids",
            "state_conv_shard_groups",
        ):
            setattr(args, name, [])
        args.is_hybrid_mla_backend, args.swa_kv_cache_layout = False, None
        if self.sliding_layers or self.linear_layers or self.is_dsa:  # its state, as SGLang's
            # decode has it
            from sglang.srt.disaggregation.utils import build_kv_layer_ids, setup_state_kv_args

            if not self.is_dsa:  # the full layers' ids (a DSA pool's KV list is every layer)
                args.kv_layer_ids = build_kv_layer_ids(
                    token_to_kv_pool=self.pool,
                    draft_token_to_kv_pool=None,
                    num_draft_entries=0,
                    num_hidden_layers=self._num_layers,
                )
            setup_state_kv_args(args, self.pool, None, total_kv_layers=self._num_layers)
        args.mla_compression_ratios, args.ib_device, args.gpu_id = None, None, 0
        return args

    def identity(self) -> dict[str, Any]:
        """What its frames name it by: agent name and control socket (its ``ip:port``)."""
        manager = self.manager
        return {"agent_name": manager.agent.name, "ip": manager.local_ip, "port": manager.rank_port}

    def want(
        self, room: int, num_tokens: int, prefix_len: int, resolve: str | None = None
    ) -> dict[str, Any]:
        """``resolve``: how the prefill's DP rank is found (``dp_rank``, below); None: 0."""
        if not self.manager.try_ensure_parallel_info(self.bootstrap):
            raise RuntimeError(f"no prefill server info from {self.bootstrap}")
        dp_rank = 0 if resolve is None else self.dp_rank(room, resolve)
        num_pages = -(-num_tokens // self.page_size)
        pages, self._free_pages = self._free_pages[:num_pages], self._free_pages[num_pages:]
        aux_index = self._next_aux % self._num_aux_rows  # rows are reused in turn
        self._next_aux += 1
        receiver = NixlKVReceiver(self.manager, self.bootstrap, room)
        receiver.init(dp_rank)
        sent = np.asarray(pages[prefix_len // self.page_size :], dtype=np.int32)
        swa_pages = self._window_pages(num_tokens, prefix_len)
        state = None if swa_pages is None else [np.asarray(swa_pages, dtype=np.int32)]
        slot = None
        if self.is_dsa:  # the index pages of the tokens after the prefix: the KV pages
            state = [sent]
        if self.linear_layers:  # one slot of its mamba pool (``decode.py``, ``_mamba_payload``)
            slot = self._free_mamba.pop(0)
            state = [np.asarray([slot], dtype=np.int64)]
            self.mamba_rooms[room] = slot
        receiver.send_metadata(sent, aux_index, state, prefix_len)
        self.rooms[room] = (pages, aux_index, receiver)
        self.swa_rooms[room] = swa_pages or []
        reply = {"pages": pages, "aux_index": aux_index, "swa_pages": swa_pages}
        return {**reply, "mamba_slot": slot, "dp_rank": dp_rank}

    def dp_rank(self, room: int, resolve: str) -> int:
        """The prefill DP rank as SGLang's decode finds it: ``room`` by its own
        ``DecodePreallocQueue._resolve_prefill_dp_rank`` (the server info's ``dp_size`` and
        ``follow_bootstrap_room``), ``rank:R`` the same with the router's
        ``disagg_prefill_dp_rank`` R, ``query`` by ``CommonKVReceiver.query_prefill_dp_ranks``
        (repeated, as its pending queue does, until the worker placed the room: 10 s)."""
        from types import SimpleNamespace

        from sglang.srt.disaggregation.common.conn import CommonKVReceiver
        from sglang.srt.disaggregation.decode import DecodePreallocQueue

        if resolve == "query":
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline:
                ranks = CommonKVReceiver.query_prefill_dp_ranks(self.bootstrap, [room])
                if str(room) in ranks:
                    return int(ranks[str(room)])
                time.sleep(0.02)
            raise RuntimeError(f"room {room}: no prefill dp rank from {self.bootstrap}")
        host, _, port = self.bootstrap.rpartition(":")
        named = int(resolve.removeprefix("rank:")) if resolve.startswith("rank:") else None
        req = SimpleNamespace(
            bootstrap_host=host, bootstrap_port=int(port), bootstrap_room=room,
            disagg_prefill_dp_rank=named,
        )  # fmt: skip
        queue = SimpleNamespace(kv_manager=self.manager)
        rank = DecodePreallocQueue._resolve_prefill_dp_rank(queue, req)
        if rank is None:
            raise RuntimeError(f"room {room}: SGLang's decode would query for its dp rank")
        return int(rank)

    def _window_pages(self, num_tokens: int, prefix_len: int) -> list[int] | None:
        """The SWA pool's pages for the window, as SGLang's decode names them
        (``decode.py``, ``_swa_payload``): positions ``[floor_page(max(prefix, seq_len -
        window)), seq_len)``, each given a page of the SWA pool (here scattered, from its
        own free list, as its allocator's translation would give)."""
        if not self.sliding_layers:
            return None
        from sglang.srt.mem_cache.common import kv_to_page_indices, page_align_floor

        size = self.page_size
        start = page_align_floor(max(prefix_len, num_tokens - self.window_tokens), size)
        count = -(-(num_tokens - start) // size)
        pages, self._free_swa = self._free_swa[:count], self._free_swa[count:]
        # The window's token slots in the SWA pool (what the allocator's translation of the
        # request's full-pool slots gives), then SGLang's own page reduction of them.
        positions = torch.arange(start, num_tokens)
        slots = torch.tensor(pages)[(positions - start) // size] * size + positions % size
        return [int(p) for p in kv_to_page_indices(slots, size)]

    def poll(self, room: int) -> dict[str, Any]:
        state = int(self.rooms[room][2].poll())
        reason = None
        if state == KVPoll.Failed:
            with self.manager.failure_lock:
                reason = self.manager.failure_records.get(room)
        return {"state": _POLL_NAMES.get(state, str(state)), "reason": reason}

    def dump(self, room: int, path: str) -> dict[str, Any]:
        pages, aux_index, _ = self.rooms[room]
        arrays: dict[str, np.ndarray] = {}
        for name, buf in self._buffers():
            held = self.swa_rooms[room] if name.startswith("swa_") else pages
            by_page = buf.view(-1, self.page_size, *buf.shape[1:])[held]
            arrays[name] = by_page.contiguous().view(torch.uint8).numpy()
        for name, buf in self._index_buffers():
            arrays[name] = buf[pages].numpy()
        for name, buf in self._mamba_buffers():  # the room's slot, raw
            arrays[name] = buf[self.mamba_rooms[room]].contiguous().view(torch.uint8).numpy()
        row = self.meta.get_buf(aux_index)
        names = ("output_ids", "cached_tokens", "logprob_val", "logprob_idx")
        for name, value in zip(names, row[:4], strict=True):
            arrays[name] = value.numpy()
        arrays["bootstrap_room"] = row[-1].numpy()
        for name, value in zip(("topk_p", "topk_index", "hidden"), row[9:12], strict=True):
            arrays[name] = value.contiguous().view(torch.uint8).numpy()  # raw bytes
        np.savez(path, **arrays)  # type: ignore[arg-type]
        return {}

    def free(self, room: int) -> dict[str, Any]:
        """A concluded room's pages go back (a test sending many rooms)."""
        pages, _, receiver = self.rooms.pop(room)
        self._free_pages += pages
        self._free_swa += self.swa_rooms.pop(room)
        if room in self.mamba_rooms:
            self._free_mamba.append(self.mamba_rooms.pop(room))
        receiver.clear()
        return {}

    def abort(self, room: int) -> dict[str, Any]:
        # Arm the drain-ack tracker as 0.5.20's scheduler does, here before the ABORT so that
        # no ack can come first; from 0.5.22 the receiver arms it again, with a generation.
        self.manager.register_deferred_abort_room(room)
        self.rooms[room][2].abort()
        return {}

    def acked(self, room: int) -> dict[str, Any]:
        """As SGLang's scheduler asks (``_defer_release``): an ABORT_ACK from as many prefill
        ranks as the receiver asked (an MLA decode at a TP-2 prefill: two, its dummy's too)."""
        required = len(self.rooms[room][2].bootstrap_infos or ())
        return {"acked": bool(self.manager.is_abort_release_safe(room, required))}


class Decodes:
    """The decodes of this process, by id; each new one's KV pool filled with ``fill_byte``."""

    def __init__(self, model_path: str, fill_byte: int, attn_tp: tuple[int, int] = (0, 1)) -> None:
        self._server_args = publish(model_path, attn_tp)
        self._engine_rank = attn_tp[0]
        self._fill_byte = fill_byte
        self._decodes: dict[str, Decode] = {}

    def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        command = dict(command)
        op = command.pop("op")
        if op == "quit":
            return {}
        if op == "new":
            decode = Decode(command, self._server_args, self._engine_rank)
            self._decodes[command.pop("id")] = decode
            decode.fill(self._fill_byte)
            return decode.identity()
        decode = self._decodes[command.pop("id")]
        if op == "want":
            resolve = command.get("resolve")
            return decode.want(
                command["room"], command["num_tokens"], command["prefix_len"], resolve
            )
        if op == "poll":
            return decode.poll(command["room"])
        if op == "dump":
            return decode.dump(command["room"], command["path"])
        if op == "abort":
            return decode.abort(command["room"])
        if op == "free":
            return decode.free(command["room"])
        if op == "acked":
            return decode.acked(command["room"])
        raise ValueError(f"unknown op {op!r}")
