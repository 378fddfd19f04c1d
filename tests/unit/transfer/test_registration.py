"""A pool on a GPU registers its KV as VRAM on its device and its aux rows (host memory on
every device) as DRAM, in separate registrations and separate descriptor lists: one NIXL list
holds one memory type. Checked here with a recording agent; tests/gpu pushes for real."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from prefill_worker.kv.aux import AUX_ROW_BYTES
from prefill_worker.kv.layout import KVLayout, KVRegions
from prefill_worker.transfer.nixl.agent import prep_lists, register_regions

LAYOUT = KVLayout(2, 2, 8, "bfloat16", 4, 16)
REGIONS = KVRegions(LAYOUT, (1 << 20, 2 << 20), (3 << 20, 4 << 20), "cuda:1", 9 << 20, 5)


class RecordingAgent:
    def __init__(self) -> None:
        self.registered: list[tuple[np.ndarray, str]] = []
        self.prepped: list[tuple[str, np.ndarray, str]] = []

    def register_memory(self, table: np.ndarray, mem: str) -> Any:
        self.registered.append((table, mem))
        return len(self.registered)

    def prep_xfer_dlist(self, agent: str, table: np.ndarray, mem: str) -> Any:
        self.prepped.append((agent, table, mem))
        return len(self.prepped)


def test_a_gpu_pool_registers_kv_as_vram_and_aux_rows_as_dram() -> None:
    agent = RecordingAgent()
    register_regions(agent, REGIONS)  # type: ignore[arg-type]
    (kv, kv_mem), (aux, aux_mem) = agent.registered
    assert kv_mem == "VRAM" and aux_mem == "DRAM"
    assert kv[:, 0].tolist() == [1 << 20, 2 << 20, 3 << 20, 4 << 20]
    assert set(kv[:, 1].tolist()) == {LAYOUT.region_bytes} and set(kv[:, 2].tolist()) == {1}
    assert aux.tolist() == [[9 << 20, 5 * AUX_ROW_BYTES, 0]]


def test_descriptor_lists_split_the_same_way() -> None:
    agent = RecordingAgent()
    prep_lists(agent, "peer", REGIONS)  # type: ignore[arg-type]
    (_, kv, kv_mem), (_, aux, aux_mem) = agent.prepped
    assert (kv_mem, aux_mem) == ("VRAM", "DRAM")
    assert kv.shape == (2 * 2, 5) and set(kv[:, 2].tolist()) == {1}  # strided: 16 pages a row
    assert set(kv[:, 4].tolist()) == {16}
    assert aux.tolist() == [[9 << 20, AUX_ROW_BYTES, 0, AUX_ROW_BYTES, 5]]


def test_a_cpu_pool_is_dram_throughout() -> None:
    agent = RecordingAgent()
    register_regions(agent, dataclasses.replace(REGIONS, device="cpu"))  # type: ignore[arg-type]
    assert [mem for _, mem in agent.registered] == ["DRAM", "DRAM"]
