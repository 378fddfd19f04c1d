"""``prefill_worker.transfer`` names the decode SDK and the factory without importing them:
the package itself stays free of NIXL and ZMQ until one of them is used."""

from __future__ import annotations

import subprocess
import sys

import pytest

import prefill_worker.transfer as transfer


def test_public_names() -> None:
    assert set(transfer.__all__) >= {"KVReceiver", "RoomState", "RoomStatus", "make_backend"}
    with pytest.raises(AttributeError, match="no attribute"):
        _ = transfer.NotAThing  # type: ignore[attr-defined]


def test_package_wire_and_pagemap_import_without_zmq_or_nixl() -> None:
    code = (
        "import sys, prefill_worker.transfer, "
        "prefill_worker.transfer.wire, prefill_worker.transfer.pagemap\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('zmq', 'nixl_cu12', 'torch')]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
