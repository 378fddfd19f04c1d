"""`make run`: the whole path as a user sees it, on the default model (SmolLM2-135M-Instruct).

Starts the worker (``prefill-worker serve configs/default.yaml``) and the reference decode
peer as two processes, tokenizes a few chat prompts with the model's own tokenizer, sends
each through ``RouterClient`` (the decode peer is told the same bootstrap room, as a router
would), and prints every answer with its time to first token, prefill and transfer times and
the transfer rate. Then it stops both processes with SIGTERM and checks they exit 0.

    python scripts/demo.py [--config configs/default.yaml] [--max-new-tokens 48]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prefill_worker.ingress import RouterClient  # noqa: E402
from prefill_worker.ingress.messages import Result  # noqa: E402
from prefill_worker.service.config import load_config  # noqa: E402
from prefill_worker.testing.decode_peer import Generation  # noqa: E402
from prefill_worker.testing.launch import ChildProcess, LaunchError, free_port  # noqa: E402
from prefill_worker.testing.peer_control import DecodePeerClient  # noqa: E402

PROMPTS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the ocean.",
    "What color is the sky on a clear day?",
)


def chat_ids(tokenizer: object, question: str) -> list[int]:
    """The token ids of ``question`` as a one-turn chat, ready for the assistant's answer."""
    from transformers import PreTrainedTokenizerBase

    assert isinstance(tokenizer, PreTrainedTokenizerBase)
    chat = [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass(frozen=True)
class Answer:
    question: str
    prompt_ids: tuple[int, ...]
    result: Result
    generation: Generation
    ttft_s: float


async def ask(
    router: RouterClient, decode: DecodePeerClient, question: str, ids: list[int], max_new: int
) -> Answer:
    room = random.getrandbits(63)
    sent_at = time.monotonic()
    generation = asyncio.ensure_future(decode.generate(room, ids, max_new))
    result = await router.prefill(ids, room, timeout_s=120)
    ttft_s = time.monotonic() - sent_at
    return Answer(question, tuple(ids), result, await generation, ttft_s)


async def ask_all(
    ingress: str, control: str, prompts: list[tuple[str, list[int]]], max_new: int
) -> list[Answer]:
    """One warm-up request (the first forward pays one-off costs), then each prompt alone, so
    every time to first token is that prompt's own."""
    router, decode = RouterClient(ingress), DecodePeerClient(control)
    try:
        await decode.ping(timeout_s=30)
        await ask(router, decode, "warm-up", prompts[0][1], 16)
        return [await ask(router, decode, q, ids, max_new) for q, ids in prompts]
    finally:
        router.close()
        decode.close()


def report(answer: Answer, tokenizer: object, kv_bytes_per_token: int, page_size: int) -> None:
    from transformers import PreTrainedTokenizerBase

    assert isinstance(tokenizer, PreTrainedTokenizerBase)
    result, gen = answer.result, answer.generation
    print(f"\nQ: {answer.question}")
    if result.error or not gen.is_ok:
        print(f"A: (failed: {result.error or gen.error})")
        return
    text = tokenizer.decode(list(gen.token_ids), skip_special_tokens=True).strip()
    num_pages = -(-len(answer.prompt_ids) // page_size)
    kv_bytes = num_pages * page_size * kv_bytes_per_token
    t = result.timings
    rate = kv_bytes / t.transfer_s / 1e9 if t.transfer_s > 0 else float("nan")
    decode_tok_s = (len(gen.token_ids) - 1) / gen.decode_s if gen.decode_s > 0 else float("nan")
    print(f"A: {text}")
    print(
        f"   {len(answer.prompt_ids)} prompt tokens | TTFT {answer.ttft_s * 1e3:.0f} ms"
        f" (queue {t.queue_s * 1e3:.0f}, bootstrap {t.bootstrap_s * 1e3:.0f},"
        f" prefill {t.prefill_s * 1e3:.0f}, transfer {t.transfer_s * 1e3:.1f} ms)"
        f" | KV {kv_bytes / 1e6:.2f} MB at {rate:.2f} GB/s"
        f" | {len(gen.token_ids)} tokens decoded at {decode_tok_s:.1f} tok/s"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument(
        "--answers-json", type=Path, help="also write each prompt's and answer's token ids here"
    )
    args = parser.parse_args()
    config = load_config(ROOT / args.config)
    model = ROOT / config.model.path
    if not (model / "config.json").exists():
        return _missing(model)
    ingress, bootstrap = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    control, metrics = f"tcp://127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    print(f"== prefill-worker demo: {config.model.path} ({config.model.dtype}, CPU)")
    with tempfile.TemporaryDirectory(prefix="prefill-demo-") as tmp:
        worker_args = _worker_args(args.config, ingress, bootstrap, metrics)
        worker = ChildProcess.start("worker", worker_args, Path(tmp), cwd=ROOT)
        procs = [worker]
        try:
            print("== starting the worker (loading the model)")
            _wait_ready(worker)
            peer_args = _peer_args(config, str(model), bootstrap, control)
            procs.insert(0, ChildProcess.start("decode-peer", peer_args, Path(tmp), cwd=ROOT))
            print("== starting the decode peer (loading the same model, registering its KV pool)")
            _wait_ready(procs[0])
            answers = _converse(config, model, ingress, control, args.max_new_tokens)
            if args.answers_json:
                _write_answers(args.answers_json, answers)
        except LaunchError as exc:
            raise SystemExit(str(exc)) from None
        finally:
            print("\n== stopping (SIGTERM): decode peer first, then the worker")
            codes = {proc.name: proc.stop() for proc in procs}
            for name, code in codes.items():
                print(f"  {name} exited with {code}")
    return 0 if all(code == 0 for code in codes.values()) else 1


def _wait_ready(child: ChildProcess) -> None:
    """Show the child's log while it starts (model loading takes a while); return on READY=1."""
    started = time.monotonic()

    def show(line: str) -> None:
        print(f"  [{time.monotonic() - started:5.1f} s] {child.name} | {line[:140]}")

    child.wait_ready(600, on_log_line=show)
    for line in child.new_log_lines():
        show(line)
    print(f"  [{time.monotonic() - started:5.1f} s] {child.name} ready")


def _write_answers(path: Path, answers: list[Answer]) -> None:
    rows = [
        {
            "question": a.question,
            "prompt_ids": list(a.prompt_ids),
            "token_ids": list(a.generation.token_ids),
            "error": a.result.error or a.generation.error,
        }
        for a in answers
    ]
    path.write_text(json.dumps(rows, indent=1) + "\n")


def _converse(
    config: object, model: Path, ingress: str, control: str, max_new: int
) -> list[Answer]:
    from transformers import AutoTokenizer

    from prefill_worker.model.hf_config import read_spec
    from prefill_worker.service.config import Config

    assert isinstance(config, Config)
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [(question, chat_ids(tokenizer, question)) for question in PROMPTS]
    print(f"== sending a warm-up request, then {len(prompts)} chat prompts one at a time")
    answers = asyncio.run(ask_all(ingress, control, prompts, max_new))
    spec = read_spec(model)
    itemsize = 2 if config.model.dtype in ("bfloat16", "float16") else 4
    kv_bytes_per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * itemsize
    for answer in answers:
        report(answer, tokenizer, kv_bytes_per_token, config.cache.page_size)
    return answers


def _worker_args(config: str, ingress: str, bootstrap: str, metrics: str) -> list[str]:
    args = [sys.executable, "-m", "prefill_worker", "serve", config]
    for flag in (
        f"ingress.bind={ingress}",
        f"transfer.bootstrap_bind={bootstrap}",
        f"metrics.bind={metrics}",
    ):
        args += ["--set", flag]
    return args


def _peer_args(config: object, model: str, bootstrap: str, control: str) -> list[str]:
    from prefill_worker.service.config import Config

    assert isinstance(config, Config)
    dtype = config.model.dtype
    return [
        sys.executable, "-m", "prefill_worker.testing.decode_peer",
        "--model", model, "--bootstrap", bootstrap, "--bind", control,
        "--dtype", dtype, "--page-size", str(config.cache.page_size), "--num-pages", "1024",
        "--attention-backend", "sdpa",
        "--num-threads", "1",  # decode steps are tiny: one thread, robust to busy cores
    ]  # fmt: skip


def _missing(model: Path) -> int:
    print(f"{model} is missing: run `make setup` (it converts the default model)", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
