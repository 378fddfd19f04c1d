"""A hybrid model (Qwen3-Next, Qwen3.5) through the engine with the real runner: each request's
linear-attention state lives in the slot of its aux row, from admission to finish.

Five prompts through an engine with 3 aux rows (so slots are reused), chunks of 8 tokens
interleaved across requests in one batch, one request aborted mid-prefill (its slot goes to a
later request, which must start from zero): every finished request's first token is
transformers' argmax, every page handed to the sender holds transformers' K/V of the full
layers, and the slot when the aux row is handed over holds transformers' state after the whole
prompt (what SGLang's decode expects). Afterwards the page pool and the aux rows (hence the
state slots) are whole, and the engine's integrity check passes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefill_worker.kv.aux import AuxPool
from prefill_worker.kv.pages import PagePool
from prefill_worker.model import build
from prefill_worker.request import (
    AbortRequest,
    FinishReason,
    Outcome,
    PrefillRequest,
    SamplingParams,
)
from prefill_worker.scheduler import Engine, EngineKV, EngineLimits
from tests.checkpoints import HYBRID_FAMILIES, hf_model, make_checkpoint, prompt
from tests.integration.scheduler.capture import CapturingBackend, CapturingSender

PAGE_SIZE, NUM_AUX_ROWS = 4, 3
TOL = 1e-4
FULL_LAYERS, LINEAR_LAYERS = (1, 4), (0, 2, 3)
PROMPTS = {f"p{i}": prompt(n, seed=40 + i) for i, n in enumerate((45, 23, 70, 9, 31))}
ABORTED = "p1"


class StateCapturingSender(CapturingSender):
    """Also copies the request's state slot when its aux row (the last write) is handed over."""

    end_state: tuple[list[torch.Tensor], list[torch.Tensor]]

    def send_aux(self, aux_row: int) -> None:
        super().send_aux(aux_row)
        cache = self.state_cache  # type: ignore[attr-defined]
        self.end_state = (
            [conv[aux_row].clone() for conv in cache.conv],
            [recurrent[aux_row].clone() for recurrent in cache.recurrent],
        )


class StateCapturingBackend(CapturingBackend):
    def create_sender(
        self, room, request_id, num_prompt_tokens, allowed_peer=None, traceparent=None
    ):  # type: ignore[no-untyped-def]
        sender = StateCapturingSender(self, room, request_id, num_prompt_tokens)
        sender.kv_cache, sender.captured = self.kv_cache, {}
        sender.state_cache = self.state_cache  # type: ignore[attr-defined]
        self.senders[request_id] = sender
        self.all_senders.append(sender)
        return sender


@pytest.fixture(scope="module", params=HYBRID_FAMILIES)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(request.param, tmp_path_factory.mktemp("hyb") / request.param)


def serve(checkpoint: Path, overlap: bool) -> tuple[dict[str, Outcome], StateCapturingBackend]:
    runner, kv_cache, info = build(
        checkpoint,
        dtype="float32",
        device="cpu",
        page_size=PAGE_SIZE,
        num_pages=96,
        num_state_slots=NUM_AUX_ROWS,
    )
    assert info.state is not None and info.state.num_items == NUM_AUX_ROWS
    pool, aux = PagePool(kv_cache.layout.num_pages), AuxPool(NUM_AUX_ROWS)
    backend = StateCapturingBackend(pool, aux, auto_want=True, polls_to_success=1)
    backend.kv_cache, backend.state_cache = kv_cache, runner.model.state  # type: ignore[attr-defined, union-attr]
    outcomes: list[Outcome] = []
    limits = EngineLimits(
        page_size=PAGE_SIZE,
        chunk_size=8,
        max_batch_tokens=24,
        max_running_requests=3,
        bootstrap_timeout_s=60.0,
        transfer_timeout_s=60.0,
    )
    engine = Engine(
        runner, backend, EngineKV(pool, aux, None), outcomes.append, limits, overlap=overlap
    )
    for room, (name, ids) in enumerate(PROMPTS.items(), start=1):
        engine.submit(PrefillRequest(name, ids, SamplingParams(), True, room, 0.0))
    for _ in range(2):  # the first chunks of three requests run; p1 is mid-prefill
        engine.step()
    engine.submit(AbortRequest(ABORTED))
    for _ in range(500):
        if not engine.step() and engine.load.num_live == 0:
            break
    engine.shutdown()
    engine.check_integrity()
    assert pool.num_free == pool.num_pages and aux.num_free == aux.num_rows
    return {o.request_id: o for o in outcomes}, backend


@pytest.mark.parametrize("overlap", [False, True])
def test_first_token_pages_and_state_match_transformers(checkpoint: Path, overlap: bool) -> None:
    model = hf_model(checkpoint)
    outcomes, backend = serve(checkpoint, overlap)
    assert outcomes[ABORTED].reason is FinishReason.ABORTED_BY_ROUTER
    assert sorted(outcomes) == sorted(PROMPTS)
    for name, ids in PROMPTS.items():
        if name == ABORTED:
            continue
        out, sender = outcomes[name], backend.senders[name]
        assert out.reason is FinishReason.OK, out
        with torch.no_grad():
            ref = model(torch.tensor([ids]), use_cache=True)
        assert out.first_token_id == int(ref.logits[0, -1].argmax()), name
        layers = ref.past_key_values.layers
        pages = [sender.captured[p] for p in sorted(sender.captured)]
        for pool_layer, layer in enumerate(FULL_LAYERS):
            for index, expected in ((0, layers[layer].keys), (1, layers[layer].values)):
                got = torch.cat([page[index][pool_layer] for page in pages])[: len(ids)]
                torch.testing.assert_close(got, expected[0].transpose(0, 1), atol=TOL, rtol=0)
        conv, recurrent = sender.end_state
        for slot_layer, layer in enumerate(LINEAR_LAYERS):
            expected_conv = layers[layer].conv_states[0][0, :, 1:]
            torch.testing.assert_close(conv[slot_layer], expected_conv, atol=TOL, rtol=0)
            expected_state = layers[layer].recurrent_states[0][0]
            torch.testing.assert_close(recurrent[slot_layer], expected_state, atol=TOL, rtol=0)


def config_of(checkpoint: Path, *settings: str):  # type: ignore[no-untyped-def]
    from prefill_worker.service.config import load_config

    root = Path(__file__).resolve().parents[3]
    overrides = [f"model.path={checkpoint}", "cache.num_pages=8", *settings]
    return load_config(root / "configs" / "tiny-test.yaml", env={}, overrides=overrides)


def test_check_config_sizes_the_state_pool(checkpoint: Path) -> None:
    """One slot per aux row; a slot is every linear layer's conv window and fp32 recurrent
    state: 3 layers × (108 channels × 3 taps × 4 bytes + 6 × 12 × 10 × 4 bytes) = 12528 bytes.
    The KV rows count the 2 full layers only."""
    from prefill_worker.service.checkmodel import check_model

    settings = ("cache.num_aux_rows=5", "model.dtype=float32", "cache.num_pages=128")
    check = check_model(config_of(checkpoint, *settings))
    assert not check.problems, check.problems
    state = [note for note in check.notes if note.startswith("state pool")]
    assert state == [
        "state pool (hybrid): 3 linear-attention layers, 2 full (the KV pool's); one slot per "
        "aux row: 5 slots × 12528 bytes (conv 108 × 3 float32, recurrent 6 × 12 × 10 float32, "
        "per layer) = 0.00 GiB; the prefix cache is off"
    ]
    assert any("bytes of KV per token (2 layers)" in note for note in check.notes)
    built = build(checkpoint, dtype="float32", num_pages=8, num_state_slots=5)
    assert built[0].model.state.num_bytes == 5 * 12528  # type: ignore[union-attr]
    settings = ("cache.num_aux_rows=5000", "model.dtype=float32", "parallel.tp_size=2")
    (state,) = [n for n in check_model(config_of(checkpoint, *settings)).notes if "state" in n]
    assert state.endswith(  # 5000 × 12528 bytes = 0.06 GiB; each rank half, rank 0 whole too
        "at tensor parallel 2 each rank's pool holds its heads, 0.03 GiB, and rank 0 also the "
        "whole slots it sends, 0.06 GiB more"
    )


def test_check_config_sizes_the_staging_for_sglang_decodes(checkpoint: Path) -> None:
    """With SGLang decodes, as many slots again in their layout, the conv in their dtype:
    3 layers × (108 × 3 × 2 bytes of bfloat16 + 6 × 10 × 12 × 4) = 10584 bytes a slot."""
    from prefill_worker.service.checkmodel import check_model

    settings = ("cache.num_aux_rows=5", "model.dtype=float32", "transfer.protocol=sglang")
    check = check_model(config_of(checkpoint, *settings, "cache.num_pages=128"))
    [state] = [note for note in check.notes if note.startswith("state pool")]
    assert state.endswith(
        "; SGLang decodes' staging of it (conv in bfloat16, transfer.sglang_mamba_conv_dtype): "
        "5 slots × 10584 bytes = 0.00 GiB more"
    )


def test_a_hybrid_model_gets_no_prefix_cache(checkpoint: Path) -> None:
    from prefill_worker.kv.cache_events import NullCacheEvents
    from prefill_worker.kv.prefix_cache import NoPrefixCache
    from prefill_worker.service.startup import make_prefix_cache

    config = config_of(checkpoint, "cache.prefix_caching=true")
    pages, events = PagePool(8), NullCacheEvents()
    assert isinstance(make_prefix_cache(config, pages, events, can_share=False), NoPrefixCache)
    assert not isinstance(make_prefix_cache(config, pages, events), NoPrefixCache)
