"""Start-up steps of a tensor-parallel worker's leader: the group (followers started or,
under torchrun, found; every rank joined), and the barrier after every rank loaded.

Like ``startup.py``'s steps, each runs inside ``startup_step``: a failure names the step,
78 for configuration problems (a model that does not split, what no transfer sends from
more than one rank yet: ``check_group_transfer``, too few devices), 1 otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from prefill_worker.model import CheckpointError
from prefill_worker.model.hf_config import ModelSpec, read_spec
from prefill_worker.model.moe.placement import check_expert_parallel
from prefill_worker.model.parallel import TPGroup
from prefill_worker.model.sharding import check_model_shardable
from prefill_worker.service.config import Config
from prefill_worker.service.startup import startup_step
from prefill_worker.tp.channel import LeaderChannel
from prefill_worker.tp.followers import Followers
from prefill_worker.tp.group import Placement, Timeouts, agree_loaded, join, open_store, rank_device
from prefill_worker.tp.leader import Heartbeat, LeaderGroup
from prefill_worker.tp.mirror import RankLink
from prefill_worker.transfer.base import TransferBackend

log = logging.getLogger("prefill_worker.service.daemon")


def tp_timeouts(config: Config) -> Timeouts:
    return Timeouts(config.parallel.rendezvous_timeout_s, config.parallel.step_timeout_s)


def start_tp_group(
    config: Config,
    placement: Placement,
    rank_command: Sequence[str],
    on_failure: Callable[[], None],
    secret: bytes,
) -> tuple[TPGroup, LeaderGroup, str]:
    """The leader's group: its followers started (outside torchrun), every rank joined
    within ``parallel.rendezvous_timeout_s``. Returns the model's ``TPGroup``, the group,
    and this rank's device. Too few devices is a configuration error (exit 78)."""
    cfg = config.parallel
    with startup_step("tp group", (ValueError, CheckpointError)):
        # A model that does not split is refused before any rank starts (the rule's owner:
        # model.sharding; each rank's build checks it again).
        spec = read_spec(config.model.path)
        check_model_shardable(spec, TPGroup(0, placement.size))
        check_expert_parallel(spec, placement.size, cfg.ep_size, config.parallel.expert_placement)
        check_group_transfer(spec, placement.size, tuple(config.transfer.protocols))
        device = rank_device(config.model.device, placement)
        store = open_store(placement, tp_timeouts(config))
        followers = Followers([])
        if store is not None:
            config_json = config.model_dump_json().encode()
            followers = Followers.start(
                rank_command, config_json, placement.size, store.port, secret
            )
        try:
            membership = followers.wait_for(
                lambda: join(placement, device, tp_timeouts(config), store, secret),
                cfg.rendezvous_timeout_s,
                "rendezvous",
            )
        except BaseException:
            followers.kill()
            raise
        log.info("tensor parallel: %d ranks joined, this is rank 0", placement.size)
    channel = LeaderChannel(membership.control, placement.size, RankLink())
    heartbeat = Heartbeat(channel, cfg.heartbeat_interval_s, on_failure)
    group = LeaderGroup(channel, followers, heartbeat, cfg.heartbeat_interval_s)
    return membership.tp, group, device


def check_group_transfer(spec: ModelSpec, tp_size: int, protocols: tuple[str, ...]) -> None:
    """Refuse (``ValueError``: exit 78) at TP > 1 what no transfer sends from a
    tensor-parallel group yet, though the model runs sharded; one condition per protocol and
    kind (a group serves one protocol: ``service.schema``). Served: a DSA model's index keys
    to SGLang and native decodes (every rank holds them, as the MLA latent beside them; the
    leader writes them into every decode rank: the push's paged state component),
    a linear-attention hybrid's state to native, SGLang and vLLM 0.34 decodes (the leader
    gathers whole slots, ``model.state_gather``, and writes each decode rank its state or its
    share; its vLLM backend stages them in vLLM's page layout), and gpt-oss's and Gemma 3's
    pages to native decodes (head slices of every page, as a dense model's), vLLM decodes
    (the group's shared staging holds every head: docs/vllm.md, "Workers with TP > 1") and
    SGLang decodes (every rank its heads of each page; into a hybrid SWA pool, of the full
    layers' pages and of the sliding layers' window pages: docs/sglang.md, "Workers with
    TP > 1"). Refused below: the rest (a DSA model over vLLM: its decodes get no index keys
    from any worker; at TP 1 each of its rooms is refused ``state_unsupported``)."""
    if tp_size == 1:
        return
    where = f"{spec.architecture} at tensor parallel {tp_size} over {'/'.join(protocols)}"
    if spec.indexer is not None and "vllm" in protocols:
        raise ValueError(
            f"{where}: the transfer of its index keys (DSA) to vLLM decodes is not built; "
            "serve it over sglang or native"
        )


def agree_group_loaded(config: Config, group: LeaderGroup, num_pages: int) -> None:
    """Wait (bounded) until every rank has loaded its shard with the same pool."""
    with startup_step("tp ranks loaded", (ValueError,)):
        group.followers.wait_for(
            lambda: agree_loaded(num_pages), config.parallel.rendezvous_timeout_s, "ranks loading"
        )


def lead_group(backend: TransferBackend, tp_size: int, num_kv_heads: int) -> bool:
    """Whether the backend (native or SGLang's) alone answers decodes for the whole TP group
    (every rank pushes its heads: docs/parallelism.md); otherwise only the leader's heads go
    (``transfer.protocol: both``: not built)."""
    if not hasattr(backend, "lead_group"):
        return False
    from prefill_worker.transfer.nixl.rank_writer import RankPlace

    backend.lead_group(RankPlace(0, tp_size, num_kv_heads))
    return True
