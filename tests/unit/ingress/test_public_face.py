"""The ingress's public face: the router client under the path the docs give
(``from prefill_worker.ingress import RouterClient``), imported only when asked for."""

from __future__ import annotations

import subprocess
import sys

import pytest

import prefill_worker.ingress
from prefill_worker.ingress import client


def test_the_router_client_is_exported_under_the_documented_path() -> None:
    from prefill_worker.ingress import BlockingRouterClient, RequestRejected, RouterClient

    assert RouterClient is client.RouterClient
    assert BlockingRouterClient is client.BlockingRouterClient
    assert RequestRejected is client.RequestRejected
    assert sorted(prefill_worker.ingress.__all__) == sorted(
        ["BlockingRouterClient", "RequestRejected", "RouterClient"]
    )


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Ingress'"):
        _ = prefill_worker.ingress.Ingress


def test_the_face_imports_the_client_only_when_asked_for() -> None:
    code = (
        "import sys, prefill_worker.ingress as face\n"
        "assert 'prefill_worker.ingress.client' not in sys.modules\n"
        "face.RouterClient\n"
        "assert 'prefill_worker.ingress.client' in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
