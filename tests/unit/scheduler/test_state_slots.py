"""A hybrid model's state slot is its request's aux row: every chunk of a request names the
same slot, two requests in one batch never share one, and a slot comes back with the aux row
(``kv.aux``) so the next request may take it. The slot's byte arithmetic
(``kv.state_layout.StateComponent``) agrees with the config's (``LinearAttentionSpec``)."""

from __future__ import annotations

from prefill_worker.kv.aux import AuxPool
from prefill_worker.kv.pages import PagePool
from prefill_worker.kv.state_layout import (
    FULL_ATTENTION,
    LAST_CHUNK,
    LINEAR_ATTENTION,
    LINEAR_STATE,
    SLOT,
    StateComponent,
    StateTensor,
)
from prefill_worker.kv.tables import PageTable
from prefill_worker.model.hf_linear import LinearAttentionSpec
from prefill_worker.request import PrefillRequest, RequestState, SamplingParams
from prefill_worker.scheduler.admission import Admission
from prefill_worker.scheduler.queues import RequestQueues
from prefill_worker.scheduler.tracked import Request


def waiting(queues: RequestQueues, request_id: str, num_tokens: int) -> Request:
    prompt = PrefillRequest(request_id, [1] * num_tokens, SamplingParams(), False, 0, 0.0)
    req = Request(prompt, None)
    queues.add(req)
    queues.move(req, RequestState.WAITING)
    return req


def test_every_chunk_names_its_requests_aux_row_as_its_state_slot() -> None:
    queues, aux = RequestQueues(), AuxPool(4)
    assert aux.try_alloc() == 0  # held elsewhere: the requests get rows 1 and 2
    admission = Admission(
        queues, PageTable(PagePool(16), 4), aux, lambda: 0.0,
        chunk_size=4, max_batch_tokens=8, max_running_requests=4,
    )  # fmt: skip
    a, b = waiting(queues, "a", 12), waiting(queues, "b", 8)
    slots: dict[str, set[int | None]] = {"a": set(), "b": set()}
    while (batch := admission.next_batch()) is not None:
        in_batch = [chunk.state_slot for chunk in batch.plan.chunks]
        assert len(set(in_batch)) == len(in_batch)
        for chunk in batch.plan.chunks:
            slots[chunk.request_id].add(chunk.state_slot)
    assert slots == {"a": {a.aux_row}, "b": {b.aux_row}}
    assert {a.aux_row, b.aux_row} == {1, 2}


def test_a_slot_is_bytes_of_every_layer_and_tensor() -> None:
    spec = LinearAttentionSpec(
        layer_kinds=(LINEAR_ATTENTION, FULL_ATTENTION, LINEAR_ATTENTION),
        num_k_heads=2, num_v_heads=6, head_k_dim=12, head_v_dim=10, conv_kernel=4,
        rotary_dim=4, qkvz_grouped=False,
    )  # fmt: skip
    assert (spec.full_layers, spec.linear_layers, spec.conv_dim) == ((1,), (0, 2), 108)
    conv = StateTensor("conv", (108, 3), "bfloat16", 108 * 3 * 2)
    recurrent = StateTensor("recurrent", (6, 12, 10), "float32", 6 * 12 * 10 * 4)
    component = StateComponent(LINEAR_STATE, spec.linear_layers, (conv, recurrent), 8)
    assert (component.copy, component.when) == (SLOT, LAST_CHUNK)
    assert component.slot_bytes == spec.slot_bytes(2) == 2 * (648 + 2880)
