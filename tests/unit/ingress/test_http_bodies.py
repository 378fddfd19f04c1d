"""The HTTP front's reading of SGLang's request bodies and its answers' status codes, without
a server (the server itself: tests/integration/daemon/test_http_api.py)."""

from __future__ import annotations

import dataclasses
import json

import msgspec
import pytest

from prefill_worker.ingress.http import answers, bodies
from prefill_worker.ingress.http.bodies import BadRequest, Prompt
from prefill_worker.ingress.http.prompts import Admitter, is_front_id
from prefill_worker.ingress.validate import Limits
from prefill_worker.request import FinishReason, Outcome, SamplingParams

LIMITS = Limits(vocab_size=100, max_prompt_tokens=50, max_pool_tokens=64)
MAX_PROMPTS = 16


def read_generate(raw: bytes) -> tuple[list[Prompt], bool]:
    return bodies.read_generate(raw, MAX_PROMPTS)


def read_completion(raw: bytes) -> list[Prompt]:
    return bodies.read_completion(raw, MAX_PROMPTS)


def ids_of(prompt: Prompt) -> list[int]:
    assert prompt.token_ids is not None
    return msgspec.json.decode(prompt.token_ids)


def body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def test_one_prompt_with_the_routers_flags() -> None:
    prompts, is_batch = read_generate(
        body(
            input_ids=[1, 2, 3],
            sampling_params={"temperature": 0.5, "top_k": -1, "max_new_tokens": 9, "stop": ["x"]},
            return_logprob=True,
            bootstrap_host="10.0.0.1",
            bootstrap_port=8998,
            bootstrap_room=77,
            model="m",
            log_metrics=True,
            return_bytes=False,
        )
    )
    assert not is_batch
    [p] = prompts
    assert (ids_of(p), p.bootstrap_room, p.return_logprob) == ([1, 2, 3], 77, True)
    assert p.sampling == SamplingParams(temperature=0.5, top_p=1.0, top_k=0, seed=None)


def test_a_batch_takes_list_bootstrap_fields_and_per_prompt_sampling() -> None:
    prompts, is_batch = read_generate(
        body(
            input_ids=[[1], [2, 3]],
            bootstrap_room=[5, 6],
            sampling_params=[{"temperature": 0}, {"temperature": 1, "sampling_seed": 3}],
        )
    )
    assert is_batch
    assert [p.bootstrap_room for p in prompts] == [5, 6]
    assert prompts[1].sampling.seed == 3
    texts, _ = read_generate(body(text=["a", "b"], bootstrap_room=[1, 2]))
    assert [p.text for p in texts] == ["a", "b"]


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"input_ids": [1], "text": "a", "bootstrap_room": 1}, "missing_field"),
        ({"input_ids": [1]}, "missing_field"),
        ({"input_ids": [[1], [2]], "bootstrap_room": [1]}, "bad_field"),
        ({"input_ids": [[1], 2], "bootstrap_room": [1, 2]}, "bad_field"),
        ({"input_ids": [1.5], "bootstrap_room": 1}, "bad_field"),
        ({"input_ids": [1], "bootstrap_room": "x"}, "bad_field"),
        ({"input_ids": [1], "bootstrap_room": 1, "sampling_params": {"top_p": 0}}, "bad_sampling"),
        ({"input_ids": [1], "bootstrap_room": 1, "sampling_params": {"n": 2}}, "bad_sampling"),
        (
            {"input_ids": [1], "bootstrap_room": 1, "sampling_params": {"min_p": 0.1}},
            "bad_sampling",
        ),
        ({"input_ids": [1], "bootstrap_room": 1, "sampling_params": {"top_k": -2}}, "bad_sampling"),
    ],
)
def test_what_cannot_be_served_as_asked_is_a_bad_request(fields: dict, code: str) -> None:
    with pytest.raises(BadRequest) as refused:
        prompts, _ = read_generate(body(**fields))
        Admitter(LIMITS, codec=None).admit(prompts, 0.0)
    assert (refused.value.code, refused.value.status) == (code, 400)


@pytest.mark.parametrize(
    "ids",
    [["hello"], [1, "hello"], [[1], ["hello"]], [True], [[1], 2], "hello", {"a": 1}, [[[1]]]],
)
def test_token_ids_must_be_integers(ids: object) -> None:
    """``input_ids: ["hello"]`` was once read as a batch of texts and served."""
    with pytest.raises(BadRequest, match="integer token ids") as refused:
        prompts, _ = read_generate(body(input_ids=ids, bootstrap_room=1))
        Admitter(LIMITS, codec=Letters()).admit(prompts, 0.0)
    assert (refused.value.code, refused.value.status) == ("bad_field", 400)


@pytest.mark.parametrize("depth", [33, 1000])  # deeper ones hold too many values: 413
@pytest.mark.parametrize("where", ["unknown", "input_ids", "sampling"])
def test_deep_nesting_is_malformed_before_it_is_decoded(depth: int, where: str) -> None:
    nested = b"[" * depth + b"]" * depth
    fields = {
        "unknown": b'{"input_ids": [1], "bootstrap_room": 1, "extra": %s}',
        "input_ids": b'{"input_ids": %s, "bootstrap_room": 1}',
        "sampling": b'{"input_ids": [1], "bootstrap_room": 1, "sampling_params": {"x": %s}}',
    }[where]
    for read in (read_generate, read_completion):
        raw = (
            fields % nested
            if read is read_generate
            else fields.replace(b"input_ids", b"prompt") % nested
        )
        with pytest.raises(BadRequest, match="nested deeper than 32") as refused:
            read(raw)
        assert (refused.value.code, refused.value.status) == ("malformed", 400)


def test_brackets_and_quotes_inside_strings_are_text() -> None:
    text = '[[[[{{{{\\"' * 40  # 40 × 8 brackets, escaped quotes and backslashes
    [p] = read_completion(body(prompt=text, bootstrap_room=1, user=["]]]" * 50]))
    assert p.text == text
    deep_enough = {"a": [[[[[[[[[[1]]]]]]]]]]}  # 11 levels, within the bound
    read_generate(body(input_ids=[1], bootstrap_room=1, extra=deep_enough))


def test_a_batch_over_the_cap_is_429_and_too_many_values_413() -> None:
    over = [[1]] * (MAX_PROMPTS + 1)
    for raw in (body(input_ids=over, bootstrap_room=1), body(text=["a"] * 17, bootstrap_room=1)):
        with pytest.raises(BadRequest, match="a batch of 17 prompts") as refused:
            read_generate(raw)
        assert (refused.value.code, refused.value.status) == ("overloaded", 429)
    flood = body(input_ids=[1], bootstrap_room=1, extra=[[]] * bodies.max_values(MAX_PROMPTS))
    with pytest.raises(BadRequest, match="strings, arrays and objects") as refused:
        read_generate(flood)
    assert (refused.value.code, refused.value.status) == ("too_large", 413)
    with pytest.raises(BadRequest, match="empty batch"):
        read_generate(body(text=[], bootstrap_room=1))


def test_ids_and_text_are_bounded_by_size_before_they_are_built() -> None:
    admitter = Admitter(LIMITS, codec=Letters())
    for fields in ({"input_ids": [1] * 600}, {"text": "a" * 501}):  # JSON: 1,800 B; 501 B
        prompts, _ = read_generate(body(bootstrap_room=1, **fields))
        with pytest.raises(BadRequest, match="bytes") as refused:
            admitter.admit(prompts, 0.0)
        assert refused.value.code == "prompt_too_long"
    fits, _ = read_generate(body(text="a" * 50, bootstrap_room=1))  # 50 bytes, 50 tokens
    assert len(admitter.admit(fits, 0.0)[0].token_ids) == 50


def test_completions_prompt_forms() -> None:
    [p] = read_completion(body(prompt="hi", bootstrap_room=3, temperature=0, logprobs=2))
    assert (p.text, p.return_logprob, p.sampling.is_greedy) == ("hi", True, True)
    ids = read_completion(body(prompt=[[1, 2], [3]], bootstrap_room=[3, 4]))
    assert [ids_of(p) for p in ids] == [[1, 2], [3]]
    with pytest.raises(BadRequest):
        read_completion(body(prompt="hi", bootstrap_room=3, echo=True))


def test_admission_shares_the_ingress_prompt_rules() -> None:
    admitter = Admitter(LIMITS, codec=None)
    prompts, _ = read_generate(body(input_ids=[[1, 2], [3]], bootstrap_room=[8, 9]))
    requests = admitter.admit(prompts, arrival_time=1.0)
    assert [list(r.token_ids) for r in requests] == [[1, 2], [3]]
    assert all(is_front_id(r.request_id) for r in requests)
    assert len({r.request_id for r in requests}) == 2
    for ids, code in (([100], "token_out_of_range"), ([1] * 51, "prompt_too_long")):
        prompts, _ = read_generate(body(input_ids=ids, bootstrap_room=1))
        with pytest.raises(BadRequest) as refused:
            admitter.admit(prompts, 0.0)
        assert refused.value.code == code
    text, _ = read_generate(body(text="hello", bootstrap_room=1))
    with pytest.raises(BadRequest, match="no tokenizer"):
        admitter.admit(text, 0.0)
    assert not is_front_id("0a1b/req-1")  # a ZMQ ingress id


@pytest.mark.parametrize(
    ("reason", "status"),
    [
        (FinishReason.OK, 200),
        (FinishReason.DRAINING, 503),
        (FinishReason.PROMPT_TOO_LONG, 400),
        (FinishReason.BOOTSTRAP_TIMEOUT, 500),
        (FinishReason.PEER_LOST, 500),
        (FinishReason.ENGINE_ERROR, 500),
    ],
)
def test_outcome_status_is_what_the_router_acts_on(reason: FinishReason, status: int) -> None:
    ok = Outcome("http:0", FinishReason.OK.status, FinishReason.OK, 3, first_token_id=5)
    other = Outcome("http:1", reason.status, reason, 3)
    assert answers.status_of([ok, other]) == status


class Letters:
    """A ``TextCodec`` for answers: token t is the letter ``chr(97 + t % 26)``."""

    max_token_bytes = 10  # a text of more than 10 × max_prompt_tokens bytes cannot fit

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 97 for c in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(97 + t % 26) for t in token_ids)


def meta_of(outcome: Outcome, asked: answers.Asked, codec: Letters | None = None) -> dict:
    answer = answers.generate_body([outcome], [asked], codec, batch=False)
    assert isinstance(answer, dict)
    return answer["meta_info"]


def test_prompt_logprobs_are_read_checked_and_answered_as_sglang_does() -> None:
    prompts, _ = read_generate(
        body(
            input_ids=[[1, 2, 3, 4], [5, 6], [7, 8]],
            bootstrap_room=[1, 2, 3],
            return_logprob=[True, True, False],
            logprob_start_len=[1, 2, 0],  # the third is ignored without return_logprob
        )
    )
    assert [p.logprob_start_len for p in prompts] == [1, 2, None]
    requests = Admitter(LIMITS, codec=None).admit(prompts, 0.0)
    assert [r.prompt_logprob_start for r in requests] == [1, 2, None]
    outcome = Outcome(
        "http:0",
        FinishReason.OK.status,
        FinishReason.OK,
        4,
        first_token_id=9,
        first_token_logprob=-0.5,
        prompt_logprobs=(-1.25, -2.5),
    )
    asked = answers.Asked(True, "r", scored_ids=(2, 3, 4))
    meta = meta_of(outcome, asked)
    assert meta["input_token_logprobs"] == [[None, 2, None], [-1.25, 3, None], [-2.5, 4, None]]
    assert meta["output_token_logprobs"] == [[-0.5, 9, None]]
    texts = answers.Asked(True, "r", return_text_in_logprobs=True, scored_ids=(2, 3, 4))
    meta = meta_of(outcome, texts, Letters())
    assert [e[2] for e in meta["input_token_logprobs"]] == ["c", "d", "e"]
    assert meta["output_token_logprobs"] == [[-0.5, 9, "j"]]
    at_end = dataclasses.replace(outcome, prompt_logprobs=())  # logprob_start_len == length
    meta = meta_of(at_end, answers.Asked(True))
    assert meta["input_token_logprobs"] == []


@pytest.mark.parametrize("start", [-2, 3])
def test_prompt_logprobs_beyond_the_prompt_are_a_bad_request(start: int) -> None:
    prompts, _ = read_generate(
        body(input_ids=[1, 2], bootstrap_room=1, return_logprob=True, logprob_start_len=start)
    )
    with pytest.raises(BadRequest, match="logprob_start_len") as refused:
        Admitter(LIMITS, codec=None).admit(prompts, 0.0)
    assert refused.value.code == "bad_field"
    texts, _ = read_generate(
        body(input_ids=[1], bootstrap_room=1, return_logprob=True, return_text_in_logprobs=True)
    )
    with pytest.raises(BadRequest, match="tokenizer"):
        Admitter(LIMITS, codec=None).admit(texts, 0.0)
