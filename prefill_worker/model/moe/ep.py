"""Expert parallelism (EP) inside a tensor-parallel group: the routed experts partitioned
whole over the group's ranks (``placement``), tokens moved to them by an exchange (the
registry below: ``torch`` all-to-all, ``deepep`` where ``deep_ep`` imports).

Attention at TP replicates the tokens on every rank, so each rank takes its contiguous share
of the batch, routes it (the router is replicated), and the exchange sends each (token,
expert) assignment to the expert's owner and brings the weighted outputs back::

    x [T, hidden], the same on every rank          (after attention's all-reduce)
    rank r: x[lo_r:hi_r]  -> exchange.dispatch_combine -> routed[lo_r:hi_r]
    out = zeros [T, hidden]; out[lo_r:hi_r] = routed          this rank's share only
    out += shared experts' partial (TP-split, as without EP)
    all_reduce(out)                                 (``moe.block``'s one collective)

The all-reduce that a TP MoE block already runs doubles as the all-gather of the shares (each
row is non-zero on one rank), so EP adds exactly the exchange's collectives to a layer.
``ExpertParallelExperts`` is an experts backend (``model.moe``'s protocol) wrapping the
chosen compute backend, so the block, the routing and the models do not change. An exchange's
``dispatch_combine`` takes any number of local tokens and a process group: attention-DP ranks
(different batches per rank, ``EPGroup.local_tokens``) call it with all of theirs, and a rank
with no batch calls it with none (``model.moe.idle``) whenever another rank runs a forward.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from prefill_worker.model.moe.alltoall import LocalExperts, TorchAllToAll
from prefill_worker.model.moe.base import ExpertsBackend, MoEWeights
from prefill_worker.model.moe.placement import ExpertPlacement
from prefill_worker.model.quant.linear import Weight


@dataclass(frozen=True, slots=True)
class EPGroup:
    """This rank's place among the expert-parallel ranks, and where the experts live."""

    rank: int
    placement: ExpertPlacement
    group: Any = None  # the torch.distributed process group (None: the default group)
    # True: each rank's tokens are its own (attention-DP ranks), not replicated (a TP group)
    local_tokens: bool = False

    @property
    def size(self) -> int:
        return self.placement.size

    @property
    def local_experts(self) -> tuple[int, ...]:
        return self.placement.local_experts(self.rank)


class Exchange(Protocol):
    name: str

    def dispatch_combine(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: LocalExperts
    ) -> torch.Tensor: ...


def _torch(ep: EPGroup, device: torch.device) -> Exchange:
    return TorchAllToAll(ep.rank, ep.placement, ep.group, device)


def _deepep(ep: EPGroup, device: torch.device) -> Exchange:
    from prefill_worker.model.moe.deepep import DeepEPExchange  # CUDA only: imported if chosen

    return DeepEPExchange(ep.rank, ep.placement, ep.group, device)


def has_deep_ep() -> bool:
    return importlib.util.find_spec("deep_ep") is not None


EP_EXCHANGES: dict[str, Callable[[EPGroup, torch.device], Exchange]] = {"torch": _torch}
if has_deep_ep():  # registered only where it can run (CUDA hosts with DeepEP built)
    EP_EXCHANGES["deepep"] = _deepep


def resolve_exchange_name(name: str, device: torch.device) -> str:
    """The exchange to run; ``ValueError`` (a configuration problem) when it cannot."""
    if name not in EP_EXCHANGES:
        known = ", ".join(EP_EXCHANGES)
        why = " (deep_ep is not installed here)" if name == "deepep" else ""
        raise ValueError(f"unknown expert-parallel exchange {name!r}{why} (known: {known})")
    if name == "deepep" and device.type != "cuda":
        raise ValueError("expert-parallel exchange 'deepep' needs a CUDA device")
    return name


def share(num_tokens: int, rank: int, size: int) -> slice:
    """Rank ``rank``'s contiguous share of ``num_tokens`` replicated tokens (sizes differ
    by at most one; a rank may get none)."""
    return slice(num_tokens * rank // size, num_tokens * (rank + 1) // size)


class ExpertParallelExperts:
    """An experts backend whose experts are this rank's only: computes this rank's share of
    the tokens through ``exchange``, zeros elsewhere (the block's all-reduce sums them); with
    ``ep.local_tokens`` (attention-DP ranks) every token is this rank's own and all of them
    go through the exchange (no share, and at TP 1 no all-reduce)."""

    def __init__(self, inner: ExpertsBackend, exchange: Exchange, ep: EPGroup) -> None:
        self.inner, self.exchange, self.ep = inner, exchange, ep
        self.name = f"{inner.name}+ep-{exchange.name}"

    def prepare(self, weights: MoEWeights) -> MoEWeights:
        return self.inner.prepare(weights)

    def experts(
        self,
        x: torch.Tensor,  # [T, hidden], replicated on every rank
        weights: torch.Tensor,  # [T, k]
        ids: torch.Tensor,  # [T, k] int64, global expert ids
        gate_up: Weight,  # [E_local, 2I, hidden]: this rank's experts, whole
        down: Weight,  # [E_local, hidden, I]
    ) -> torch.Tensor:
        def local(rows: torch.Tensor, w: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
            return self.inner.experts(rows, w, local_ids, gate_up, down)

        if self.ep.local_tokens:
            return self.exchange.dispatch_combine(x, weights, ids, local)
        mine = share(x.shape[0], self.ep.rank, self.ep.size)
        out = torch.zeros_like(x)
        out[mine] = self.exchange.dispatch_combine(x[mine], weights[mine], ids[mine], local)
        return out


def create_ep_experts(
    inner: ExpertsBackend, exchange_name: str, ep: EPGroup, device: torch.device
) -> ExpertParallelExperts:
    exchange = EP_EXCHANGES[resolve_exchange_name(exchange_name, device)](ep, device)
    return ExpertParallelExperts(inner, exchange, ep)
