"""One SGLang decode (a manager and its pools, inside a decode child process) as a test sees
it: ask for a room, wait for SGLang's verdict, read what landed."""

from __future__ import annotations

import itertools
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prefill_worker.kv.layout import KVLayout
from prefill_worker.testing.sglang_decode import SglangDecodeProcess

_IDS = itertools.count()
TERMINAL = ("Success", "Failed")


def new_room() -> int:
    """A random 63-bit room, as SGLang's routers pick them (never 0: the decode reads 0 as
    "no metadata yet")."""
    return secrets.randbits(63) or 1


@dataclass(frozen=True)
class Landed:
    """A room's pages as the decode holds them, raw bytes per layer: ``k[l]`` is
    ``[num_prompt_pages, page_bytes]`` uint8 (an MLA pool's latent in ``k``, ``v`` empty); and
    row ``aux_index`` of its metadata buffers."""

    pages: list[int]
    k: list[np.ndarray]
    v: list[np.ndarray]
    output_ids: np.ndarray
    cached_tokens: np.ndarray
    logprob_val: np.ndarray
    logprob_idx: np.ndarray
    bootstrap_room: np.ndarray
    # A speculating decode's: its draft pool's pages per layer (``draft_k``, ``draft_v``, as
    # ``k`` and ``v``), and the row's output_topk_p, output_topk_index and
    # output_hidden_states, raw bytes.
    draft_k: list[np.ndarray]
    draft_v: list[np.ndarray]
    topk_p: np.ndarray
    topk_index: np.ndarray
    hidden: np.ndarray


class SglangDecode:
    def __init__(
        self,
        process: SglangDecodeProcess,
        bootstrap: str,
        layout: KVLayout,
        num_aux_rows: int = 16,
        kv_cache_dtype: str | None = None,
        *,
        swa: tuple[tuple[int, ...], int, int] | None = None,
        speculates: tuple[int, int, str] | None = None,
        dsa: bool = False,
        mamba: MambaSpec | None = None,
    ) -> None:
        """``kv_cache_dtype``: its ``--kv-cache-dtype`` (None: ``fp8_e4m3`` for an FP8 pool,
        else ``auto``). ``swa``: a hybrid SWA pool (sliding layers, window tokens, SWA pool
        pages); ``layout`` then has every layer, of which the full ones make its KV pool.
        ``speculates``: (draft pool layers, the draft's hidden size, its dtype), a decode
        running EAGLE/MTP. ``dsa``: SGLang's DSA pool (``layout`` an MLA one, pages of 64),
        its FP8 index buffers registered as its ``dsa`` state component. ``mamba``: a hybrid
        linear-attention model's pool (its full layers' KV and a ``MambaPool``); ``layout``
        then has every layer."""
        draft_layers, spec_hidden_size, spec_dtype = speculates or (0, 16, "float32")
        self.process, self.layout = process, layout
        if kv_cache_dtype is None:
            kv_cache_dtype = "fp8_e4m3" if layout.dtype == "fp8_e4m3" else "auto"
        self.id = f"decode-{next(_IDS)}"
        self.rooms: dict[int, tuple[list[int], int]] = {}
        self.dp_ranks: dict[int, int] = {}  # per room, the prefill DP rank it asked
        identity = process.call(
            "new",
            id=self.id,
            bootstrap=bootstrap,
            page_size=layout.page_size,
            dtype=layout.dtype,
            num_layers=layout.num_layers,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            num_pages=layout.num_pages,
            num_aux_rows=num_aux_rows,
            kind="dsa" if dsa else layout.kind,  # mla: SGLang's MLA pool (the latent in k)
            kv_cache_dtype=kv_cache_dtype,
            **swa_spec(swa),
            **({} if mamba is None else mamba.spec()),
            draft_layers=draft_layers,
            spec_hidden_size=spec_hidden_size,
            spec_dtype=spec_dtype,
        )
        self.swa_pages: dict[int, list[int]] = {}  # per room, its window's SWA pool pages
        self.mamba_slots: dict[int, int | None] = {}  # per room, its mamba pool slot
        self.agent_name: str = identity["agent_name"]  # what its frames name it by
        self.ip: str = identity["ip"]
        self.port: int = identity["port"]

    def want(
        self, room: int, num_tokens: int, prefix_len: int = 0, resolve: str | None = None
    ) -> tuple[list[int], int]:
        """Bootstrap the room and send its transfer request: (all its pages, aux index).
        ``resolve``: how SGLang's decode finds the prefill's DP rank (``room``, ``query``,
        ``rank:R``; ``sglang_child.Decode.dp_rank``), the rank then in ``dp_ranks``."""
        fields = {} if resolve is None else {"resolve": resolve}
        reply = self.process.call(
            "want", id=self.id, room=room, num_tokens=num_tokens, prefix_len=prefix_len, **fields
        )
        self.dp_ranks[room] = reply.get("dp_rank", 0)
        self.rooms[room] = (reply["pages"], reply["aux_index"])
        self.swa_pages[room] = reply.get("swa_pages") or []
        self.mamba_slots[room] = reply.get("mamba_slot")
        return self.rooms[room]

    def state(self, room: int) -> tuple[str, str | None]:
        reply = self.process.call("poll", id=self.id, room=room)
        return reply["state"], reply["reason"]

    def wait(self, room: int, timeout_s: float = 60.0) -> tuple[str, str | None]:
        """Poll SGLang's receiver until it concludes (Success or Failed) or the time is up."""
        deadline = time.monotonic() + timeout_s
        state = self.state(room)
        while state[0] not in TERMINAL and time.monotonic() < deadline:
            time.sleep(0.01)
            state = self.state(room)
        return state

    def free(self, room: int) -> None:
        """Once SGLang concluded the room: its pages back to the decode's pool."""
        self.process.call("free", id=self.id, room=room)
        del self.rooms[room]

    def abort(self, room: int) -> None:
        self.process.call("abort", id=self.id, room=room)

    def acked(self, room: int) -> bool:
        return bool(self.process.call("acked", id=self.id, room=room)["acked"])

    def landed(self, room: int, tmp_path: Path) -> Landed:
        path = tmp_path / f"{self.id}-{room}.npz"
        self.process.call("dump", id=self.id, room=room, path=str(path))
        data = np.load(path)
        n = self.layout.num_layers
        pages = self.rooms[room][0]

        def by_page(a: np.ndarray) -> np.ndarray:
            return a.reshape(len(pages), -1)

        return Landed(
            pages,
            [by_page(data[f"k{i}"]) for i in range(n)],
            [by_page(data[f"v{i}"]) for i in range(n) if f"v{i}" in data],
            data["output_ids"],
            data["cached_tokens"],
            data["logprob_val"],
            data["logprob_idx"],
            data["bootstrap_room"],
            [by_page(data[f"dk{i}"]) for i in range(n) if f"dk{i}" in data],
            [by_page(data[f"dv{i}"]) for i in range(n) if f"dv{i}" in data],
            data["topk_p"],
            data["topk_index"],
            data["hidden"],
        )


@dataclass(frozen=True)
class MambaSpec:
    """A decode's mamba pool: the model's linear layers, their shapes (key heads, value
    heads, key and value head dims, conv kernel), its SGLANG_MAMBA_CONV_DTYPE and its slots."""

    linear_layers: tuple[int, ...]
    shape: tuple[int, int, int, int, int]
    conv_dtype: str = "float32"
    num_slots: int = 8

    def spec(self) -> dict[str, object]:
        return {
            "linear_layers": list(self.linear_layers),
            "linear_shape": list(self.shape),
            "conv_dtype": self.conv_dtype,
            "mamba_slots": self.num_slots,
        }


def dump_state(decode: SglangDecode, room: int, tmp_path: Path) -> dict[str, np.ndarray]:
    """The room's mamba slot raw, per buffer name (``conv0``.., ``temporal0``..), uint8."""
    path = tmp_path / f"{decode.id}-{room}-state.npz"
    decode.process.call("dump", id=decode.id, room=room, path=str(path))
    data = np.load(path)
    return {n: data[n] for n in data.files if re.fullmatch(r"(conv|temporal)[0-9]+", n)}


def swa_spec(swa: tuple[tuple[int, ...], int, int] | None) -> dict[str, object]:
    if swa is None:
        return {}
    sliding, window_tokens, swa_pages = swa
    return {"sliding_layers": list(sliding), "window_tokens": window_tokens, "swa_pages": swa_pages}


def dump(decode: SglangDecode, room: int, tmp_path: Path) -> dict[str, np.ndarray]:
    """The room's pages raw, per buffer name (``k0``.. ``v0``.. of its KV pool, ``swa_k0``..
    of a hybrid SWA pool's window pages), each ``[pages, page_bytes]`` uint8."""
    path = tmp_path / f"{decode.id}-{room}-raw.npz"
    decode.process.call("dump", id=decode.id, room=room, path=str(path))
    data = np.load(path)
    sizes = {"swa_": len(decode.swa_pages[room]), "": len(decode.rooms[room][0])}
    return {
        name: data[name].reshape(sizes["swa_" if name.startswith("swa_") else ""], -1)
        for name in data.files
        if re.fullmatch(r"(swa_)?[kv][0-9]+", name)
    }


def wait_until_state(decode: SglangDecode, room: int, state: str, timeout_s: float) -> float:
    """Seconds until the room reaches ``state`` (AssertionError past ``timeout_s``)."""
    start = time.monotonic()
    found = decode.wait(room, timeout_s)
    assert found[0] == state, found
    return time.monotonic() - start
