"""How SGLang's protocol says things to a decode rank: replies go to the control socket it
registered (``KV_STATUS`` success or failed with the reason, once in the name of each worker
rank the decode rank expects one from; an abort's acknowledgement is ``ABORT_ACK``, echoing
the abort's generation, once in the name of each worker rank it asked), and the aux row is
staged in SGLang's format (``sglang.aux``: the engine owns the aux rows) and written with one
WRITE into row ``aux_index`` of each of the decode's metadata buffers. No NIXL notification
is sent: SGLang decodes complete a room on ``KV_STATUS``.

Which row a decode gets::

    decode speculates   worker drafts   row
    no                  either          the default row (no draft fields)
    yes                 yes             the speculating row: the draft's top-k and hidden state
    yes                 no              the default row but ``output_hidden_states``, which is
                                        not written (its width is the decode's draft's)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefill_worker.kv.draft_rows import DraftRows
from prefill_worker.transfer import wire
from prefill_worker.transfer.nixl.poster import Write, WritePoster
from prefill_worker.transfer.pagemap import AUX_MEM_TYPE
from prefill_worker.transfer.push.peer import Peer
from prefill_worker.transfer.sglang import aux, frames
from prefill_worker.transfer.sglang.control import ReplySockets


@dataclass(eq=False, kw_only=True)
class SglangPeer(Peer):
    """A registered SGLang decode rank (``identity`` is its agent name, encoded)."""

    aux_ptrs: tuple[int, ...]  # its metadata buffers
    endpoint: frames.Endpoint  # its control socket, as registered
    # The worker ranks it sends its requests to (``accept.target_ranks``): it counts an
    # ABORT_ACK from each before it frees an aborted room's pages.
    prefill_ranks: range = range(1)
    # Those it expects a KV_STATUS from, one each (``accept.status_ranks``: all of them, but
    # the first only for an MLA decode, whose other requests are dummies).
    status_ranks: range = range(1)
    # KV regions it registered past the target's (``accept.num_draft_entries``): > 0, it
    # speculates, and its metadata rows are the speculating layout.
    num_draft_entries: int = 0


class SglangDialect:
    unreachable = "decode control socket unreachable for KV_STATUS"

    def __init__(
        self,
        replies: ReplySockets,
        poster: WritePoster,
        staging: aux.AuxStaging,
        aux_rows: aux.AuxRowsView,
        spec_staging: aux.AuxStaging | None = None,  # with a draft: the speculating rows
        draft_rows: DraftRows | None = None,  # with a draft: its proposals, by aux row
    ) -> None:
        self._replies, self._poster = replies, poster
        self._staging, self._aux_rows = staging, aux_rows
        self._spec_staging, self._draft_rows = spec_staging, draft_rows

    def send(self, peer: SglangPeer, status: wire.Status, generation: int | None = None) -> bool:
        is_ok, sent = status.status == "ok", True
        if status.status == "aborted":  # in the name of each rank it asked
            messages = [frames.abort_ack(status.room, generation, r) for r in peer.prefill_ranks]
        else:  # in the name of each rank it expects a status from
            messages = [
                frames.kv_status(status.room, is_ok, status.reason, r) for r in peer.status_ranks
            ]
        for message in messages:
            sent = self._replies.send(peer.endpoint, message) and sent
        return sent

    def dropped(self, room: int, reason: str) -> wire.Status:
        return wire.Status(room, "failed", reason)

    def post_aux(self, peer: SglangPeer, want: wire.Want, room: int, aux_row: int) -> Write:
        """Stage the row, then one WRITE of it, built where the agent lives."""
        staging, draft = self._staging, None
        if peer.num_draft_entries and self._spec_staging is not None:
            assert self._draft_rows is not None
            staging, draft = self._spec_staging, self._draft_rows.read(aux_row)
        staging.fill(aux_row, self._aux_rows.read(aux_row), room, draft)
        local = staging.local_descs(aux_row)
        remote = aux.remote_descs(peer.aux_ptrs, want.dst_aux_slot, staging.item_bytes)
        if peer.num_draft_entries and staging is self._staging:  # its hidden row is not ours
            local, remote = aux.without_hidden(local), aux.without_hidden(remote)
        num_bytes = int(local[:, 1].sum())
        name = peer.agent_name

        def prepare(agent: Any) -> Any:
            local_descs = agent.get_xfer_descs(local, AUX_MEM_TYPE)
            remote_descs = agent.get_xfer_descs(remote, AUX_MEM_TYPE)
            return agent.initialize_xfer("WRITE", local_descs, remote_descs, name)

        return self._poster.post_with(prepare, num_bytes, len(local))

    def why_no_handshake(self) -> str | None:
        return None  # a refused SGLang decode still sends its request: the room fails at once
