"""Start-up hands the vLLM backend's staging region to the pool as its KV mirror: attached
when vLLM decodes are served (a mirrored write then lands in the region), nothing otherwise,
and a region that does not fit the pool stops the start-up with a configuration error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefill_worker.kv.layout import LAYER_MAJOR, KVLayout
from prefill_worker.model.kv_cache import KVCache
from prefill_worker.model.kv_mirror import MirrorTargets
from prefill_worker.service.config import EX_CONFIG
from prefill_worker.service.startup import StartupError, attach_kv_mirror
from prefill_worker.transfer.factory import Transfer


def _kv() -> KVCache:
    return KVCache(KVLayout(2, 1, 4, "float32", 4, 8, LAYER_MAJOR), torch.device("cpu"))


def _transfer(layers: tuple[np.ndarray, ...]) -> Transfer:
    return Transfer(backend=None, endpoints={}, mirror_layers=layers)  # type: ignore[arg-type]


def test_the_staging_region_becomes_the_pools_mirror() -> None:
    kv, region = _kv(), tuple(np.zeros((3, 1, 32, 8), np.uint32) for _ in range(2))
    attach_kv_mirror(_transfer(region), kv)
    k = torch.full((1, 1, 4), 2.0)
    with kv.mirroring(MirrorTargets(np.array([5]), np.array([33]))):  # block 1, offset 1
        kv.write(1, torch.tensor([5]), k, -k)
    assert region[1][1, 0, 1].view(np.float32).tolist() == [2.0] * 4 + [-2.0] * 4
    assert not region[0].any()


def test_no_vllm_no_mirror_and_a_misfit_is_a_config_error() -> None:
    kv = _kv()
    attach_kv_mirror(_transfer(()), kv)
    with (
        pytest.raises(AssertionError, match="without a mirror"),
        kv.mirroring(MirrorTargets(np.array([0]), np.array([0]))),
    ):
        pass
    wrong = tuple(np.zeros((3, 2, 32, 8), np.uint32) for _ in range(2))  # 2 KV heads, not 1
    with pytest.raises(StartupError, match="kv mirror") as error:
        attach_kv_mirror(_transfer(wrong), kv)
    assert error.value.exit_code == EX_CONFIG
