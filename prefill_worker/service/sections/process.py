"""The sections of the process itself: its lifecycle and logging, and its tensor-parallel
ranks."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from prefill_worker.service.sections.base import Section


class DaemonConfig(Section):
    """Process lifecycle and logging."""

    drain_timeout_s: float = Field(
        30.0, ge=0, description="On SIGTERM or /drain, how long in-flight requests may finish."
    )
    drain_min_s: float = Field(
        0.0,
        ge=0,
        description="On SIGTERM or /drain, the least time the worker stays up answering 503 "
        "(health and new requests), even when idle, so that a router that health-checks it "
        "(smg) sees the drain before the port closes; set it to the router's health window "
        "(docs/deploy.md). `drain_timeout_s` still ends the drain.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Least severe log level written."
    )
    log_format: Literal["text", "json"] = Field("text", description="Log line format.")
    ready_file: str | None = Field(
        None,
        description="Once serving, write the bound endpoints here as JSON (as `/readyz` shows"
        " them; replaced atomically, removed at exit). `serve --ready-file PATH` sets it.",
    )


class ParallelConfig(Section):
    """Tensor parallelism: one worker over ``tp_size`` rank processes (docs/parallelism.md)."""

    tp_size: int = Field(
        1,
        ge=1,
        le=64,
        description="Tensor-parallel ranks behind this worker; `serve` starts them itself "
        "(under torchrun, RANK/WORLD_SIZE decide instead). Must split the attention heads. "
        "Above 1, `transfer.protocol` must be native, sglang or vllm alone (vllm: the group on "
        "one host; docs/vllm.md); native or vllm for a hybrid linear-attention model "
        "(Qwen3-Next, Qwen3.5: docs/parallelism.md).",
    )
    dp_size: int = Field(
        1,
        ge=1,
        le=64,
        description="Attention data-parallel ranks behind this worker, each with its own "
        'scheduler, KV pool and decode-facing endpoints (docs/parallelism.md, "Attention data '
        'parallelism"); `serve` starts ranks 1..N-1 itself, on one host. Above 1: '
        "parallel.tp_size 1, `transfer.protocol` native or sglang alone, kv_events off.",
    )
    step_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Longest wait for any rank in one collective (a step, a heartbeat): a rank "
        "silent that long (stopped, hung) fails the whole worker.",
    )
    heartbeat_interval_s: float = Field(
        1.0,
        gt=0,
        description="While idle, the leader exchanges a heartbeat step with every rank this "
        "often (must be below step_timeout_s).",
    )
    rendezvous_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Longest wait for every rank to join the group at start-up (and to load).",
    )

    interface: str | None = Field(
        None,
        min_length=1,
        description="Under torchrun across hosts (MASTER_ADDR off loopback): the network "
        "interface the group's collectives bind (gloo's and NCCL's sockets); required there, "
        "and it should be private: torchrun's rendezvous store has no authentication. A group "
        "on one host (the one `serve` starts, or torchrun on loopback) binds only loopback.",
    )

    group_secret_file: str | None = Field(
        None,
        description="Under torchrun: a file holding the group's shared secret (16 bytes or "
        "more, e.g. `openssl rand -hex 32`), the same on every host; each rank proves it holds "
        "it before the group serves (the rendezvous store lets anyone who reaches it join). "
        "Required across hosts; a group `serve` starts makes its own each start.",
    )

    ep_size: int = Field(
        1,
        ge=1,
        le=64,
        description="Expert-parallel ranks for a mixture-of-experts model's routed experts: 1 "
        "(each rank holds every expert, tensor-split), `tp_size` (each rank of the TP group "
        "holds whole experts, `expert_placement`, and tokens reach them by all-to-all) or, "
        "at `dp_size` > 1, `dp_size` (the attention-DP ranks share the experts; their "
        "forwards run in lockstep, idle ranks with none; docs/expert-parallelism.md). "
        "Qwen3-MoE and DeepSeek-V3 only.",
    )
    expert_placement: list[int] = Field(
        [],
        description="At `ep_size` > 1: the rank holding each routed expert, one entry per "
        "expert (every rank at least one); empty: contiguous (rank r holds experts "
        "[r E / N, (r + 1) E / N)).",
    )
    ep_exchange: Literal["torch", "deepep"] = Field(
        "torch",
        description="At `ep_size` > 1: how tokens reach their experts' ranks: `torch` "
        "(torch.distributed all-to-all: gloo on CPU, NCCL on CUDA) or `deepep` (DeepEP's "
        "normal kernels; CUDA, contiguous placement, where `deep_ep` is installed; not across "
        "attention-DP ranks).",
    )

    @model_validator(mode="after")
    def _ep_is_the_group(self) -> ParallelConfig:
        if self.dp_size > 1 and self.ep_size not in (1, self.dp_size * self.tp_size):
            raise ValueError(
                f"ep_size {self.ep_size} must be 1 or dp_size ({self.dp_size}) x tp_size "
                f"({self.tp_size}): experts are placed over every attention-DP rank"
            )
        if self.dp_size > 1 and self.ep_size > 1 and self.ep_exchange != "torch":
            raise ValueError(
                f"ep_exchange {self.ep_exchange!r} at dp_size {self.dp_size}: across "
                "attention-DP ranks only the torch all-to-all is built"
            )
        if self.dp_size == 1 and self.ep_size not in (1, self.tp_size):
            raise ValueError(
                f"ep_size {self.ep_size} must be 1 or tp_size ({self.tp_size}): experts are "
                f"placed over the tensor-parallel group's ranks"
            )
        return self

    @model_validator(mode="after")
    def _heartbeat_below_timeout(self) -> ParallelConfig:
        if self.heartbeat_interval_s >= self.step_timeout_s:
            raise ValueError("heartbeat_interval_s must be below step_timeout_s")
        return self
