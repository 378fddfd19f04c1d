"""`make run-sglang`: the worker behind SGLang's real PD router (smg), as a user sees it.

Starts the worker (``configs/default.yaml``, SmolLM2-135M-Instruct, with its HTTP API front
and SGLang's PD protocol, ``transfer.protocol=sglang``), the reference decode peer in its
SGLang mode (SGLang's own decode-side transfer code receives the KV; SGLang 0.5.23 from
`make interop-deps`) serving SGLang's decode HTTP API, and smg in PD mode in front of both,
given the worker's SGLang bootstrap port as an SGLang prefill's; sends a few chat prompts to
smg's ``/generate`` as text, and prints each answer with its timings. Then stops the three
with SIGTERM and checks they exit 0. ``--kv native``: the same over the native protocol.

    python scripts/demo_sglang.py [--max-new-tokens 48] [--kv native]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from demo import PROMPTS, _missing, _wait_ready, _worker_args  # noqa: E402

from prefill_worker.service.config import load_config  # noqa: E402
from prefill_worker.testing.launch import ChildProcess, LaunchError, free_port  # noqa: E402
from prefill_worker.testing.sglang_env import InteropMissing, sglang_env  # noqa: E402
from tests.polling import wait_until  # noqa: E402

SMG = ROOT / ".interop" / "smg" / "bin" / "smg"
MODEL_NAME = "smollm2-135m"


def post(url: str, body: dict[str, object]) -> dict[str, object]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        answer: dict[str, object] = json.loads(response.read())
        return answer


def num_workers(router: str) -> int:
    try:
        with urllib.request.urlopen(f"{router}/workers", timeout=2) as response:
            return len(json.loads(response.read()).get("workers", []))
    except OSError:
        return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--kv", choices=("sglang", "native"), default="sglang")
    args = parser.parse_args()
    config = load_config(ROOT / args.config)
    model = ROOT / config.model.path
    if not (model / "config.json").exists():
        return _missing(model)
    if not SMG.exists():
        print(f"{SMG} is missing: run `make smg`", file=sys.stderr)
        return 1
    try:
        peer_env = sglang_env(ROOT) if args.kv == "sglang" else None
    except InteropMissing as exc:
        print(f"{exc} (or --kv native)", file=sys.stderr)
        return 1
    sglang_bootstrap = f"127.0.0.1:{free_port()}"
    ingress, bootstrap = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    metrics, api, decode, router_port = (free_port() for _ in range(4))
    router = f"http://127.0.0.1:{router_port}"
    how = "SGLang's PD protocol" if peer_env else "the native protocol"
    print(f"== prefill-worker behind smg: {config.model.path} ({config.model.dtype}, CPU)")
    print(f"== the KV goes over {how}")
    with tempfile.TemporaryDirectory(prefix="prefill-sglang-") as tmp:
        worker_args = _worker_args(args.config, ingress, bootstrap, f"127.0.0.1:{metrics}")
        worker_args += ["--set", "http_api.enabled=true"]
        worker_args += ["--set", f"http_api.bind=127.0.0.1:{api}"]
        worker_args += ["--set", f"http_api.served_model_name={MODEL_NAME}"]
        if peer_env is not None:
            worker_args += ["--set", "transfer.protocol=sglang"]
            worker_args += ["--set", f"transfer.sglang_bootstrap_bind={sglang_bootstrap}"]
        procs: list[ChildProcess] = []
        try:
            print("== starting the worker (loading the model)")
            procs.append(ChildProcess.start("worker", worker_args, Path(tmp), cwd=ROOT))
            _wait_ready(procs[0])
            print("== starting the decode peer (SGLang's decode HTTP API, same model)")
            peer_args = [sys.executable, "-m", "prefill_worker.testing.decode_peer"]
            peer_args += ["--model", str(model)]
            peer_args += ["--bootstrap", sglang_bootstrap if peer_env else bootstrap]
            peer_args += ["--sglang"] if peer_env else []
            peer_args += ["--http", f"127.0.0.1:{decode}", "--served-model-name", MODEL_NAME]
            peer_args += ["--dtype", config.model.dtype, "--page-size", str(config.cache.page_size)]
            peer_args += ["--attention-backend", "sdpa", "--num-threads", "1"]
            peer = ChildProcess.start("decode-peer", peer_args, Path(tmp), cwd=ROOT, env=peer_env)
            procs.insert(0, peer)
            _wait_ready(procs[0])
            print(f"== starting smg (PD mode, round robin) on {router}")
            smg_args = [str(SMG), "launch", "--pd-disaggregation", "--host", "127.0.0.1"]
            smg_args += ["--port", str(router_port), "--prometheus-port", str(free_port())]
            smg_bootstrap = sglang_bootstrap if peer_env else bootstrap
            smg_args += ["--prefill", f"http://127.0.0.1:{api}", smg_bootstrap.rpartition(":")[2]]
            smg_args += ["--decode", f"http://127.0.0.1:{decode}", "--policy", "round_robin"]
            smg_args += ["--worker-startup-check-interval", "1", "--log-level", "warn"]
            procs.insert(0, ChildProcess.start("smg", smg_args, Path(tmp), cwd=ROOT))
            wait_until(lambda: num_workers(router) == 2, 60, "smg to register both servers")
            converse(router, model, args.max_new_tokens)
        except (LaunchError, AssertionError) as exc:
            raise SystemExit(str(exc)) from None
        finally:
            print("\n== stopping (SIGTERM): smg, the decode peer, then the worker")
            codes = {proc.name: proc.stop() for proc in procs}
            for name, code in codes.items():
                print(f"  {name} exited with {code}")
    return 0 if all(code == 0 for code in codes.values()) else 1


def converse(router: str, model: Path, max_new: int) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    print(f"== a warm-up request, then {len(PROMPTS)} chat prompts through smg, one at a time")
    params = {"temperature": 0, "max_new_tokens": max_new}
    post(f"{router}/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 2}})
    for question in PROMPTS:
        chat = [{"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        sent = time.monotonic()
        ttft = post(f"{router}/generate", {"text": text, "sampling_params": {"max_new_tokens": 1}})
        ttft_s = time.monotonic() - sent
        sent = time.monotonic()
        answer = post(f"{router}/generate", {"text": text, "sampling_params": params})
        total_s = time.monotonic() - sent
        meta = answer["meta_info"]
        assert isinstance(meta, dict) and isinstance(ttft, dict)
        print(f"\nQ: {question}")
        print(f"A: {str(answer['text']).strip()}")
        print(
            f"   {meta['prompt_tokens']} prompt tokens | TTFT {ttft_s * 1e3:.0f} ms through smg"
            f" | {meta['completion_tokens']} tokens in {total_s * 1e3:.0f} ms"
            f" (KV landed after {meta['kv_wait_s'] * 1e3:.0f} ms,"
            f" decode {meta['decode_s'] * 1e3:.0f} ms)"
        )


if __name__ == "__main__":
    sys.exit(main())
