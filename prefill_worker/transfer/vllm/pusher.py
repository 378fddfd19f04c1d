"""vLLM's push mode, the WRITE: a matched registration's staged blocks written into the
decode's own blocks from the vLLM backend's agent, the agent the decode registered with.

For each decode engine (and vLLM version) this worker first does what vLLM's prefill does
before its first WRITE: a handshake with the decode's side channel (``decode_host``,
``decode_port``: ``get_meta_msg`` for pp rank 0, tp rank 0), which must answer our own
compatibility hash for that version in push mode, then its ``NixlAgentMetadata`` (LBHNC, our
block size, one region per layer of our block's bytes, one KV-cache group), its agent loaded
and its blocks prepared as one descriptor list. That runs on the ``vllm-push-link`` thread (a
dead decode costs its 5 s timeout there, never the engine's). Then one WRITE per request,
posted and waited for on the ``vllm-push-write`` thread: one descriptor per block per layer
(``block_size × kv_heads × 2 × head_dim × itemsize`` bytes each, the pull's READ in the
other direction), with the notification ``"<decode request id>:1"`` that ends the decode's
wait. The source is the staging region, which the forward filled as for a pull (docs/vllm.md,
"vLLM's push mode", says why not the pool).

A decode that registered fewer blocks than we staged had the rest in its prefix cache: as
vLLM's prefill does, the WRITE sends our last blocks into them. Every path frees the
request's staging blocks: the WRITE settled (done or failed), the handshake refused, the
registration unusable, ``close``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import zmq

from prefill_worker.lograte import RateLimitedLog
from prefill_worker.transfer.nixl.agent import NIXL_ERRORS
from prefill_worker.transfer.vllm.handshake import GET_META_MSG, HandshakePayload
from prefill_worker.transfer.vllm.profiles import (
    PROFILES,
    NixlAgentMetadata,
    NixlAgentMetadataV15,
    NixlAgentMetadataV16,
)
from prefill_worker.transfer.vllm.push import Registration
from prefill_worker.transfer.vllm.staging import StagingLayout

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_MS = 5000  # vLLM's own receive timeout on a side channel
WRITE_TIMEOUT_S = 60.0  # a WRITE not settled by then is given up (its blocks freed)
_LOG_S = 10.0


class LinkRefused(Exception):
    """A decode this worker will not write to, with the reason."""


@dataclass(slots=True)
class DecodeLink:
    """A decode's agent loaded on ours and its blocks prepared: block ``b`` of layer ``l`` is
    entry ``l * num_blocks + b``."""

    agent_name: str
    remote: Any  # nixl prepped descriptor list
    num_blocks: int


@dataclass(frozen=True, slots=True)
class PushJob:
    """One request's WRITE: our staged ``blocks``, the decode's registration."""

    hold_id: str
    blocks: tuple[int, ...]
    registration: Registration
    version: str


@dataclass(slots=True)
class PushCounts:
    pushed: int = 0  # requests written
    pushed_bytes: int = 0
    write_s: float = 0.0  # the WRITEs' time, posted to settled, all of them
    failed: Counter[str] = field(default_factory=Counter)  # why -> requests not written


def fetch_payload(host: str, port: int, timeout_ms: int = HANDSHAKE_TIMEOUT_MS) -> bytes:
    """The first frame of a decode's side channel's answer to ``get_meta_msg`` (rank 0, 0)."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.setsockopt(zmq.MAXMSGSIZE, 16 << 20)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send(msgspec.msgpack.encode((GET_META_MSG, 0, 0)))
        parts = sock.recv_multipart()
    except zmq.ZMQError as exc:
        raise LinkRefused(f"handshake with {host}:{port} failed: {exc}") from None
    finally:
        sock.close(linger=0)
    if len(parts) != 2:
        raise LinkRefused(f"handshake answer of {len(parts)} frames, not 2")
    return parts[0]


def check_metadata(
    payload: bytes, expected_hash: str, version: str, engine_id: str, layout: StagingLayout
) -> NixlAgentMetadata:
    """The decode's metadata, once its hash is ours and its blocks are ours in shape."""
    try:
        answer = msgspec.msgpack.decode(payload, type=HandshakePayload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise LinkRefused(f"not vLLM's handshake payload: {exc}") from None
    if answer.compatibility_hash != expected_hash:
        raise LinkRefused(
            f"compatibility hash mismatch: the decode's {answer.compatibility_hash[:16]}, "
            f"ours for vLLM {version} push {expected_hash[:16]} (another vLLM version, model, "
            "dtype, attention backend, or a decode in pull mode)"
        )
    kind: type[NixlAgentMetadata] = NixlAgentMetadataV15
    if PROFILES[version].names_region_layers:
        kind = NixlAgentMetadataV16
    try:
        meta: NixlAgentMetadata = msgspec.msgpack.decode(answer.agent_metadata_bytes, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise LinkRefused(f"not vLLM {version}'s agent metadata: {exc}") from None
    lay = layout
    why = None
    if meta.engine_id != engine_id:
        why = f"engine id {meta.engine_id!r}, registered as {engine_id!r}"
    elif meta.kv_cache_layout != "LBHNC" or meta.block_size != lay.block_size:
        why = f"layout {meta.kv_cache_layout} block {meta.block_size}, ours LBHNC {lay.block_size}"
    elif meta.physical_blocks_per_logical_kv_block != 1:
        why = f"{meta.physical_blocks_per_logical_kv_block} kernel blocks per block"
    elif len(meta.kv_caches_base_addr) != lay.num_layers:
        why = f"{len(meta.kv_caches_base_addr)} regions for our {lay.num_layers} layers"
    elif set(meta.block_lens) != {lay.block_bytes} or len(meta.block_strides) != lay.num_layers:
        why = f"blocks of {sorted(set(meta.block_lens))} bytes, ours {lay.block_bytes}"
    elif meta.num_blocks < 1:
        why = "no blocks"
    if why is not None:
        raise LinkRefused(f"the decode's KV cache is not ours in shape: {why}")
    return meta


class VllmPusher:
    """Links to decodes, and the WRITEs; the engine thread calls ``push`` and ``poll``."""

    def __init__(
        self,
        agent: Any,
        region_base_addrs: Sequence[int],
        layout: StagingLayout,
        hashes: Mapping[str, str],  # version -> our push-mode compatibility hash
        free: Callable[[Sequence[int]], None],
        clock: Callable[[], float],
    ) -> None:
        self._agent, self._layout, self._hashes = agent, layout, hashes
        self._free, self._clock = free, clock
        lay = layout
        rows = [
            (base + b * lay.block_bytes, lay.block_bytes, 0)
            for base in region_base_addrs
            for b in range(lay.num_blocks)
        ]
        self._local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.array(rows, np.uint64), "DRAM")
        self._links: dict[tuple[str, str], DecodeLink] = {}
        self._linking: dict[tuple[str, str], tuple[Future[DecodeLink], list[PushJob]]] = {}
        self._writes: list[tuple[Future[str], PushJob, tuple[str, str]]] = []
        self._link_pool = ThreadPoolExecutor(1, thread_name_prefix="vllm-push-link")
        self._write_pool = ThreadPoolExecutor(1, thread_name_prefix="vllm-push-write")
        self.counts = PushCounts()
        self._log = RateLimitedLog(log, _LOG_S)

    @property
    def busy(self) -> bool:
        return bool(self._linking or self._writes)

    @property
    def num_blocks_owned(self) -> int:
        jobs = [j for _, js in self._linking.values() for j in js] + [j for _, j, _ in self._writes]
        return sum(len(j.blocks) for j in jobs)

    def push(self, job: PushJob) -> None:
        """Write ``job`` once its decode is linked (now, or after its handshake)."""
        reg = job.registration
        if reg.decode_tp_size != 1:
            return self._fail(job, "decode_tp", f"a decode of TP {reg.decode_tp_size}")
        key = (reg.decode_engine_id, job.version)
        link = self._links.get(key)
        if link is not None:
            return self._write(job, link, key)
        pending = self._linking.get(key)
        if pending is not None:
            pending[1].append(job)
            return None
        future = self._link_pool.submit(self._link, reg, job.version)
        self._linking[key] = (future, [job])
        return None

    def poll(self) -> None:
        """Links made (their jobs written) or refused (their blocks freed); WRITEs settled."""
        for key, (future, jobs) in list(self._linking.items()):
            if not future.done():
                continue
            del self._linking[key]
            try:
                link = future.result()
            except LinkRefused as exc:
                for job in jobs:
                    self._fail(job, "handshake", str(exc))
                continue
            self._links[key] = link
            for job in jobs:
                self._write(job, link, key)
        still = []
        for written, job, key in self._writes:
            if not written.done():
                still.append((written, job, key))
                continue
            state = written.result()
            if state == "DONE":
                self.counts.pushed += 1
                self.counts.pushed_bytes += (
                    len(job.blocks) * self._layout.num_layers * (self._layout.block_bytes)
                )
                self._free(job.blocks)
            else:
                self._drop_link(key)  # the decode may be gone: the next one handshakes anew
                self._fail(job, "write", state)
        self._writes = still

    def close(self) -> None:
        """Waits for the WRITEs in flight (nothing frees blocks a WRITE reads), then frees
        every block this side owns and forgets the decodes."""
        self._link_pool.shutdown(wait=True, cancel_futures=True)
        self._write_pool.shutdown(wait=True)
        for _, jobs in self._linking.values():
            for job in jobs:
                self._free(job.blocks)
        for _, job, _ in self._writes:
            self._free(job.blocks)
        self._linking.clear()
        self._writes.clear()
        for key in list(self._links):
            self._drop_link(key)
        self._local.release()

    # -- internals ----------------------------------------------------------------------

    def _fail(self, job: PushJob, why: str, detail: str) -> None:
        self.counts.failed[why] += 1
        self._free(job.blocks)
        self._log.warning(self._clock(), "vllm push of %s failed: %s", job.hold_id, detail)

    def _link(self, reg: Registration, version: str) -> DecodeLink:
        """On the link thread: the decode's handshake, checked, its agent and blocks loaded."""
        payload = fetch_payload(reg.decode_host, reg.decode_port)
        meta = check_metadata(
            payload, self._hashes[version], version, reg.decode_engine_id, self._layout
        )
        try:
            name = self._agent.add_remote_agent(meta.agent_metadata)
        except NIXL_ERRORS as exc:
            raise LinkRefused(f"its agent metadata did not load: {exc}") from None
        num_blocks = meta.num_blocks
        mem = (meta.region_mem_types or ["DRAM"])[0]
        rows = [
            (base + b * stride, length, meta.device_id)
            for base, stride, length in zip(
                meta.kv_caches_base_addr, meta.block_strides, meta.block_lens, strict=True
            )
            for b in range(num_blocks)
        ]
        try:
            remote = self._agent.prep_xfer_dlist(name, np.array(rows, np.uint64), mem)
        except NIXL_ERRORS as exc:
            self._agent.remove_remote_agent(name)
            raise LinkRefused(f"its blocks could not be described: {exc}") from None
        return DecodeLink(name, remote, num_blocks)

    def _write(self, job: PushJob, link: DecodeLink, key: tuple[str, str]) -> None:
        theirs = job.registration.block_ids()
        ours = job.blocks
        if not theirs or len(theirs) > len(ours):
            why = f"the decode registered {len(theirs)} blocks for our {len(ours)}"
            return self._fail(job, "blocks", why)
        if max(theirs) >= link.num_blocks:
            return self._fail(job, "blocks", f"block {max(theirs)} of {link.num_blocks}")
        ours = ours[len(ours) - len(theirs) :]  # the decode had the first ones cached
        n, lay = link.num_blocks, self._layout
        local = [layer * lay.num_blocks + b for layer in range(lay.num_layers) for b in ours]
        remote = [layer * n + b for layer in range(lay.num_layers) for b in theirs]
        notif = f"{job.registration.request_id}:1".encode()
        future = self._write_pool.submit(self._post, link.remote, local, remote, notif)
        self._writes.append((future, job, key))
        return None

    def _post(self, remote: Any, local: list[int], ridx: list[int], notif: bytes) -> str:
        """On the write thread: the WRITE, waited for; "DONE" or why not."""
        start = time.perf_counter()
        try:
            return self._post_and_wait(remote, local, ridx, notif)
        finally:
            self.counts.write_s += time.perf_counter() - start

    def _post_and_wait(self, remote: Any, local: list[int], ridx: list[int], notif: bytes) -> str:
        agent = self._agent
        try:
            handle = agent.make_prepped_xfer("WRITE", self._local, local, remote, ridx, notif)
        except NIXL_ERRORS as exc:
            return f"ERR (posting: {exc})"
        try:
            state = str(agent.transfer(handle))
            deadline = time.monotonic() + WRITE_TIMEOUT_S
            pause = 0.0001
            while state not in ("DONE", "ERR") and time.monotonic() < deadline:
                time.sleep(pause)  # over cma the copy is done by transfer(); else it runs
                pause = min(pause * 2, 0.002)
                state = str(agent.check_xfer_state(handle))
            return state if state == "DONE" else f"ERR ({state})"
        except NIXL_ERRORS as exc:
            return f"ERR ({exc})"
        finally:
            try:
                agent.release_xfer_handle(handle)
            except NIXL_ERRORS:
                log.warning("vllm push: releasing a WRITE's handle failed")

    def _drop_link(self, key: tuple[str, str]) -> None:
        link = self._links.pop(key, None)
        if link is None:
            return
        try:
            link.remote.release()
            self._agent.remove_remote_agent(link.agent_name)
        except NIXL_ERRORS as exc:
            log.warning("vllm push: forgetting decode %s: %s", key[0], exc)
