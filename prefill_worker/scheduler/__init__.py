"""The scheduler: request queues, admission and chunking, deadlines, and the one engine loop.

Torch-free. The daemon builds ``Engine(runner, transfer, EngineKV(...), sink, EngineLimits(...),
overlap=..., observer=...)`` (the records: ``options``), then ``engine.run(stop_event, inbox)``
on the engine thread (``prefill_worker.inbox.Inbox``), and ``engine.shutdown()`` after it
returns. From other threads: ``engine.load`` (a ``LoadSnapshot``), ``engine.last_turn_at`` and
``engine.progress()`` (judged by ``liveness.LivenessRule`` for ``/livez``). The engine knows
nothing of draining (the ingress and the daemon own it: docs/architecture.md); ``run`` fails
every live request with ENGINE_ERROR before it re-raises an error.

Modules: ``engine`` (the loop), ``lifecycle`` (each request from submit to its one outcome),
``handoff`` (when pages go to the decode; optimistic prefill: hold, yield, make room),
``queues`` (requests per state), ``tracked`` (the engine's record of a request), ``admission``
and ``chunking`` (token budget, running cap, pages, page-aligned chunk ends), ``deadlines``
(one heap), ``forward`` (serial or executor-thread forwards), ``options`` (the records),
``observer`` (the outcome sink and the observer), ``liveness`` (busy or stuck), ``warmup``.
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
