"""``transfer.protocol`` and the SGLang addresses: the control socket's address is known
before start-up, or the configuration is refused."""

from __future__ import annotations

import pytest

from prefill_worker.service.config import ConfigError, load_config


def test_sglang_defaults_to_the_bootstrap_host() -> None:
    config = load_config(None, env={}, overrides=["transfer.protocol=sglang"])
    transfer = config.transfer
    assert transfer.protocol == "sglang"
    assert transfer.sglang_bootstrap_bind == "127.0.0.1:8998"
    assert transfer.resolved_sglang_rank_ip == "127.0.0.1"
    assert transfer.resolved_sglang_ucx_net_devices == "lo"
    assert transfer.sglang_kv_cache_dtype == "auto"


def test_a_wildcard_bind_needs_the_control_address() -> None:
    flags = ["transfer.protocol=both", "transfer.sglang_bootstrap_bind=0.0.0.0:8998"]
    with pytest.raises(ConfigError) as info:
        load_config(None, env={}, overrides=flags)
    assert "sglang_rank_ip" in "\n".join(info.value.problems)
    config = load_config(None, env={}, overrides=[*flags, "transfer.sglang_rank_ip=10.0.0.7"])
    assert config.transfer.resolved_sglang_rank_ip == "10.0.0.7"
    assert config.transfer.resolved_sglang_ucx_net_devices is None
    native = load_config(None, env={}, overrides=flags[1:])  # native only: not needed
    assert native.transfer.protocol == "native"


def test_a_tensor_parallel_worker_serves_one_protocol() -> None:
    for protocol in ("native", "sglang"):
        flags = [f"transfer.protocol={protocol}", "parallel.tp_size=2"]
        assert load_config(None, env={}, overrides=flags).parallel.tp_size == 2
    for protocol in ("both", "native,vllm"):
        flags = [f"transfer.protocol={protocol}", "parallel.tp_size=2", "http_api.enabled=true"]
        with pytest.raises(ConfigError) as info:
            load_config(None, env={}, overrides=flags)
        assert "serves native, sglang or vllm alone" in "\n".join(info.value.problems), protocol
    assert load_config(None, env={}, overrides=["transfer.protocol=both"]).parallel.tp_size == 1


def test_a_tensor_parallel_vllm_worker_is_one_host() -> None:
    """At TP > 1 vLLM's staging region is memory the ranks share: no ``parallel.interface``
    (a group across hosts)."""
    flags = ["transfer.protocol=vllm", "parallel.tp_size=2", "http_api.enabled=true"]
    config = load_config(None, env={}, overrides=flags)
    assert config.parallel.tp_size == 2 and config.transfer.protocols == ("vllm",)
    with pytest.raises(ConfigError) as info:
        load_config(None, env={}, overrides=[*flags, "parallel.interface=eth1"])
    assert "unset parallel.interface" in "\n".join(info.value.problems)
    native = ["transfer.protocol=native", "parallel.tp_size=2", "parallel.interface=eth1"]
    assert load_config(None, env={}, overrides=native).parallel.interface == "eth1"


def test_a_draft_is_served_at_any_tp() -> None:
    """Every rank writes its draft heads beside its target heads (docs/models.md)."""
    draft = ["model.draft=eagle3", "model.draft_path=/drafts/eagle3"]
    config = load_config(None, env={}, overrides=draft)
    assert (config.model.draft, config.model.draft_path) == ("eagle3", "/drafts/eagle3")
    for kind in ("mtp", "eagle3"):
        for protocol in ("sglang", "native"):
            flags = [f"model.draft={kind}", f"transfer.protocol={protocol}", "parallel.tp_size=2"]
            config = load_config(None, env={}, overrides=flags)
            assert (config.model.draft, config.parallel.tp_size) == (kind, 2)


def test_an_unknown_protocol_is_refused() -> None:
    with pytest.raises(ConfigError):
        load_config(None, env={}, overrides=["transfer.protocol=mooncake"])


def test_allowed_networks_are_cidr_blocks() -> None:
    assert load_config(None, env={}, overrides=[]).transfer.sglang_allowed_networks == []
    good = ['transfer.sglang_allowed_networks=["10.0.0.0/16", "fd00::/8"]']
    assert load_config(None, env={}, overrides=good).transfer.sglang_allowed_networks == [
        "10.0.0.0/16",
        "fd00::/8",
    ]
    with pytest.raises(ConfigError) as info:
        load_config(None, env={}, overrides=['transfer.sglang_allowed_networks=["10.0.0.1/8"]'])
    assert "sglang_allowed_networks" in "\n".join(info.value.problems)


def test_a_vllm_blocks_pool_serves_no_sglang_and_one_vllm_block_a_page() -> None:
    blocks = ["cache.layout=vllm_blocks", "http_api.enabled=true", "cache.page_size=32"]
    with pytest.raises(ConfigError) as sglang:
        load_config(None, env={}, overrides=[*blocks, "transfer.protocol=sglang,vllm"])
    assert "SGLang decodes keep K and V apart" in "\n".join(sglang.value.problems)
    sized = [*blocks, "transfer.protocol=native,vllm", "transfer.vllm_block_size=16"]
    with pytest.raises(ConfigError) as size:
        load_config(None, env={}, overrides=sized)
    assert "set cache.page_size 32 and vllm_block_size" in "\n".join(size.value.problems)
    config = load_config(None, env={}, overrides=[*sized[:-1], "transfer.vllm_block_size=32"])
    assert config.cache.layout == "vllm_blocks"
    assert load_config(None, env={}, overrides=blocks).transfer.protocol == "native"
