"""vLLM's push mode, the WRITE: a matched registration's blocks written into the decode's
own blocks through the push side's transfer thread, as the native and SGLang pushes write.

The push side has an agent of its own (``backend``: the same regions registered, NIXL's
progress thread off), owned by a ``nixl.push_thread.PushThread``: every NIXL call on it runs
on that thread, which posts, progresses and releases each WRITE as a ticket
(``nixl.poster.Write``) and writes its wake fd when one settles, so the engine sleeps until
then instead of polling. The vLLM backend's own agent (the one whose metadata the side
channels hand out) still receives the decodes' ``PUSH_REG`` and heartbeats and serves the
pulls' READs; a decode takes our WRITE's notification from whichever agent sent it.

For each decode engine (and vLLM version) this worker first links to it as vLLM's prefill
does before its first WRITE (``link.py``: every rank's handshake, hash and metadata checked
on the ``vllm-push-link`` thread, where a dead decode costs its 5 s timeout, never the
engine's; its agent loaded and its blocks prepared on the transfer thread). Then per request
one WRITE per decode rank: one descriptor per block per layer (the whole block at decode
TP 1, the pull's READ in the other direction; the rank's head slice at TP d > 1), each with
the notification ``"<decode request id>:1"`` that ends that rank's wait (vLLM's decode
counts one per producer rank: this worker is one). The source is whichever regions the
backend registered: the staging region, which the forward filled as for a pull, or a
``vllm_blocks`` pool's own pages (``direct``; docs/vllm.md, "vLLM's push mode", says why
each, and why this agent and thread).

A decode that registered fewer blocks than we staged had the rest in its prefix cache: as
vLLM's prefill does, the WRITE sends our last blocks into them. Every path frees the
request's blocks once no byte of its WRITEs can land any more: the WRITEs settled (done, or
failed or timed out and released), the handshake refused, the registration unusable,
``close`` (a ``vllm_blocks`` pool's pages: unpins them).
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
from prefill_worker.transfer.nixl.poster import Write, WritePoster
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

WRITE_TIMEOUT_S = 60.0  # a WRITE not settled by then is released (cancelled), its blocks freed
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
class Pending:
    """A request's WRITEs in flight, one per decode rank, posted at ``started``
    (``perf_counter``); ``failure``: why it failed, once a rank's did (the others released)."""

    job: PushJob
    key: _Key
    writes: list[Write]
    started: float
    failure: str | None = None

    @property
    def is_settled(self) -> bool:
        """No byte of it can land any more."""
        return all(w.is_settled or w.state() == "DONE" for w in self.writes)


@dataclass(slots=True)
class PushCounts:
    pushed: int = 0  # requests written
    pushed_bytes: int = 0
    write_s: float = 0.0  # the WRITEs' time, posted to seen settled by ``poll``, all of them
    failed: Counter[str] = field(default_factory=Counter)  # why -> requests not written


class VllmPusher:
    """Links to decodes, and the WRITEs; the engine thread calls ``push`` and ``poll``.
    ``agent`` is the push side's, owned by ``poster`` (every NIXL call on it goes through
    ``poster``); ``close`` closes the poster."""

    def __init__(
        self,
        agent: Any,
        poster: WritePoster,
        region_base_addrs: Sequence[int],
        layout: StagingLayout,
        hashes: Mapping[str, str],  # version -> our push-mode compatibility hash
        free: Callable[[Sequence[int]], None],
        clock: Callable[[], float],
    ) -> None:
        self._agent, self._poster, self._layout, self._hashes = agent, poster, layout, hashes
        self._free, self._clock = free, clock
        self._bases = tuple(region_base_addrs)
        table = local_slices(self._bases, layout, 1)  # whole blocks: entry l * num_blocks + b
        self._local = poster.run(agent.prep_xfer_dlist, "NIXL_INIT_AGENT", table, "DRAM")
        self._links: dict[_Key, DecodeLink] = {}
        self._linking: dict[_Key, tuple[Future[DecodeLink], list[PushJob]]] = {}
        self._writes: list[Pending] = []
        self._link_pool = ThreadPoolExecutor(1, thread_name_prefix="vllm-push-link")
        self.counts = PushCounts()
        self._log = RateLimitedLog(log, _LOG_S)

    @property
    def busy(self) -> bool:
        return bool(self._linking or self._writes)

    @property
    def wake_fd(self) -> int | None:
        """Readable when a WRITE changed state (None: ``poll`` must look, ``needs_polling``)."""
        return self._poster.wake_fd

    @property
    def needs_polling(self) -> bool:
        """Whether only a poll moves what is pending: a link being made (no fd), or WRITEs
        on a poster that has no thread of its own."""
        return bool(self._linking) or (bool(self._writes) and self._poster.needs_polling)

    @property
    def num_blocks_owned(self) -> int:
        jobs = [j for _, js in self._linking.values() for j in js] + [p.job for p in self._writes]
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
        self._poster.clear_wake()  # before reading states: a later change wakes the engine
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
        self._writes = [p for p in self._writes if not self._settle(p)]

    def close(self) -> None:
        """Cancels the WRITEs in flight and stops the transfer thread (nothing frees blocks a
        WRITE may still read), then frees every block this side owns and forgets the
        decodes."""
        self._link_pool.shutdown(wait=True, cancel_futures=True)
        for pending in self._writes:
            for write in pending.writes:
                write.release()
        self._poster.close()  # from here the agent is ours, on this thread
        for _, jobs in self._linking.values():
            for job in jobs:
                self._free(job.blocks)
        for pending in self._writes:
            self._free(pending.job.blocks)
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
        """On the link thread: the decode's ranks handshaken and checked, then loaded on the
        transfer thread."""
        hash_ = self._hashes[version]
        run = self._poster.run
        return link_decode(self._agent, self._bases, self._layout, hash_, reg, version, run)

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
            ranks = [RankWrite(self._local, local, link.remotes[0], remote)]
        else:  # rank r: its slices, entries r * num_layers * num_blocks further on
            step = lay.num_layers * lay.num_blocks
            ranks = [
                RankWrite(link.local, [i + r * step for i in local], theirs_r, remote)
                for r, theirs_r in enumerate(link.remotes)
            ]
        notif = f"{job.registration.request_id}:1".encode()
        num_bytes = len(local) * lay.block_bytes // len(ranks)
        writes = [
            self._poster.post(w.local, w.local_idx, w.remote, w.remote_idx, notif, num_bytes)
            for w in ranks
        ]
        self._writes.append(Pending(job, key, writes, time.perf_counter()))
        return None

    def _settle(self, pending: Pending) -> bool:
        """Whether ``pending`` is over (its blocks freed, counted): every rank DONE, or a
        failure whose WRITEs are all settled. A rank that failed or ran past
        ``WRITE_TIMEOUT_S`` releases the others (cancelled)."""
        elapsed = time.perf_counter() - pending.started
        if pending.failure is None:
            states = [w.state() for w in pending.writes]
            failed = [s for s in states if s.startswith("ERR")]
            if failed:
                pending.failure = failed[0]
            elif all(s == "DONE" for s in states):
                self._done(pending, elapsed)
                return True
            elif elapsed > WRITE_TIMEOUT_S:
                pending.failure = f"ERR (not settled in {WRITE_TIMEOUT_S:.0f} s: {states})"
            else:
                return False
        for write in pending.writes:
            write.release()  # cancels one in flight; retries one NIXL refused to release
        if not pending.is_settled:
            return False
        self.counts.write_s += elapsed
        self._drop_link(pending.key)  # the decode may be gone: the next one handshakes anew
        self._fail(pending.job, "write", pending.failure)
        return True

    def _abandon(self, key: _Key) -> None:
        """Another WRITE to the decode ``key`` failed: its WRITEs not done yet are released
        (failed), so that none is in flight when its lists are forgotten."""
        for pending in self._writes:
            if pending.key != key or pending.failure is not None:
                continue
            if all(w.state() == "DONE" for w in pending.writes):
                continue
            pending.failure = "ERR (another WRITE to this decode failed)"
            for write in pending.writes:
                write.release()

    def _done(self, pending: Pending, elapsed: float) -> None:
        for write in pending.writes:
            write.release()  # a settled ticket: nothing; an inline write: its handle
        job, lay = pending.job, self._layout
        self.counts.pushed += 1
        self.counts.pushed_bytes += len(job.blocks) * lay.num_layers * lay.block_bytes
        self.counts.write_s += elapsed
        self._free(job.blocks)

    def _drop_link(self, key: _Key) -> None:
        link = self._links.pop(key, None)
        if link is None:
            return
        self._abandon(key)
        # after every release asked so far: no WRITE of the link's lists is left in flight
        self._poster.run_later(self._forget, link, key[0])

    def _forget(self, link: DecodeLink, engine_id: str) -> None:
        try:
            forget(self._agent, link)
        except NIXL_ERRORS as exc:
            log.warning("vllm push: forgetting decode %s: %s", engine_id, exc)
