"""Restart matrix through smg: how soon a restarted worker serves clients again.

One stack per protocol, as tests/smg builds it: the worker (``prefill-worker serve`` on
configs/tiny-test.yaml, a tiny random Llama, its HTTP API front behind smg), the reference
decode peer behind smg (``--sglang``: SGLang 0.5.23's own decode-side code with SGLang's
default heartbeat, every 5 s, two misses; ``native``: the native decode SDK,
``transfer/decode/``), and smg 1.13 with its defaults. For each signal (SIGKILL, SIGTERM)
and downtime (0, 5, 15 s) the worker is signalled, and a warm spare of it (imported in
advance: ``testing/spare.py``) starts on the same ports the downtime after it exited. From
the moment it is ready a client sends greedy requests through smg, one at a time, until one
succeeds, then ``--after`` more. One JSON line per case:

    {"name": "restart", "protocol", "signal", "down_s", "rank_port", "rejoin_s",
     "ready_to_first_ok_s", "failed_before_first_ok", "after_ok", "after_failed"}

The goal: ``ready_to_first_ok_s`` <= 20 and ``after_failed`` == 0 (docs/reliability.md).

    python bench/restart.py [--protocols sglang native] [--signals KILL TERM]
        [--downs 0 5 15] [--rank-port random|fixed] [--after 10]
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prefill_worker.testing.launch import ChildProcess, free_port  # noqa: E402
from prefill_worker.testing.sglang_env import sglang_env  # noqa: E402
from prefill_worker.testing.spare import WAITING  # noqa: E402
from tests.checkpoints import make_checkpoint, prompt  # noqa: E402
from tests.integration.daemon.conftest import Worker, start_worker  # noqa: E402

SMG = ROOT / ".interop" / "smg" / "bin" / "smg"
NAME = "tiny"
SGLANG_DEFAULT_HEARTBEAT = {
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "5",
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
}


@dataclass
class Ports:
    api: int
    sglang: int
    native: int
    rank: int  # 0: a random control port each run


def worker_settings(protocol: str, ports: Ports, rejoin_s: float) -> list[str]:
    settings = [
        "http_api.enabled=true",
        f"http_api.bind=127.0.0.1:{ports.api}",
        f"http_api.served_model_name={NAME}",
        f"transfer.bootstrap_bind=tcp://127.0.0.1:{ports.native}",
    ]
    if protocol == "sglang":
        settings += [
            "transfer.protocol=sglang",
            f"transfer.sglang_bootstrap_bind=127.0.0.1:{ports.sglang}",
            f"transfer.sglang_rank_port={ports.rank}",
            f"transfer.sglang_rejoin_s={rejoin_s}",
        ]
    return settings


def spare(workdir: Path, checkpoint: Path, settings: list[str]) -> Worker:
    workdir.mkdir(parents=True)
    worker = start_worker(workdir, checkpoint, *settings, module="prefill_worker.testing.spare")
    deadline = time.monotonic() + 120
    while WAITING not in worker.child.log_tail():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the spare did not import in 120 s:\n{worker.log()}")
        time.sleep(0.05)
    return worker


def serve(worker: Worker) -> float:
    """Start the spare; the moment it is ready."""
    worker.proc.send_signal(signal.SIGUSR1)
    worker.child.wait_ready(120)
    return time.monotonic()


def start_peer(
    workdir: Path, checkpoint: Path, protocol: str, ports: Ports
) -> tuple[ChildProcess, int]:
    port = free_port()
    args = [sys.executable, "-m", "prefill_worker.testing.decode_peer"]
    args += ["--model", str(checkpoint), "--http", f"127.0.0.1:{port}"]
    env = None
    if protocol == "sglang":
        env = {**sglang_env(ROOT), **SGLANG_DEFAULT_HEARTBEAT}
        args += ["--sglang", "--bootstrap", f"127.0.0.1:{ports.sglang}"]
    else:
        args += ["--bootstrap", f"tcp://127.0.0.1:{ports.native}"]
    args += ["--served-model-name", NAME, "--dtype", "float32", "--page-size", "4"]
    args += ["--num-pages", "512", "--attention-backend", "sdpa", "--num-threads", "1"]
    args += ["--ignore-eos"]
    child = ChildProcess.start("decode-peer", args, workdir, cwd=ROOT, env=env)
    child.wait_ready(180)
    return child, port


def start_smg(workdir: Path, protocol: str, ports: Ports, decode_port: int) -> tuple[Any, str]:
    port = free_port()
    bootstrap = ports.sglang if protocol == "sglang" else ports.native
    args = [str(SMG), "launch", "--pd-disaggregation", "--host", "127.0.0.1"]
    args += ["--port", str(port), "--prometheus-port", str(free_port())]
    args += ["--prefill", f"http://127.0.0.1:{ports.api}", str(bootstrap)]
    args += ["--decode", f"http://127.0.0.1:{decode_port}", "--policy", "round_robin"]
    args += ["--worker-startup-check-interval", "1", "--log-level", "warn"]
    return ChildProcess.start("smg", args, workdir, cwd=ROOT), f"http://127.0.0.1:{port}"


def generate(router: str, ids: list[int], timeout_s: float = 120.0) -> bool:
    body = {
        "model": NAME,
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": 4},
    }
    request = urllib.request.Request(
        f"{router}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status == 200 and len(json.loads(response.read())["output_ids"]) == 4
    except (urllib.error.URLError, TimeoutError, ConnectionError, KeyError, ValueError):
        return False


def first_ok(router: str, since: float, give_up_s: float) -> tuple[float | None, int]:
    """Requests one at a time until one succeeds: (seconds from ``since``, failures before)."""
    failures = 0
    while time.monotonic() - since < give_up_s:
        if generate(router, prompt(24, seed=failures)):
            return time.monotonic() - since, failures
        failures += 1
        time.sleep(0.2)  # a client's pace, not a synchronisation
    return None, failures


def run_protocol(protocol: str, args: argparse.Namespace, tmp: Path, checkpoint: Path) -> None:
    rank = free_port() if args.rank_port == "fixed" else 0
    ports = Ports(free_port(), free_port(), free_port(), rank)
    settings = worker_settings(protocol, ports, args.rejoin_s)
    runs = iter(range(1000))
    worker = spare(tmp / f"{protocol}-{next(runs)}", checkpoint, settings)
    children: list[ChildProcess] = [worker.child]
    try:
        serve(worker)
        peer, decode_port = start_peer(tmp, checkpoint, protocol, ports)
        smg, router = start_smg(tmp, protocol, ports, decode_port)
        children += [peer, smg]
        if first_ok(router, time.monotonic(), 120)[0] is None:
            raise RuntimeError(f"the stack never served:\n{smg.log_tail()}")
        for sig in args.signals:
            for down_s in args.downs:
                next_worker = spare(tmp / f"{protocol}-{next(runs)}", checkpoint, settings)
                children.append(next_worker.child)
                worker.proc.send_signal(getattr(signal, f"SIG{sig}"))
                worker.wait_exit(60)
                time.sleep(down_s)  # the downtime under test
                ready_at = serve(next_worker)
                worker = next_worker
                recovered_s, failed = first_ok(router, ready_at, args.give_up_s)
                after = [generate(router, prompt(24, seed=100 + i)) for i in range(args.after)]
                row = {
                    "name": "restart",
                    "protocol": protocol,
                    "signal": f"SIG{sig}",
                    "down_s": down_s,
                    "rank_port": args.rank_port,
                    "rejoin_s": args.rejoin_s if protocol == "sglang" else None,
                    "ready_to_first_ok_s": None if recovered_s is None else round(recovered_s, 2),
                    "failed_before_first_ok": failed,
                    "after_ok": sum(after),
                    "after_failed": len(after) - sum(after),
                }
                print(json.dumps(row), flush=True)
    finally:
        for child in reversed(children):
            child.stop(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--protocols", nargs="+", default=["sglang", "native"])
    parser.add_argument("--signals", nargs="+", default=["KILL", "TERM"])
    parser.add_argument("--downs", nargs="+", type=float, default=[0.0, 5.0, 15.0])
    parser.add_argument("--rank-port", choices=["random", "fixed"], default="random")
    parser.add_argument("--rejoin-s", type=float, default=15.0)
    parser.add_argument("--after", type=int, default=10)
    parser.add_argument("--give-up-s", type=float, default=120.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="restart-") as name:
        tmp = Path(name)
        checkpoint = make_checkpoint("llama", tmp / "llama")
        for protocol in args.protocols:
            run_protocol(protocol, args, tmp, checkpoint)


if __name__ == "__main__":
    main()
