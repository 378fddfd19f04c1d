"""``/server_info`` over real HTTP on 127.0.0.1 tells a PD router the worker's TP size, as
SGLang's own prefill reports its ``--tp-size``: smg keeps it as the worker's ``tp_size`` label
and warns when a model's prefill and decode servers disagree. The model's facts come from the
config as the daemon builds them (``served_model``)."""

from __future__ import annotations

import json
import queue
import urllib.request
from typing import Any

from prefill_worker.ingress.http import HttpApi
from prefill_worker.ingress.validate import Limits
from prefill_worker.load import LoadSnapshot
from prefill_worker.model import ModelInfo
from prefill_worker.service.config import load_config
from prefill_worker.service.startup import served_model

INFO = ModelInfo(
    "LlamaForCausalLM", 128, 512, 2, 8, 4, 16, 128, "float32", "cpu", "sdpa", None, (2,)
)


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def test_server_info_reports_the_tp_group_size() -> None:
    flags = ["transfer.protocol=sglang", "parallel.tp_size=4", "cache.page_size=16"]
    config = load_config(None, env={}, overrides=flags)
    model = served_model(config, (INFO, Limits(100, 512, 4096)), has_tokenizer=False)
    front = HttpApi(
        "127.0.0.1:0", queue.Queue(), LoadSnapshot, Limits(100, 512, 4096), model, None,
        max_inflight=4, max_body_bytes=1 << 20,
    )  # fmt: skip
    front.start()
    try:
        for path in ("/server_info", "/get_server_info"):
            info = _get(f"http://127.0.0.1:{front.port}{path}")
            assert (info["tp_size"], info["dp_size"], info["pp_size"]) == (4, 1, 1), path
            assert (info["page_size"], info["disaggregation_mode"]) == (16, "prefill")
    finally:
        front.stop()
