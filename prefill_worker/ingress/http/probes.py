"""The read-only routes a PD router probes, with SGLang's shapes: ``/health``,
``/server_info``, ``/model_info``, ``/v1/models``, ``/loads``, ``/v1/loads`` (and the older
``get_`` names).

smg 1.13 tells the engine from ``/v1/models`` ``data[].owned_by`` (``"sglang"``), and takes a
server that answers ``GET /version`` for vLLM, whose PD wire differs (no bootstrap room, so
this worker could not serve it): like SGLang's own server, this one answers ``/version`` with
404. It reads the model id from ``data[].id`` (and
``served_model_name``), the parallel sizes and ``disaggregation_mode`` from ``/server_info``,
and a load report per rank from ``/v1/loads`` (``loads[]``: running and waiting requests,
token usage; the fields it does not know it ignores, so the cost signals ride beside them,
``cost_signals``). Prefill and decode servers must announce the same model id, or the router will
not pair them. The decode peer in ``testing/`` builds its answers from these functions too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from prefill_worker.load import CostSignals, LoadSnapshot


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What the server says about itself."""

    served_model_name: str
    model_path: str
    architectures: tuple[str, ...]
    model_type: str
    context_length: int  # longest prompt accepted
    page_size: int
    max_total_tokens: int  # KV pool size in tokens
    max_running_requests: int
    version: str
    bootstrap_port: int | None
    has_tokenizer: bool
    disaggregation_mode: str = "prefill"
    tp_size: int = 1  # the TP group's size, as SGLang's own prefill reports its --tp-size


def server_info(model: ServedModel) -> dict[str, Any]:
    return {
        "model_path": model.model_path,
        "served_model_name": model.served_model_name,
        "tokenizer_path": model.model_path if model.has_tokenizer else None,
        "skip_tokenizer_init": not model.has_tokenizer,
        "tp_size": model.tp_size,  # smg warns when prefill and decode differ
        "dp_size": 1,
        "pp_size": 1,
        "load_balance_method": "round_robin",
        "disaggregation_mode": model.disaggregation_mode,
        "disaggregation_transfer_backend": "nixl",
        "disaggregation_bootstrap_port": model.bootstrap_port,
        "page_size": model.page_size,
        "kv_cache_dtype": "auto",
        "is_embedding": False,
        "context_length": model.context_length,
        "max_total_tokens": model.max_total_tokens,
        "max_running_requests": model.max_running_requests,
        "version": model.version,
        "frontend": "prefill-worker",
    }


def model_info(model: ServedModel) -> dict[str, Any]:
    return {
        "model_path": model.model_path,
        "served_model_name": model.served_model_name,
        "tokenizer_path": model.model_path if model.has_tokenizer else None,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "disaggregation_mode": model.disaggregation_mode,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": model.model_type,
        "architectures": list(model.architectures),
    }


def models(model: ServedModel) -> dict[str, Any]:
    card = {
        "id": model.served_model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "sglang",  # what smg recognises as SGLang's PD wire
        "root": model.served_model_name,
        "max_model_len": model.context_length,
    }
    return {"object": "list", "data": [card]}


def cost_signals(costs: CostSignals) -> dict[str, Any]:
    """This worker's cost signals (docs/http-api.md): None where no rate is measured yet."""
    return {
        "queued_tokens": costs.queued_tokens,
        "running_tokens": costs.running_tokens,
        "prefill_rate_tokens_per_s": costs.prefill_rate_tps,
        "backlog_s": costs.backlog_s,
        "handshake_s": costs.handshake_s,
        "transfer_s": costs.transfer_s,
        "forward_s": costs.forward_s,
        "arrival_tokens_per_s": costs.arrival_tps,
        "chunk_size": costs.chunk_size,
        "max_batch_tokens": costs.max_batch_tokens,
    }


def loads(model: ServedModel, load: LoadSnapshot) -> dict[str, Any]:
    """One rank's load, as SGLang's ``/v1/loads`` and smg's ``SchedulerLoadSnapshot``."""
    used_tokens = load.num_used_pages * model.page_size
    total_tokens = max(load.num_total_pages * model.page_size, 1)
    rank = {
        "dp_rank": 0,
        "num_running_reqs": load.num_prefilling + load.num_transferring,
        "num_waiting_reqs": load.num_bootstrapping + load.num_waiting,
        "num_total_reqs": load.num_live,
        "num_used_tokens": used_tokens,
        "max_total_num_tokens": total_tokens,
        "token_usage": used_tokens / total_tokens,
        "gen_throughput": 0.0,
        "cache_hit_rate": 0.0,
        "utilization": 0.0,
        "max_running_requests": model.max_running_requests,
        **cost_signals(load.costs),
    }
    return {
        "timestamp": datetime.now(timezone.utc).isoformat(),
        "version": model.version,
        "dp_rank_count": 1,
        "loads": [rank],
    }
