"""What this worker accepts from SGLang decodes, decided before NIXL sees anything: the
``/route`` answer it gives, the registrations it takes (as a decode pool, ``KVRegions``)
and the transfer requests it serves. Every refusal names the mismatch with its numbers; what
is refused and why is tabled in docs/sglang.md ("What is refused, and why").

Torch-, ZMQ- and NIXL-free.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from prefill_worker.kv.heads import kv_head_range
from prefill_worker.kv.layout import LAYER_MAJOR, MLA, KVLayout, KVRegions
from prefill_worker.transfer.headplan import HeadSlice, plan_rank
from prefill_worker.transfer.sglang.aux import AUX_BUFFER_NAMES, NUM_AUX_BUFFERS
from prefill_worker.transfer.sglang.frames import (
    Endpoint,
    Registration,
    TransferRequest,
    check_nixl_metadata,
)
from prefill_worker.transfer.validate import (
    ADDRESS_SPACE,
    BootstrapLimits,
    Refusal,
    RejectReason,
    outside_address_space,
)

_MEM_KINDS = {"DRAM", "VRAM"}
# SGLang's decode reads aux rows by index from its own buffers; their row count is not sent.
# NIXL checks every aux write against what the decode registered, so the bound here is only
# what an int32 index can say.
AUX_ROWS_BOUND = 2**31 - 1


def server_info(
    page_size: int, kv_cache_dtype: str, attn_tp_size: int = 1, dp_size: int = 1
) -> dict[str, object]:
    """``GET /route`` with every rank -1: exactly the keys every decode in 0.5.20-0.5.23
    accepts (it builds a dataclass from them; an unknown key is fatal on older decodes).
    ``attn_tp_size``: the worker's TP size (its ranks' control sockets are all the leader's);
    ``dp_size``: its attention-DP ranks (each its own control socket)."""
    return {
        "attn_tp_size": attn_tp_size,
        "attn_cp_size": 1,
        "dp_size": dp_size,
        "pp_size": 1,
        "page_size": page_size,
        "kv_cache_dtype": kv_cache_dtype,
        "follow_bootstrap_room": True,
    }


def check_registration(
    reg: Registration,
    ours: KVLayout,
    limits: BootstrapLimits,
    prefill_tp_size: int = 1,
    num_draft_layers: int = 0,
) -> Refusal | None:
    """Why this decode rank cannot be a peer of this worker (attention TP
    ``prefill_tp_size``, a draft model of ``num_draft_layers`` pool layers), or None."""
    return (
        _check_parallel(reg, ours, prefill_tp_size)
        or _check_features(reg, ours)
        or _check_layout(reg, rank_layout(reg, ours), num_draft_layers)
        or _check_memory(reg, limits)
        or _check_aux(reg)
        or _check_metadata(reg, limits)
    )


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def check_source(
    claimed: Endpoint, source_ip: str, allowed: Sequence[Network] = ()
) -> Refusal | None:
    """Why a frame that names ``claimed`` as its sender cannot have come from ``source_ip``
    (its connection's address), or None. SGLang's frames carry no proof of who sent them:
    the connection's address is the one thing the sender does not write. ``allowed`` empty:
    any network."""
    source = _address(source_ip)
    if source is None or source != _address(claimed.host):
        why = f"the frame names {claimed.host} but came from {source_ip}"
        return Refusal(RejectReason.SPOOFED_ADDRESS, why)
    if allowed and not any(source in net for net in allowed):
        why = f"{source_ip} is outside transfer.sglang_allowed_networks"
        return Refusal(RejectReason.NETWORK_NOT_ALLOWED, why)
    return None


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address, an IPv4-mapped IPv6 one as IPv4; None when ``text`` is none."""
    try:
        address = ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def check_request(
    req: TransferRequest, decode_tp_size: int = 1, prefill_tp_size: int = 1, is_mla: bool = False
) -> Refusal | None:
    """Why this room cannot be served as asked, or None (the pages are ``pagemap``'s). A
    decode rank of attention TP d names as ``required_dst_info_num`` how many decode ranks
    each prefill rank it targets serves: d / p when d >= p, else 1 (SGLang's
    ``_resolve_rank_mapping``; every decode rank's request reaches this leader). A dummy
    request (no pages: "this rank writes nothing for me") is SGLang's only for an MLA decode
    of d < p, to each rank it targets but the first (``is_dummy_expected``)."""
    if req.is_dummy and not is_dummy_expected(decode_tp_size, prefill_tp_size, is_mla):
        why = (
            f"a dummy request (no pages) from a decode of attention TP {decode_tp_size} to "
            f"this worker (attention TP {prefill_tp_size}, {'MLA' if is_mla else 'K/V'}): "
            "SGLang sends dummies only for an MLA model, from a decode of the smaller TP"
        )
        return Refusal(RejectReason.UNSUPPORTED, why)
    expected = max(1, decode_tp_size // prefill_tp_size)
    if req.required_dst_info_num != expected:
        why = (
            f"the room needs {req.required_dst_info_num} decode ranks; from this worker "
            f"(attention TP {prefill_tp_size}) a decode of attention TP {decode_tp_size} "
            f"needs {expected}"
        )
        return Refusal(RejectReason.UNSUPPORTED, why)
    if req.has_state:
        why = "the request names state slots (a hybrid model); this worker sends KV only"
        return Refusal(RejectReason.UNSUPPORTED, why)
    return None


def is_dummy_expected(decode_tp_size: int, prefill_tp_size: int, is_mla: bool) -> bool:
    """Whether a decode rank of this shape sends dummy requests: SGLang's MLA decode of
    attention TP d < p reads the latent from one prefill rank and sends each other rank it
    targets a dummy (``_setup_bootstrap_infos``: ``is_dummy`` unless the rank is its
    ``target_tp_rank``); a non-MLA decode never does."""
    return is_mla and decode_tp_size < prefill_tp_size


def target_ranks(decode_rank: int, decode_tp_size: int, prefill_tp_size: int) -> range:
    """The prefill ranks a decode rank sends its requests to, one each (SGLang's
    ``_resolve_rank_mapping``, alike for MLA and not): an ``ABORT_ACK`` comes from each."""
    if decode_tp_size >= prefill_tp_size:
        rank = decode_rank // (decode_tp_size // prefill_tp_size)
        return range(rank, rank + 1)
    per_rank = prefill_tp_size // decode_tp_size
    return range(decode_rank * per_rank, (decode_rank + 1) * per_rank)


def status_ranks(
    decode_rank: int, decode_tp_size: int, prefill_tp_size: int, is_mla: bool
) -> range:
    """Those of ``target_ranks`` a decode rank expects a ``KV_STATUS`` from, one each: every
    one, but for an MLA decode only the first (its ``target_tp_rank``, the one its real
    request goes to; SGLang's dummy ranks send no status, and the decode counts one:
    ``required_prefill_response_num`` 1). That is the rank ``headplan`` has write it."""
    ranks = target_ranks(decode_rank, decode_tp_size, prefill_tp_size)
    return ranks[:1] if is_mla else ranks


def rank_slice(reg: Registration, ours: KVLayout, prefill_tp_size: int = 1) -> HeadSlice | None:
    """The heads this worker's leader (rank 0 of ``prefill_tp_size``; ``ours`` has every
    head of the model) writes into the decode rank, by the KV-head rule (``kv.heads``,
    SGLang's own); None when the leader feeds it nothing (the other ranks do). ``ValueError``
    when a TP size does not split the heads."""
    slices = plan_rank(ours.num_kv_heads, 0, prefill_tp_size, reg.tp_size)
    return next((s for s in slices if s.dst_rank == reg.tp_rank), None)


def rank_layout(reg: Registration, ours: KVLayout) -> KVLayout:
    """Our layout with the decode rank's heads: what its pool must be (``ours`` at TP 1)."""
    if reg.tp_size == 1:
        return ours
    num_heads = len(kv_head_range(ours.num_kv_heads, reg.tp_rank, reg.tp_size))
    return KVLayout(
        ours.num_layers,
        num_heads,
        ours.head_dim,
        ours.dtype,
        ours.page_size,
        ours.num_pages,
        ours.kind,
    )


def peer_regions(reg: Registration, ours: KVLayout, num_draft_layers: int = 0) -> KVRegions:
    """The decode pool of an accepted registration, as this worker's page arithmetic sees it:
    ``num_slots`` pages per region (page 0 is SGLang's padding page, never named), each page
    holding the rank's heads. SGLang's MHA pool is per layer K then V (layer-major); its MLA
    pool one latent per layer (mla: no V). A speculating decode appends its draft pool's
    regions (its K then V, or latents) after the target's; with a draft of this worker's
    ``num_draft_layers`` they are the pool's layers after the target's (``transfer.draft``),
    else they are left out (never written)."""
    n, num_heads = ours.num_layers, rank_layout(reg, ours).num_kv_heads
    target, planes = ours.planes * n, ours.planes
    k, v = reg.kv_ptrs[:n], reg.kv_ptrs[n:target]
    d = num_draft_layers if num_draft_entries(reg, ours) == planes * num_draft_layers else 0
    k, v = k + reg.kv_ptrs[target : target + d], v + reg.kv_ptrs[target + d : target + planes * d]
    kind = MLA if ours.kind == MLA else LAYER_MAJOR
    layout = KVLayout(
        n + d, num_heads, ours.head_dim, ours.dtype, ours.page_size, reg.num_slots, kind
    )
    device = "cpu" if _mem_kind(reg) == "DRAM" else f"cuda:{reg.gpu_id}"
    return KVRegions(layout, k, v, device, reg.aux_ptrs[0], AUX_ROWS_BOUND)


def num_draft_entries(reg: Registration, ours: KVLayout) -> int:
    """The KV regions a decode registered past the target's: its draft pool's (SGLang's
    ``num_draft_entries``, a decode that speculates), 0 for one that does not."""
    return max(0, len(reg.kv_ptrs) - ours.planes * ours.num_layers)


def _mem_kind(reg: Registration) -> str:
    return reg.mem_kinds[0] if reg.mem_kinds else "VRAM"  # SGLang's default when absent


def _unsupported(why: str) -> Refusal:
    return Refusal(RejectReason.UNSUPPORTED, why)


def _check_parallel(reg: Registration, ours: KVLayout, prefill_tp_size: int) -> Refusal | None:
    # An MLA decode of attention TP d: every rank asks for every room with its own pages and
    # metadata row and wants the whole latent (docs/sglang.md, "An MLA decode of attention
    # TP > 1"); served from a worker of TP N <= d, not proven at 1 < d < N (dummies).
    if 1 < reg.tp_size < prefill_tp_size and ours.kind == MLA:
        return _unsupported(
            f"an MLA decode of attention TP {reg.tp_size} at this worker of TP "
            f"{prefill_tp_size}: an MLA decode of attention TP > 1 is served by a worker of "
            "no larger TP; run it at attention TP 1, or against a worker of TP "
            f"{reg.tp_size} or less"
        )
    if not 0 <= reg.tp_rank < reg.tp_size:
        return _unsupported(f"decode attention TP rank {reg.tp_rank} of {reg.tp_size}")
    try:
        plan_rank(ours.num_kv_heads, 0, 1, reg.tp_size)
    except ValueError as exc:
        return _unsupported(f"decode attention TP size {reg.tp_size}: {exc}")
    if reg.dcp_size != 1:
        return _unsupported(f"decode context parallel size {reg.dcp_size} (DCP) is not served")
    return None


def _check_features(reg: Registration, ours: KVLayout) -> Refusal | None:
    if reg.has_state:
        return _unsupported("the decode registered state buffers (a hybrid model)")
    if reg.has_staging:
        return _unsupported("the decode registered a staging buffer (heterogeneous TP)")
    natural = tuple(range(len(reg.kv_ptrs) // ours.planes)) * ours.planes
    if reg.kv_layer_ids and reg.kv_layer_ids != natural:
        planes = "one latent" if ours.kind == MLA else "one K and one V"
        return _unsupported(f"the decode's KV regions are not {planes} per layer")
    return None


def _check_layout(reg: Registration, ours: KVLayout, num_draft_layers: int) -> Refusal | None:
    num_regions, extra = ours.planes * ours.num_layers, num_draft_entries(reg, ours)
    is_draft = _is_draft_served(extra, num_regions, ours.planes, num_draft_layers)
    if len(reg.kv_ptrs) < num_regions or not is_draft:
        draft = f" and a draft of {num_draft_layers} layers" if num_draft_layers else ""
        return Refusal(
            RejectReason.LAYOUT_MISMATCH,
            f"decode registered {len(reg.kv_ptrs)} KV regions; this worker's model has "
            f"{ours.num_layers} layers{draft} ({num_regions} regions: {_planes(ours)} of "
            "each)",
        )
    # A draft pool this worker has no draft for is never written: only what is, is checked.
    written = num_regions + (ours.planes * num_draft_layers if extra else 0)
    lens = {reg.kv_item_len, *reg.kv_item_lens[:written]}
    if lens != {ours.page_bytes} or len(reg.kv_item_lens) not in (0, len(reg.kv_ptrs)):
        return Refusal(
            RejectReason.LAYOUT_MISMATCH,
            f"decode KV page is {sorted(lens)} bytes per region; this worker's is "
            f"{ours.page_bytes} ({_page_terms(ours)} x {ours.itemsize} bytes of {ours.dtype}): "
            f"the page size, KV dtype or {_row(ours)} differ",
        )
    return None


def _is_draft_served(extra: int, num_regions: int, planes: int, num_draft_layers: int) -> bool:
    """A decode's draft regions (``extra``) are whole layers, fewer than the target's (a
    draft is a layer or a few: twice the regions is another pool, K and V where we have
    latents), and this worker's draft's when it has one (a worker without one serves a
    speculating decode its target's KV only, as SGLang's prefill without speculative
    decoding does)."""
    if extra % planes or extra >= num_regions:
        return extra == 0
    return extra == 0 or num_draft_layers == 0 or extra == planes * num_draft_layers


def _planes(ours: KVLayout) -> str:
    """What each layer registers: K and V (an MHA pool), or the latent (an MLA pool)."""
    return "the MLA latent" if ours.kind == MLA else "K and V"


def _page_terms(ours: KVLayout) -> str:
    if ours.kind == MLA:
        return f"page_size {ours.page_size} x latent {ours.head_dim}"
    return f"page_size {ours.page_size} x {ours.num_kv_heads} KV heads x head_dim {ours.head_dim}"


def _row(ours: KVLayout) -> str:
    return "latent width" if ours.kind == MLA else "head layout"


def _check_memory(reg: Registration, limits: BootstrapLimits) -> Refusal | None:
    kinds = set(reg.mem_kinds)
    if reg.mem_kinds and (len(kinds) != 1 or not kinds <= _MEM_KINDS):
        return Refusal(
            RejectReason.BAD_DEVICE,
            f"KV memory kinds {sorted(kinds)[:4]}: one of DRAM or VRAM for every region",
        )
    if reg.mem_kinds and len(reg.mem_kinds) != len(reg.kv_ptrs):
        return Refusal(RejectReason.BAD_DEVICE, "one KV memory kind per region is needed")
    if not 1 <= reg.num_slots <= limits.max_peer_pages:
        return Refusal(
            RejectReason.TOO_LARGE,
            f"decode pool of {reg.num_slots} pages; this worker takes 1 to "
            f"{limits.max_peer_pages} (transfer.max_peer_pages)",
        )
    region_bytes = reg.num_slots * reg.kv_item_len
    return outside_address_space("KV region", [(addr, region_bytes) for addr in reg.kv_ptrs])


def _check_aux(reg: Registration) -> Refusal | None:
    if len(reg.aux_ptrs) != NUM_AUX_BUFFERS:
        return _unsupported(
            f"decode registered {len(reg.aux_ptrs)} metadata buffers; this worker fills "
            f"SGLang's default {NUM_AUX_BUFFERS} ({', '.join(AUX_BUFFER_NAMES)}): turn off "
            "SGLANG_ENABLE_DISAGG_SAMPLING_MASK and --disaggregation-enable-kv-checksum "
            "(nor a DSA model's MTP seed row: index_share_for_mtp_iteration)"
        )
    if not all(0 < addr < ADDRESS_SPACE for addr in reg.aux_ptrs):
        return Refusal(RejectReason.BAD_ADDRESS, "a metadata buffer address is 0")
    return None


def _check_metadata(reg: Registration, limits: BootstrapLimits) -> Refusal | None:
    why = check_nixl_metadata(reg.agent_metadata, reg.agent_name, limits.max_message_bytes)
    return None if why is None else Refusal(RejectReason.BAD_METADATA, why)
