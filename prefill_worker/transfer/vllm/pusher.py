"""vLLM's push mode, the WRITE: a matched registration's staged blocks written into the
decode's own blocks from the vLLM backend's agent, the agent the decode registered with.

For each decode engine (and vLLM version) this worker first links to it as vLLM's prefill
does before its first WRITE (``link.py``: every rank's handshake, hash and metadata checked,
its agent loaded and its blocks prepared), on the ``vllm-push-link`` thread (a dead decode
costs its 5 s timeout there, never the engine's). Then per request one WRITE per decode rank,
posted and waited for on the ``vllm-push-write`` thread: one descriptor per block per layer
(the whole block at decode TP 1, the pull's READ in the other direction; the rank's head
slice at TP d > 1), each with the notification ``"<decode request id>:1"`` that ends that
rank's wait (vLLM's decode counts one per producer rank: this worker is one). The source is
whichever regions the backend registered: the staging region, which the forward filled as
for a pull, or a ``vllm_blocks`` pool's own pages (``direct``; docs/vllm.md, "vLLM's push
mode", says why each, and why this agent rather than the push engine's).

A decode that registered fewer blocks than we staged had the rest in its prefix cache: as
vLLM's prefill does, the WRITE sends our last blocks into them. Every path frees the
request's staging blocks: the WRITEs settled (done or failed), the handshake refused, the
registration unusable, ``close`` (a ``vllm_blocks`` pool's pages: unpins them).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from prefill_worker.lograte import RateLimitedLog
from prefill_worker.transfer.nixl.agent import NIXL_ERRORS
from prefill_worker.transfer.vllm.link import (
    DecodeLink,
    LinkRefused,
    forget,
    link_decode,
    local_slices,
    tp_refusal,
)
from prefill_worker.transfer.vllm.push import Registration
from prefill_worker.transfer.vllm.staging import StagingLayout

log = logging.getLogger(__name__)

WRITE_TIMEOUT_S = 60.0  # a WRITE not settled by then is given up (its blocks freed)
_LOG_S = 10.0
_Key = tuple[str, str, int]  # a link: the decode engine, the vLLM version, the decode's TP


@dataclass(frozen=True, slots=True)
class PushJob:
    """One request's WRITE: our staged ``blocks``, the decode's registration."""

    hold_id: str
    blocks: tuple[int, ...]
    registration: Registration
    version: str


@dataclass(frozen=True, slots=True)
class RankWrite:
    """One decode rank's part of a request's WRITE: our list and entries, its list and
    entries."""

    local: Any
    local_idx: list[int]
    remote: Any
    remote_idx: list[int]


@dataclass(slots=True)
class PushCounts:
    pushed: int = 0  # requests written
    pushed_bytes: int = 0
    write_s: float = 0.0  # the WRITEs' time, posted to settled, all of them
    failed: Counter[str] = field(default_factory=Counter)  # why -> requests not written


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
        self._bases = tuple(region_base_addrs)
        table = local_slices(self._bases, layout, 1)  # whole blocks: entry l * num_blocks + b
        self._local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", table, "DRAM")
        self._links: dict[_Key, DecodeLink] = {}
        self._linking: dict[_Key, tuple[Future[DecodeLink], list[PushJob]]] = {}
        self._writes: list[tuple[Future[str], PushJob, _Key]] = []
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
        why = tp_refusal(reg.decode_tp_size, self._layout.num_kv_heads)
        if why is not None:
            return self._fail(job, "decode_tp", why)
        # a decode engine restarted at another TP is another link (its ranks, its slices)
        key = (reg.decode_engine_id, job.version, reg.decode_tp_size)
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
        """On the link thread: the decode's ranks handshaken, checked and loaded."""
        return link_decode(
            self._agent, self._bases, self._layout, self._hashes[version], reg, version
        )

    def _write(self, job: PushJob, link: DecodeLink, key: _Key) -> None:
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
        if link.local is None:  # TP 1: whole blocks
            writes = [RankWrite(self._local, local, link.remotes[0], remote)]
        else:  # rank r: its slices, entries r * num_layers * num_blocks further on
            step = lay.num_layers * lay.num_blocks
            writes = [
                RankWrite(link.local, [i + r * step for i in local], theirs_r, remote)
                for r, theirs_r in enumerate(link.remotes)
            ]
        notif = f"{job.registration.request_id}:1".encode()
        future = self._write_pool.submit(self._post, writes, notif)
        self._writes.append((future, job, key))
        return None

    def _post(self, writes: list[RankWrite], notif: bytes) -> str:
        """On the write thread: every rank's WRITE posted, then waited for; "DONE" or why
        not."""
        start = time.perf_counter()
        handles: list[Any] = []
        try:
            return self._post_and_wait(writes, notif, handles)
        finally:
            for handle in handles:
                try:
                    self._agent.release_xfer_handle(handle)
                except NIXL_ERRORS:
                    log.warning("vllm push: releasing a WRITE's handle failed")
            self.counts.write_s += time.perf_counter() - start

    def _post_and_wait(self, writes: list[RankWrite], notif: bytes, handles: list[Any]) -> str:
        agent = self._agent
        states = []
        for w in writes:
            try:
                handle = agent.make_prepped_xfer(
                    "WRITE", w.local, w.local_idx, w.remote, w.remote_idx, notif
                )
            except NIXL_ERRORS as exc:
                return f"ERR (posting: {exc})"
            handles.append(handle)
            try:
                states.append(str(agent.transfer(handle)))  # over cma: the copy, here
            except NIXL_ERRORS as exc:
                return f"ERR ({exc})"
        deadline = time.monotonic() + WRITE_TIMEOUT_S
        pause = 0.0001
        try:
            while time.monotonic() < deadline:
                if "ERR" in states:
                    return "ERR (ERR)"
                if all(state == "DONE" for state in states):
                    return "DONE"
                time.sleep(pause)
                pause = min(pause * 2, 0.002)
                states = [
                    state if state == "DONE" else str(agent.check_xfer_state(handle))
                    for state, handle in zip(states, handles, strict=True)
                ]
        except NIXL_ERRORS as exc:
            return f"ERR ({exc})"
        return f"ERR ({states})"

    def _drop_link(self, key: _Key) -> None:
        link = self._links.pop(key, None)
        if link is None:
            return
        try:
            forget(self._agent, link)
        except NIXL_ERRORS as exc:
            log.warning("vllm push: forgetting decode %s: %s", key[0], exc)
