"""The decode peer as a process: its ZMQ control socket (``serve``), that socket's asyncio
client (``DecodePeerClient``, what a router would do) and the command line (``main``).

``python -m prefill_worker.testing.decode_peer`` runs ``main``: load the model, register with
the worker, send sd_notify READY=1, answer ``generate``/``ping`` until SIGTERM, exit 0 (1, with
every thread's stack in the log, if the stop takes over 10 s). A test and demo tool, like the
peer itself (``decode_peer``).
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from prefill_worker.testing.decode_peer import DecodePeer, Generation, KVSource

# The peer's logger: the process's lines keep the name they had before the split.
log = logging.getLogger("prefill_worker.testing.decode_peer")
_NUM_AUX_ROWS = 64  # DecodePeer's default: one SGLang metadata row per aux slot
_DESCRIPTION = (
    "The reference decode peer: receives a prompt's KV from a worker, then decodes greedily."
)


def _generation_msg(gen: Generation) -> dict[str, Any]:
    return {
        "type": "generated",
        "room": gen.room,
        "is_ok": gen.is_ok,
        "token_ids": list(gen.token_ids),
        "error": gen.error,
        "kv_wait_s": gen.kv_wait_s,
        "decode_s": gen.decode_s,
    }


def serve(peer: DecodePeer, bind: str, stop: threading.Event) -> None:
    """Answer ``generate`` {room, token_ids, max_new_tokens} and ``ping`` on a ROUTER socket
    until ``stop`` is set; each ``generated`` reply goes to the identity that asked."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(bind)
    askers: dict[int, bytes] = {}
    try:
        while not stop.is_set():
            idle_ms = 0 if peer.is_decoding else 2
            while sock.poll(idle_ms):
                identity, frame = sock.recv_multipart()
                reply = _on_control(peer, askers, identity, frame)
                if reply is not None:
                    sock.send_multipart([identity, msgpack.packb(reply)])
                idle_ms = 0
            for gen in peer.step():
                sock.send_multipart([askers.pop(gen.room), msgpack.packb(_generation_msg(gen))])
    finally:
        sock.close()
        ctx.term()


def _on_control(
    peer: DecodePeer, askers: dict[int, bytes], identity: bytes, frame: bytes
) -> dict[str, Any] | None:
    """One control message; the immediate reply, if any (``generated`` comes later)."""
    try:
        msg = msgpack.unpackb(frame)
        if msg["type"] == "ping":
            return {"type": "pong"}
        room, token_ids, max_new_tokens = msg["room"], msg["token_ids"], msg["max_new_tokens"]
        if msg["type"] != "generate" or room in askers or max_new_tokens < 1 or not token_ids:
            raise ValueError(f"not a new valid generate: {msg['type']} room {room}")
    except (ValueError, KeyError, TypeError, msgpack.ExtraData) as exc:
        return {"type": "error", "message": str(exc)}
    askers[room] = identity
    peer.expect(room, token_ids, max_new_tokens)
    return None


class DecodePeerClient:
    """Asyncio client of a decode-peer process's control socket (what a router would do);
    create and use it inside one running event loop."""

    def __init__(self, endpoint: str) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._waiting: dict[int, asyncio.Future[Generation]] = {}
        self._pongs: list[asyncio.Future[None]] = []
        self._receiver: asyncio.Task[None] | None = None

    async def generate(
        self, room: int, token_ids: Sequence[int], max_new_tokens: int
    ) -> Generation:
        """Hand the peer a request; returns once it has finished decoding."""
        future = self._expect()
        self._waiting[room] = future
        msg = {"type": "generate", "room": room, "token_ids": [int(t) for t in token_ids]}
        await self._sock.send(msgpack.packb({**msg, "max_new_tokens": max_new_tokens}))
        return await future

    async def ping(self, timeout_s: float) -> None:
        """Returns once the peer answers (it serves only after registering with the worker)."""
        future: asyncio.Future[None] = self._expect()
        self._pongs.append(future)
        await self._sock.send(msgpack.packb({"type": "ping"}))
        await asyncio.wait_for(future, timeout_s)

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
        self._sock.close()
        self._ctx.term()

    def _expect(self) -> asyncio.Future[Any]:
        if self._receiver is None:
            self._receiver = asyncio.get_running_loop().create_task(self._receive())
        return asyncio.get_running_loop().create_future()

    async def _receive(self) -> None:
        while True:
            reply = msgpack.unpackb(await self._sock.recv())
            if reply.get("type") == "pong":
                for pong in self._pongs:
                    if not pong.done():
                        pong.set_result(None)
                self._pongs.clear()
            elif reply.get("type") == "generated" and reply["room"] in self._waiting:
                fields = {k: v for k, v in reply.items() if k != "type"}
                fields["token_ids"] = tuple(fields["token_ids"])
                self._waiting.pop(reply["room"]).set_result(Generation(**fields))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="decode-peer", description=_DESCRIPTION)
    parser.add_argument("--model", required=True, help="checkpoint directory (as the worker's)")
    parser.add_argument(
        "--bootstrap",
        action="append",
        default=[],
        help="a worker's bootstrap address (repeat it for several workers)",
    )
    parser.add_argument(
        "--sglang",
        action="store_true",
        help="receive the KV over SGLang's PD protocol with SGLang's own decode-side code "
        "(with --http; run it where a pinned SGLang imports: testing/sglang_env.py); each "
        "request's bootstrap_host/port names its prefill (SGLang bootstrap port)",
    )
    serving = parser.add_mutually_exclusive_group(required=True)
    serving.add_argument("--bind", help="control socket, e.g. tcp://127.0.0.1:5600")
    serving.add_argument(
        "--http", help="serve SGLang's decode HTTP API here instead (host:port), for a PD router"
    )
    parser.add_argument(
        "--served-model-name", help="the model id the HTTP API announces (default: --model)"
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-pages", type=int, default=1024)
    parser.add_argument("--num-threads", type=int)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument(
        "--ignore-eos", action="store_true", help="always decode max_new_tokens (tests)"
    )
    return parser


def _serve_http(peer: DecodePeer, args: argparse.Namespace, stop: threading.Event) -> None:
    """SGLang's decode HTTP API (``peer_http.py``) until ``stop``; READY=1 once it listens."""
    from prefill_worker.ingress.http import ServedModel, load_text_codec
    from prefill_worker.ingress.validate import Limits
    from prefill_worker.model.hf_config import read_spec
    from prefill_worker.service.sdnotify import SdNotifier
    from prefill_worker.testing.peer_http import PeerHttp, serve_http

    spec, codec = read_spec(args.model), load_text_codec(args.model)
    model = ServedModel(
        served_model_name=args.served_model_name or args.model,
        model_path=args.model,
        architectures=(spec.architecture,),
        model_type=spec.architecture.removesuffix("ForCausalLM").lower(),
        context_length=spec.max_position,
        page_size=args.page_size,
        max_total_tokens=args.num_pages * args.page_size,
        max_running_requests=args.max_batch_size,
        version="decode-peer",
        bootstrap_port=None,
        has_tokenizer=codec is not None,
        disaggregation_mode="decode",
    )
    by_port = {addr.rpartition(":")[2]: addr for addr in peer.receivers}
    limits = Limits(spec.vocab_size, spec.max_position, args.num_pages * args.page_size)
    stop_ids = tuple(peer.stop_token_ids)

    def source(host: str, port: int) -> str | None:
        return f"{host}:{port}" if args.sglang else by_port.get(str(port))

    front = PeerHttp(args.http, model, codec, limits, stop_ids, source)
    port = front.start()
    SdNotifier.from_environ(os.environ).ready(f"decode peer on http port {port}")
    try:
        serve_http(peer, front, stop)
    finally:
        front.stop()


def _sglang_sources(model_path: str) -> Callable[[Any], Callable[[str], KVSource]]:
    """SGLang's decode-side code receives the KV (imports SGLang: the interop environment)."""

    def connect_over(kv_cache: Any) -> Callable[[str], KVSource]:
        from prefill_worker.testing.sglang_peer import SglangRank

        return SglangRank(kv_cache, model_path, _NUM_AUX_ROWS).connect

    return connect_over


_STOP_GRACE_S = 10.0  # a stop that takes longer is a hang (the test's SIGKILL comes at 30 s)


class _Stopping:
    """What SIGTERM and SIGINT do. The handler only sets ``event`` (the serve loop ends at
    its next turn) and, once the peer serves, arms faulthandler's watchdog: a stop still
    running ``grace_s`` later is a hang, so every thread's stack goes to the log and the
    process exits 1, a failure its test sees with where it hung, not a SIGKILL's bare -9. The
    stop crosses code the peer cannot bound (SGLang's threads, aiohttp's shutdown, the
    interpreter's exit); the watchdog is a C thread, so it fires even if one holds the GIL."""

    def __init__(self, grace_s: float) -> None:
        self.event = threading.Event()
        self._grace_s = grace_s
        self._is_serving = False

    def on_signal(self, signum: int, frame: object) -> None:
        if not self.event.is_set():
            self.event.set()
            if self._is_serving:
                self._arm()

    def serving(self) -> None:
        """The load is done: from now on a stop has ``grace_s`` (a signal during the load,
        which nothing interrupts, gets its grace from here)."""
        self._is_serving = True
        if self.event.is_set():
            self._arm()

    def _arm(self) -> None:
        faulthandler.dump_traceback_later(self._grace_s, exit=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run until SIGTERM/SIGINT; exit 0 after closing the receiver (it says goodbye), or 1
    with every thread's stack in the log if the stop hangs (``_Stopping``)."""
    from prefill_worker.service.sdnotify import SdNotifier

    parser = _parser()
    args = parser.parse_args(argv)
    if args.sglang and not args.http:
        parser.error("--sglang serves SGLang's decode HTTP API: give --http")
    if not (args.sglang or args.bootstrap):
        parser.error("give --bootstrap (or --sglang: each request names its prefill)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s decode-peer %(message)s")
    stopping = _Stopping(_STOP_GRACE_S)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stopping.on_signal)
    log.info("loading %s", args.model)
    extra: dict[str, Any] = {"stop_token_ids": ()} if args.ignore_eos else {}
    peer = DecodePeer.load(
        args.model,
        args.bootstrap,
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        page_size=args.page_size,
        num_pages=args.num_pages,
        num_threads=args.num_threads,
        max_batch_size=args.max_batch_size,
        connect_over=_sglang_sources(args.model) if args.sglang else None,
        **extra,
    )
    where = args.bind or f"http://{args.http}"
    how = "SGLang's protocol" if args.sglang else "the native protocol"
    log.info("KV over %s from %s; serving on %s", how, ", ".join(args.bootstrap) or "any", where)
    stopping.serving()
    try:
        if args.http:
            _serve_http(peer, args, stopping.event)
        else:
            SdNotifier.from_environ(os.environ).ready(f"decode peer of {args.bootstrap}")
            serve(peer, args.bind, stopping.event)
    finally:
        peer.close()
    log.info("stopped")
    if args.sglang:  # SGLang's manager has no close: its threads and NIXL agent must not
        logging.shutdown()  # hold the exit (as in testing/sglang_decode.py)
        os._exit(0)
    return 0
