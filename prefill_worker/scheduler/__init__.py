"""The scheduler: request queues, admission and chunking, deadlines, and the one engine loop.

Torch-free. The daemon composes it like this (all on the engine thread except where noted)::

    kv = EngineKV(
        PagePool(num_pages),                     # prefill_worker.kv.pages
        AuxPool(cfg.cache.num_aux_rows),         # prefill_worker.kv.aux
        prefix_cache=cache,                      # kv.prefix_cache.PrefixCache over the pages;
    )                                            #   omitted: NoPrefixCache (off)
    limits = EngineLimits(
        page_size=cfg.cache.page_size,
        chunk_size=cfg.scheduler.chunk_size,
        max_batch_tokens=cfg.scheduler.max_batch_tokens,
        max_running_requests=cfg.scheduler.max_running_requests,
        bootstrap_timeout_s=cfg.scheduler.bootstrap_timeout_s,
        transfer_timeout_s=cfg.scheduler.transfer_timeout_s,
    )
    engine = Engine(
        runner,                                  # batch.ModelRunner (model/)
        transfer,                                # transfer.base.TransferBackend
        kv,
        reply,                                   # Callable[[Outcome], None]: → ingress
        limits,
        overlap=cfg.scheduler.overlap,
        observer=metrics_adapter,                # EngineObserver; NullObserver if omitted
    )
    engine.run(stop_event, inbox)   # inbox: scheduler.Inbox, a queue.Queue the loop can sleep on
    ...                             # (or call engine.submit(msg) / engine.step() yourself)
    engine.shutdown()               # after run returns: fail what is left, stop the executor

From other threads: ``engine.load`` (a ``LoadSnapshot``, for ``pong`` and gauges),
``engine.last_turn_at`` (``clock()`` at the end of the last turn) and ``engine.progress()``
(the last turn and the forward in progress, which ``liveness.LivenessRule`` judges for
``/livez``: busy or stuck). Draining is
the ingress's (it stops admitting) and the daemon's (it decides when). A drain ends by
stopping the loop once ``engine.load.num_live == 0`` or the drain timeout
passed; ``shutdown(FinishReason.DRAINING)`` (or ``fail_all``) then fails what is left.
``run`` fails every live request with ENGINE_ERROR before it re-raises an error.

Modules: ``queues`` (requests per state), ``admission`` (token budget, running cap, page and
aux reservation), ``chunking`` (page-aligned chunk ends), ``deadlines`` (one heap),
``forward`` (serial or executor-thread forwards), ``options`` (the records an ``Engine`` is
built from), ``inbox`` (the queue with a wake-up fd),
``observer`` (sink, observer, snapshot), ``liveness`` (forward timing; busy or stuck),
``lifecycle`` (each request from submit to its one outcome: sender polling, deadline expiry,
consuming forwards, the one finish path),
``engine`` (the loop: take, step, wait, collect and launch forwards, publish the load).
"""

from prefill_worker.inbox import EngineMessage, Inbox
from prefill_worker.load import LoadSnapshot
from prefill_worker.scheduler.engine import Engine
from prefill_worker.scheduler.forward import ForwardStrategy, SerialForward, ThreadedForward
from prefill_worker.scheduler.liveness import LivenessRule, Progress, Verdict
from prefill_worker.scheduler.observer import EngineObserver, NullObserver, OutcomeSink
from prefill_worker.scheduler.options import EngineKV, EngineLimits

__all__ = [
    "Engine",
    "EngineKV",
    "EngineLimits",
    "EngineMessage",
    "EngineObserver",
    "ForwardStrategy",
    "Inbox",
    "LivenessRule",
    "LoadSnapshot",
    "NullObserver",
    "OutcomeSink",
    "Progress",
    "SerialForward",
    "ThreadedForward",
    "Verdict",
]
