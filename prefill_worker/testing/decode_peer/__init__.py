"""The reference decode peer: receives a prompt's KV from a worker, then decodes greedily.

A test and demo tool, NOT a product decode engine: no sampling beyond greedy, no prefix
cache, no preemption, CPU-friendly batching only. It shows how a decode engine embeds the
decode SDK (``KVReceiver``) and proves the pushed KV is exactly what decoding needs.

Per request (the router chose ``room`` and sent the worker a ``prefill`` with it)::

    expect(room, prompt, max_new_tokens)   pages for prompt + new tokens, an aux row, `want`
    step()  ... DONE                       first token from the aux row
    step()  ... one-token chunks           K/V of the last token into the pages, argmax next
    -> Generation                          pages and aux row freed

It builds the same model code as the worker (``prefill_worker.model.build``) over its own KV
pool. In-process use: ``DecodePeer.load(...)`` then ``generate(...)`` or ``expect``/``step``.
As a process (``python -m prefill_worker.testing.decode_peer`` runs this package's
``__main__``; the control socket, its client and the command line are in ``peer_control.py``,
which imports this module, never the other way) it serves ``generate`` requests on a small ZMQ
control socket (``DecodePeerClient``), sends sd_notify READY=1 once registered with the worker,
and exits 0 on SIGTERM.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from prefill_worker.batch import BatchPlan, ChunkPlan, ModelRunner
from prefill_worker.kv.aux import AuxPool, AuxRow
from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.kv.pages import PagePool
from prefill_worker.request import SamplingParams
from prefill_worker.transfer.decode.receiver import KVReceiver
from prefill_worker.transfer.decode.rooms import RoomState, RoomStatus

log = logging.getLogger(__name__)
_GREEDY = SamplingParams()


class KVPool(Protocol):
    """What the peer needs of its KV pool (``prefill_worker.model.KVCache`` is one)."""

    @property
    def layout(self) -> KVLayout: ...

    def regions(self, aux_base_addr: int, num_aux_rows: int) -> KVRegions: ...


class KVSource(Protocol):
    """Where a room's KV and first token come from: one prefill worker, as the decode SDK's
    ``KVReceiver`` serves it (native protocol), or SGLang's decode-side transfer code
    (``sglang_peer.SglangSource``, SGLang's protocol)."""

    def want(
        self, room: int, page_ids: Sequence[int], aux_slot: int, num_cached_tokens: int
    ) -> None: ...

    def progress(self) -> None: ...

    def poll(self, room: int) -> RoomStatus: ...

    def read_aux(self, aux_slot: int) -> AuxRow: ...

    def forget(self, room: int) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Generation:
    """One finished request: the tokens after the prompt (first token included)."""

    room: int
    is_ok: bool
    token_ids: tuple[int, ...]
    error: str | None = None
    kv_wait_s: float = 0.0  # expect() until the KV and first token had landed
    decode_s: float = 0.0  # from then until the last token
    num_cached_tokens: int = 0  # prompt tokens the prefill's prefix cache supplied (its aux row)


@dataclass(slots=True)
class _Sequence:
    room: int
    prompt_len: int
    max_new_tokens: int
    receiver: KVSource
    page_ids: list[int] = field(default_factory=list)
    aux_slot: int = -1
    tokens: list[int] = field(default_factory=list)  # generated so far
    expected_at: float = 0.0
    landed_at: float = 0.0
    num_cached_tokens: int = 0


class DecodePeer:
    """A KV pool, a ``KVReceiver`` over it, a page allocator and a greedy decode loop.

    ``connect`` (bootstrap address -> ``KVSource``) replaces the native receivers: then a
    request may name any prefill (``expect(..., source)``), connected on first use, as an
    SGLang decode bootstraps each room from the prefill the router named."""

    def __init__(
        self,
        runner: ModelRunner,
        kv_cache: KVPool,
        bootstrap_addr: str | Sequence[str],
        *,
        num_aux_rows: int = 64,
        max_batch_size: int = 16,
        stop_token_ids: Sequence[int] = (),
        peer_timeout_s: float = 10.0,
        registration_timeout_s: float = 60.0,
        connect: Callable[[str], KVSource] | None = None,
    ) -> None:
        self.runner = runner
        self.kv_cache = kv_cache  # keeps the registered pool alive as long as the receiver
        self.page_size: int = kv_cache.layout.page_size
        self.max_batch_size = max_batch_size
        self.stop_token_ids = frozenset(stop_token_ids)
        self.pages = PagePool(kv_cache.layout.num_pages)
        self.aux = AuxPool(num_aux_rows)
        regions = kv_cache.regions(self.aux.base_addr, self.aux.num_rows)
        addrs = [bootstrap_addr] if isinstance(bootstrap_addr, str) else list(bootstrap_addr)
        # One receiver per worker, over the one pool: a router may pick any of them per request.
        self.receivers: dict[str, KVSource] = {}
        if connect is None:
            for addr in addrs:
                receiver = KVReceiver(regions, addr, peer_timeout_s=peer_timeout_s)
                receiver.wait_registered(registration_timeout_s)
                self.receivers[addr] = receiver
        else:
            self.receivers = {addr: connect(addr) for addr in addrs}
        self._connect = connect
        self.receiver = self.receivers[addrs[0]] if addrs else None
        self._queued: collections.deque[_Sequence] = collections.deque()  # waiting for space
        self._landing: dict[int, _Sequence] = {}  # room -> wanted, KV not landed yet
        self._decoding: dict[int, _Sequence] = {}  # room -> generating
        self._is_closed = False

    @classmethod
    def load(
        cls,
        model_path: str,
        bootstrap_addr: str | Sequence[str],
        *,
        dtype: str = "auto",
        device: str = "cpu",
        attention_backend: str = "auto",
        page_size: int = 16,
        num_pages: int = 1024,
        num_threads: int | None = None,
        pool_layout: str | None = None,
        connect_over: Callable[[Any], Callable[[str], KVSource]] | None = None,
        **kwargs: Any,
    ) -> DecodePeer:
        """Build the model (its own KV pool) and connect to the worker's bootstrap server.
        ``stop_token_ids`` defaults to the checkpoint's EOS ids. ``pool_layout`` defaults to
        the (first) worker's, asked with ``describe_worker``; layer-major when the KV comes
        over SGLang's protocol (``connect_over``), whose decodes keep per-layer buffers.
        ``connect_over(kv_cache)``, if given, makes the ``connect`` of the KV sources that
        fill that pool."""
        from prefill_worker.model import build
        from prefill_worker.transfer import describe_worker

        if pool_layout is None and connect_over is not None:
            pool_layout = "layer_major"
        if pool_layout is None:
            first = bootstrap_addr if isinstance(bootstrap_addr, str) else bootstrap_addr[0]
            pool_layout = describe_worker(first, 60.0).kind
        runner, kv_cache, info = build(
            model_path,
            dtype=dtype,
            device=device,
            attention_backend=attention_backend,
            page_size=page_size,
            pool_layout=pool_layout,
            num_pages=num_pages,
            num_threads=num_threads,
        )
        kwargs.setdefault("stop_token_ids", info.eos_token_ids)
        if connect_over is not None:
            kwargs["connect"] = connect_over(kv_cache)
        return cls(runner, kv_cache, bootstrap_addr, **kwargs)

    @property
    def is_decoding(self) -> bool:
        """A ``step()`` now would compute (so a caller should not sleep)."""
        return bool(self._decoding)

    @property
    def is_idle(self) -> bool:
        return not (self._queued or self._landing or self._decoding)

    def expect(
        self, room: int, prompt_ids: Sequence[int], max_new_tokens: int, source: str | None = None
    ) -> None:
        """Take a request: it is wanted from the worker as soon as pages and a row are free.
        ``source`` is that worker's bootstrap address (None: the first one given)."""
        assert max_new_tokens >= 1
        if source is not None and source not in self.receivers and self._connect is not None:
            self.receivers[source] = self._connect(source)
        receiver = self.receiver if source is None else self.receivers[source]
        assert receiver is not None, "no prefill named and none given at start"
        seq = _Sequence(
            room, len(prompt_ids), max_new_tokens, receiver, expected_at=time.monotonic()
        )
        self._queued.append(seq)
        self._admit()

    def step(self) -> list[Generation]:
        """Drive the receivers, start what landed, run one decode batch; what finished."""
        for receiver in self.receivers.values():
            receiver.progress()
        finished = self._collect_landed()
        batch = list(self._decoding.values())[: self.max_batch_size]
        if batch:
            plan = BatchPlan(0, tuple(self._decode_chunk(seq) for seq in batch))
            for seq, sampled in zip(batch, self.runner.run(plan).sampled, strict=True):
                seq.tokens.append(sampled.token_id)
                if self._is_complete(seq):
                    finished.append(self._finish(self._decoding.pop(seq.room)))
        self._admit()
        return finished

    def generate(
        self, prompts: Mapping[int, Sequence[int]], max_new_tokens: int, timeout_s: float = 60.0
    ) -> dict[int, Generation]:
        """Blocking: ``expect`` every ``room -> prompt``, step until all have finished."""
        for room, ids in prompts.items():
            self.expect(room, ids, max_new_tokens)
        done: dict[int, Generation] = {}
        deadline = time.monotonic() + timeout_s
        while len(done) < len(prompts):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rooms {sorted(set(prompts) - set(done))} did not finish")
            done.update((g.room, g) for g in self.step())
            if not self.is_decoding:
                time.sleep(0.001)  # nothing to compute: wait for the worker's writes
        return done

    def close(self) -> None:
        """Say goodbye to the worker and release the receiver; idempotent."""
        if not self._is_closed:
            self._is_closed = True
            for receiver in self.receivers.values():
                receiver.close()

    # -- internals ----------------------------------------------------------------------

    def _admit(self) -> None:
        while self._queued:
            seq = self._queued[0]
            num_pages = -(-(seq.prompt_len + seq.max_new_tokens) // self.page_size)
            page_ids = self.pages.try_alloc(num_pages)
            if page_ids is None:
                return
            slot = self.aux.try_alloc()
            if slot is None:
                self.pages.free(page_ids)
                return
            self._queued.popleft()
            seq.page_ids, seq.aux_slot = page_ids, slot
            num_prompt_pages = -(-seq.prompt_len // self.page_size)
            seq.receiver.want(seq.room, page_ids[:num_prompt_pages], slot, 0)
            self._landing[seq.room] = seq

    def _collect_landed(self) -> list[Generation]:
        finished = []
        for room, seq in list(self._landing.items()):
            status = seq.receiver.poll(room)
            if status.state is RoomState.PENDING:
                continue
            del self._landing[room]
            seq.landed_at = time.monotonic()
            if status.state is not RoomState.DONE:
                finished.append(self._finish(seq, f"{status.state.value}: {status.reason}"))
                continue
            row = seq.receiver.read_aux(seq.aux_slot)
            seq.tokens.append(row.first_token_id)
            # A native row reports the prefix-cache hit through num_computed_tokens; SGLang's
            # row carries it as its cached_tokens (num_cached_tokens here), as SGLang reports.
            hit = row.num_prefix_hit_tokens
            seq.num_cached_tokens = row.num_cached_tokens if hit is None else hit
            if self._is_complete(seq):
                finished.append(self._finish(seq))
            else:
                self._decoding[room] = seq
        return finished

    def _decode_chunk(self, seq: _Sequence) -> ChunkPlan:
        """The newest token's K/V is not in the pages yet: it is the one-token chunk."""
        position = seq.prompt_len + len(seq.tokens) - 1
        return ChunkPlan(
            str(seq.room), (seq.tokens[-1],), position, position + 1, seq.page_ids, _GREEDY
        )

    def _is_complete(self, seq: _Sequence) -> bool:
        return len(seq.tokens) >= seq.max_new_tokens or seq.tokens[-1] in self.stop_token_ids

    def _finish(self, seq: _Sequence, error: str | None = None) -> Generation:
        seq.receiver.forget(seq.room)
        self.pages.free(seq.page_ids)
        self.aux.free(seq.aux_slot)
        now = time.monotonic()
        return Generation(
            seq.room,
            error is None,
            tuple(seq.tokens),
            error,
            kv_wait_s=seq.landed_at - seq.expected_at,
            decode_s=now - seq.landed_at,
            num_cached_tokens=seq.num_cached_tokens,
        )
