"""An SGLang decode of a DSA model (DeepSeek-V3.2, GLM-5; its ``dsa`` state component): what
such a decode registers and asks, checked, and its index pool as a paged state component.

SGLang 0.5.23 runs a DSA model on ``DSATokenToKVPool``: the MLA latents in its KV list as any
MLA model's, and the indexer's keys in a buffer per layer (``IndexKeyCache``), FP8 with an
fp32 scale per token, a page of it per KV page (``model.index_fp8`` has the byte layout). It
registers them once as one state component (``setup_state_kv_args``: ``state_types [dsa]``,
one buffer per model layer, a layer without an indexer (GLM-5's shared ones) a buffer of no
items, no dims or layer ids). Per request it names, as ``state_indices[0]``, the index pages
of the tokens after its cached prefix (``decode.py``, ``_dsa_pages_payload``): the pages it
names for the KV, in the same order. So from our pools::

    our region                               -> the decode's
    latent of layer l, prompt page           -> its KV list, the page the request names
    FP8 index page of indexed layer l, page  -> its index buffer of layer l, the same page

and the push writes an index page with its KV page, as a native decode's index keys
(``transfer.push.sender``, a ``PAGES`` component). Refused by name: a decode with no index
pool, one that registered another component beside it (``dsa_tail``: SGLang's pooled index
keys, ``index_kpool`` > 1), an index pool whose page is not ours (page size, index head), or
that holds fewer pages than its KV pool, or is past ``transfer.max_peer_pages``; a request
whose index pages are not its KV pages.

A decode of attention TP d > 1 holds the whole latent and the whole index pool on each rank
(neither is split by heads: SGLang's indexer is replicated), so each rank registers as above
and is written every index page; so is each rank of ours at TP > 1 (the indexer replicated
here too), and the leader alone writes them, into every decode rank, whichever rank writes
that decode rank's latent (``push.sender``; the MLA plan of ``transfer.headplan``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from prefill_worker.kv.layout import KVLayout
from prefill_worker.kv.state_layout import StateRegions
from prefill_worker.transfer import wire
from prefill_worker.transfer.nixl.state_lists import (
    LOCAL_AGENT,
    StateLists,
    prep_state_list,
    register_state,
)
from prefill_worker.transfer.sglang.frames import Registration, TransferRequest
from prefill_worker.transfer.validate import (
    BootstrapLimits,
    Refusal,
    RejectReason,
    outside_address_space,
)


@dataclasses.dataclass(frozen=True, slots=True)
class IndexPool:
    """An accepted registration of a DSA decode: the registration as its KV list alone (no
    state), to check and map as any MLA decode's; and its index pool, as the regions of our
    component (``model.index_fp8``) in its buffers."""

    registration: Registration
    index: StateRegions


def accept_index_pool(
    reg: Registration, ours: KVLayout, index: StateRegions, limits: BootstrapLimits
) -> IndexPool | Refusal:
    """The decode's index pool for our FP8 index pages (``index``), or why it cannot take
    them. ``ours`` is our KV layout (every model layer)."""
    if not reg.has_state:
        return _unsupported(
            "the decode registered no DSA index pool, which this model's decode reads its "
            "indexer keys from"
        )
    if len(reg.state) != 1:
        return _unsupported(
            f"the decode registered {len(reg.state)} state components; a DSA decode holds one "
            "(dsa; SGLang's pooled index keys, index_kpool > 1 with dsa_tail, are not served)"
        )
    dsa = reg.state[0]
    if dsa.dims or dsa.layer_ids:
        return _unsupported("the decode's state component is not a DSA index pool")
    page = index.component.tensors[0].item_bytes
    want = tuple(page if i in index.component.layer_ids else 0 for i in range(ours.num_layers))
    if dsa.item_lens != want or len(dsa.data_ptrs) != len(want):
        why = (
            f"decode index pool of {len(dsa.data_ptrs)} layers, pages of "
            f"{sorted(set(dsa.item_lens))} bytes; this worker's: {len(want)} layers, pages of "
            f"{page} bytes on layers {list(index.component.layer_ids)} (page size "
            f"{ours.page_size}, FP8 keys of 128 and a scale per token), none on the others"
        )
        return Refusal(RejectReason.LAYOUT_MISMATCH, why)
    return _index_pool(reg, index, limits)


def _index_pool(
    reg: Registration, index: StateRegions, limits: BootstrapLimits
) -> IndexPool | Refusal:
    dsa, layers = reg.state[0], index.component.layer_ids
    page = index.component.tensors[0].item_bytes
    lens = {dsa.data_lens[i] for i in layers} if len(dsa.data_lens) == len(dsa.data_ptrs) else set()
    if len(lens) != 1:
        return _unsupported(
            "the decode's index buffers come without one size for all (state_data_lens, sent "
            "from SGLang 0.5.23 on)"
        )
    num_items = lens.pop() // page
    if num_items < reg.num_slots:
        why = (
            f"decode index pool of {num_items} pages for a KV pool of {reg.num_slots}: an "
            "index page per KV page is needed"
        )
        return Refusal(RejectReason.LAYOUT_MISMATCH, why)
    if num_items > limits.max_peer_pages:
        why = (
            f"decode index pool of {num_items} pages; this worker takes at most "
            f"{limits.max_peer_pages} (transfer.max_peer_pages)"
        )
        return Refusal(RejectReason.TOO_LARGE, why)
    refusal = outside_address_space(
        "index region", [(dsa.data_ptrs[i], num_items * page) for i in layers]
    )
    if refusal is not None:
        return refusal
    component = dataclasses.replace(index.component, num_items=num_items)
    device = "cpu" if reg.mem_kinds[:1] == ("DRAM",) else f"cuda:{reg.gpu_id}"
    bases = (tuple(dsa.data_ptrs[i] for i in layers),)
    kv_only = dataclasses.replace(reg, has_state=False, state=())
    return IndexPool(kv_only, StateRegions(component, bases, device))


def index_want(req: TransferRequest) -> wire.Want | Refusal:
    """The request's want, once its index pages are its KV pages (its one state index list)."""
    if len(req.state_indices) != 1:
        why = (
            f"the request names {len(req.state_indices)} state index lists; a DSA decode "
            "names one (its index pages)"
        )
        return _unsupported(why)
    want = req.want()
    if not np.array_equal(np.asarray(req.state_indices[0]), want.dst_page_ids):
        return Refusal(
            RejectReason.BAD_WANT, "the request's index pages are not the pages it names for KV"
        )
    return want


def open_local(agent: Any, index: StateRegions) -> tuple[StateLists, Callable[[], None]]:
    """Our FP8 index pages registered with ``agent`` and prepared as a list; and what
    releases both."""
    registration = register_state(agent, index)
    try:
        lists = StateLists(index, prep_state_list(agent, LOCAL_AGENT, index))
    except BaseException:
        agent.deregister_memory(registration)
        raise

    def release() -> None:
        lists.prepped.release()
        agent.deregister_memory(registration)

    return lists, release


def _unsupported(why: str) -> Refusal:
    return Refusal(RejectReason.UNSUPPORTED, why)
