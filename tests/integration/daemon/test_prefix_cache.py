"""The prefix cache through the whole worker process (router → worker → NIXL → decode):
every K/V page that lands at the decode peer, and the first token, match ``transformers``
with the cache off, with partial and whole-prompt hits, with a hit taken while the same
prefix is still being computed, and with a prefix the decode peer holds itself. The result
and the aux row say how much was computed and how much came from the cache; the prefix-cache
counters on /metrics add up."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from prefill_worker.ingress.client import BlockingRouterClient
from prefill_worker.ingress.messages import Result
from prefill_worker.transfer import RoomState
from tests.checkpoints import prompt
from tests.integration.daemon.conftest import PAGE_SIZE, Decode, Worker
from tests.integration.daemon.test_daemon import hf_reference
from tests.patience import patient

A = prompt(45, seed=701)
E = prompt(64, seed=702)


def counter(worker: Worker, name: str) -> float:
    status, text = worker.http("/metrics")
    assert status == 200
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    assert found, name
    return float(found.group(1))


def serve_one(
    router: BlockingRouterClient,
    decode: Decode,
    room: int,
    ids: list[int],
    num_cached_tokens: int = 0,
) -> Result:
    decode.want(room, len(ids), num_cached_tokens)
    with ThreadPoolExecutor(1) as pool:  # the decode side is driven here meanwhile
        future = pool.submit(router.prefill, ids, room, timeout_s=60)
        assert decode.wait([room])[room].state is RoomState.DONE
        return future.result(timeout=patient(60))


def check_landed(
    decode: Decode,
    checkpoint: Path,
    room: int,
    ids: list[int],
    result: Result,
    num_cached_tokens: int = 0,
) -> None:
    """First token, the computed/cached split in the result and aux row, and every landed
    page (positions from ``num_cached_tokens`` on) against the reference."""
    first_token, hf_kv = hf_reference(checkpoint, ids)
    assert result.first_token_id == first_token
    assert result.num_computed_tokens + result.num_prefix_hit_tokens == len(ids)
    aux = decode.receiver.read_aux(decode.rooms[room][1])
    assert (aux.first_token_id, aux.num_cached_tokens) == (first_token, num_cached_tokens)
    assert aux.num_computed_tokens == result.num_computed_tokens
    assert aux.num_prefix_hit_tokens == result.num_prefix_hit_tokens
    for layer, (k_ref, v_ref) in enumerate(hf_kv):
        k, v = decode.kv(room, len(ids) - num_cached_tokens, layer)
        torch.testing.assert_close(k, k_ref[num_cached_tokens:], atol=1e-4, rtol=0)
        torch.testing.assert_close(v, v_ref[num_cached_tokens:], atol=1e-4, rtol=0)


def test_landed_pages_match_transformers_with_prefix_hits(
    shared_worker, router_factory, checkpoint
) -> None:
    """The shared worker runs configs/tiny-test.yaml: the cache is on (the default)."""
    worker = shared_worker
    queries = counter(worker, "prefill_worker_prefix_cache_queries_total")
    hits = counter(worker, "prefill_worker_prefix_cache_hits_total")
    decode, router = Decode(worker.bootstrap), router_factory(worker.ingress)
    cases = [  # room, prompt, tokens its hit must be
        (701, A, 0),
        (702, [*A[:26], *prompt(19, seed=703)], 24),  # partial
        (703, A[:44], 40),  # every page cached: the last page is computed again
        (704, A, 44),  # every full page cached: only the last token is computed
    ]
    for room, ids, hit in cases:
        result = serve_one(router, decode, room, ids)
        assert result.num_prefix_hit_tokens == hit, (room, result)
        check_landed(decode, checkpoint, room, ids, result)
    # Sent back to back: the second may hit only what the first had finished computing.
    f_ids = [*E[:48], *prompt(7, seed=704)]
    decode.want(705, len(E))
    decode.want(706, len(f_ids))
    with ThreadPoolExecutor(2) as pool:
        futures = {
            705: pool.submit(router.prefill, E, 705),
            706: pool.submit(router.prefill, f_ids, 706),
        }
        assert all(s.state is RoomState.DONE for s in decode.wait([705, 706]).values())
        concurrent = {room: f.result(timeout=patient(60)) for room, f in futures.items()}
    check_landed(decode, checkpoint, 705, E, concurrent[705])
    check_landed(decode, checkpoint, 706, f_ids, concurrent[706])
    assert concurrent[706].num_prefix_hit_tokens <= 48
    # The decode peer holds 8 tokens, the worker 44 of A: 2 new tokens computed, 11 pages sent.
    g_ids = [*A, *prompt(2, seed=705)]
    result = serve_one(router, decode, 707, g_ids, num_cached_tokens=8)
    assert (result.num_prefix_hit_tokens, result.num_cached_tokens) == (44, 8)
    check_landed(decode, checkpoint, 707, g_ids, result, num_cached_tokens=8)
    all_results = [*concurrent.values(), result]
    num_hits = 24 + 40 + 44 + sum(r.num_prefix_hit_tokens for r in all_results)
    num_queries = sum(len(ids) for _, ids, _ in cases) + len(E) + len(f_ids) + len(g_ids)
    assert counter(worker, "prefill_worker_prefix_cache_queries_total") == queries + num_queries
    assert counter(worker, "prefill_worker_prefix_cache_hits_total") == hits + num_hits
    assert counter(worker, "prefill_worker_prefix_cache_pages") > 0
    decode.close()


def test_the_switch_turns_the_cache_off(worker_factory, router_factory, checkpoint) -> None:
    worker = worker_factory("cache.prefix_caching=false")
    decode, router = Decode(worker.bootstrap), router_factory(worker.ingress)
    for room in (801, 802):  # the same prompt twice: computed twice
        result = serve_one(router, decode, room, A)
        assert (result.num_prefix_hit_tokens, result.num_computed_tokens) == (0, len(A))
        check_landed(decode, checkpoint, room, A, result)
    assert counter(worker, "prefill_worker_prefix_cache_queries_total") == 0
    assert counter(worker, "prefill_worker_prefix_cache_pages") == 0
    decode.close()


assert PAGE_SIZE == 4  # the hits above are counted in pages of 4 tokens
