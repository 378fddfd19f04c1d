"""TTFT through SGLang's PD router (smg) against our own router client, on one worker.

One run, one workload, two paths to the same worker process (its HTTP API front and its ZMQ
ingress both on, ``transfer.protocol=both``) and the reference decode peer (two peer
processes: one serving SGLang's decode HTTP API behind smg, one on its control socket):

    smg:     client ─HTTP─▶ smg ─▶ worker /generate  +  decode peer /generate   (bootstrap room)
             KV over SGLang's protocol, received by SGLang's own decode-side code
             (``decode_peer --sglang``, SGLang 0.5.23 from `make interop-deps`)
    native:  RouterClient ─ZMQ─▶ worker  +  DecodePeerClient ─ZMQ─▶ decode peer
             KV over the native protocol (our KVReceiver)

``--smg-kv native`` puts the smg path's KV on the native protocol too (the HTTP overhead
alone, without the protocol difference). On a machine with few cores, read the SGLang path's
number with care: SGLang's decode creates its NIXL agent with a progress thread (NIXL's
default), which polls UCX on a core of its own all the time (about 0.5-0.8 of a core on a
2-core box), and so slows the worker sharing those cores; the native peer drives its agent from
its own loop.

A request's TTFT is from the client's send until the decode holds the first token (and the
prompt's KV): ``max_new_tokens`` 1, so the decode answers as soon as the KV has landed. The
paths alternate request by request at low load (one at a time). Prints one JSON line:
``{"name": "sglang_pd", "ttft_p50_s", "ttft_p50_native_s", "overhead"}``; the goal is
``overhead`` <= 0.10. Needs `make setup` (SmolLM2), `make smg` and `make interop-deps`.

    python bench/sglang_pd.py [--num-requests 30] [--prompt-tokens 256] [--smg-kv native]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prefill_worker.ingress.client import RouterClient  # noqa: E402
from prefill_worker.testing.launch import ChildProcess, free_port  # noqa: E402
from prefill_worker.testing.peer_control import DecodePeerClient  # noqa: E402
from prefill_worker.testing.sglang_env import InteropMissing, sglang_env  # noqa: E402

SMG = ROOT / ".interop" / "smg" / "bin" / "smg"
MODEL = ROOT / "models" / "smollm2-135m"
NAME = "smollm2"


def post(url: str, body: dict[str, object]) -> dict[str, object]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        answer: dict[str, object] = json.loads(response.read())
        return answer


def smg_ttft(router: str, ids: list[int]) -> float:
    sent = time.monotonic()
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
    answer = post(f"{router}/generate", body)
    assert answer["output_ids"], answer
    return time.monotonic() - sent


async def native_ttft(router: RouterClient, decode: DecodePeerClient, ids: list[int]) -> float:
    room = random.getrandbits(63)
    sent = time.monotonic()
    generation = asyncio.ensure_future(decode.generate(room, ids, 1))
    result = await router.prefill(ids, room, timeout_s=120)
    assert result.first_token_id is not None and (await generation).is_ok, result
    return time.monotonic() - sent


def start_all(tmp: Path, smg_kv: str) -> tuple[list[ChildProcess], str, str, str]:
    ingress, bootstrap = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    sglang_bootstrap = f"127.0.0.1:{free_port()}"
    api, decode_http, router_port = free_port(), free_port(), free_port()
    control = f"tcp://127.0.0.1:{free_port()}"
    worker = [sys.executable, "-m", "prefill_worker", "serve", "configs/default.yaml"]
    for flag in (
        f"ingress.bind={ingress}",
        f"transfer.bootstrap_bind={bootstrap}",
        "transfer.protocol=both",
        f"transfer.sglang_bootstrap_bind={sglang_bootstrap}",
        f"metrics.bind=127.0.0.1:{free_port()}",
        "http_api.enabled=true",
        f"http_api.bind=127.0.0.1:{api}",
        f"http_api.served_model_name={NAME}",
    ):
        worker += ["--set", flag]
    procs = [ChildProcess.start("worker", worker, tmp, cwd=ROOT)]
    procs[0].wait_ready(600)
    peer = [sys.executable, "-m", "prefill_worker.testing.decode_peer", "--model", str(MODEL)]
    peer += ["--dtype", "float32", "--attention-backend", "sdpa", "--num-threads", "1"]
    http = ["--http", f"127.0.0.1:{decode_http}", "--served-model-name", NAME]
    if smg_kv == "sglang":  # SGLang's decode-side code receives the smg path's KV
        http_peer, env = [*http, "--sglang", "--bootstrap", sglang_bootstrap], sglang_env(ROOT)
        smg_bootstrap_port = sglang_bootstrap.rpartition(":")[2]
    else:
        http_peer, env = [*http, "--bootstrap", bootstrap], None
        smg_bootstrap_port = bootstrap.rpartition(":")[2]
    for serving, peer_env in (
        (http_peer, env),
        (["--bootstrap", bootstrap, "--bind", control], None),
    ):
        procs.insert(
            0, ChildProcess.start("decode-peer", peer + serving, tmp, cwd=ROOT, env=peer_env)
        )
        procs[0].wait_ready(600)
    smg = [str(SMG), "launch", "--pd-disaggregation", "--host", "127.0.0.1"]
    smg += ["--port", str(router_port), "--prometheus-port", str(free_port())]
    smg += ["--prefill", f"http://127.0.0.1:{api}", smg_bootstrap_port]
    smg += ["--decode", f"http://127.0.0.1:{decode_http}", "--policy", "round_robin"]
    smg += ["--worker-startup-check-interval", "1", "--log-level", "warn"]
    procs.insert(0, ChildProcess.start("smg", smg, tmp, cwd=ROOT))
    router = f"http://127.0.0.1:{router_port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{router}/workers", timeout=2) as response:
                if len(json.loads(response.read())["workers"]) == 2:
                    return procs, router, ingress, control
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit("smg did not register the worker and the decode peer")


async def measure(
    router: str, ingress: str, control: str, prompts: list[list[int]]
) -> tuple[list[float], list[float]]:
    client, decode = RouterClient(ingress), DecodePeerClient(control)
    loop = asyncio.get_running_loop()
    try:
        await decode.ping(timeout_s=30)
        # Each path gets prompts of its own: the worker's prefix cache would serve the second
        # path's copy of a prompt from the first one's pages.
        pairs = list(zip(prompts[0::2], prompts[1::2], strict=True))
        for smg_ids, native_ids in pairs[:2]:  # warm-up, both paths
            await loop.run_in_executor(None, smg_ttft, router, smg_ids)
            await native_ttft(client, decode, native_ids)
        via_smg, native = [], []
        for smg_ids, native_ids in pairs[2:]:
            via_smg.append(await loop.run_in_executor(None, smg_ttft, router, smg_ids))
            native.append(await native_ttft(client, decode, native_ids))
        return via_smg, native
    finally:
        client.close()
        decode.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=30)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument(
        "--smg-kv",
        choices=("sglang", "native"),
        default="sglang",
        help="the protocol of the smg path's KV (default: SGLang's, as an SGLang decode)",
    )
    args = parser.parse_args()
    if not (MODEL / "config.json").exists() or not SMG.exists():
        print("needs `make setup` (the default model) and `make smg`", file=sys.stderr)
        return 1
    if args.smg_kv == "sglang":
        try:
            sglang_env(ROOT)
        except InteropMissing as exc:
            print(f"{exc} (or --smg-kv native)", file=sys.stderr)
            return 1
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, 49000) for _ in range(args.prompt_tokens)]
        for _ in range(2 * (args.num_requests + 2))
    ]
    with tempfile.TemporaryDirectory(prefix="bench-sglang-") as tmp:
        procs, router, ingress, control = start_all(Path(tmp), args.smg_kv)
        try:
            via_smg, native = asyncio.run(measure(router, ingress, control, prompts))
        finally:
            codes = [proc.stop() for proc in procs]
    p50, p50_native = statistics.median(via_smg), statistics.median(native)
    row = {
        "name": "sglang_pd",
        "ttft_p50_s": round(p50, 4),
        "ttft_p50_native_s": round(p50_native, 4),
        "overhead": round(p50 / p50_native - 1, 3),
        "num_requests": len(via_smg),
        "prompt_tokens": args.prompt_tokens,
        "smg_kv": args.smg_kv,
    }
    print(json.dumps(row))
    return 0 if all(code == 0 for code in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
