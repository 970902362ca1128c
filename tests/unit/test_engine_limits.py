"""The limit an engine claims with, and the name it claims under (no vLLM needed: plain values)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvcached import settings
from kvcached.integration.limits import ENV_LIMIT, resolve_limit
from kvcached.integration.vllm.common import engine_name
from kvcached.node.base.units import BadValue

ENV_DP = settings.DP_SERVE.name

GPU = 80 << 30


def device(total: int | None = GPU):
    calls = []

    def read() -> int | None:
        calls.append(1)
        return total

    read.calls = calls  # type: ignore[attr-defined]
    return read


@pytest.mark.parametrize("raw, want", [("40G", 40 << 30), ("512M", 512 << 20), ("1073741824", 1 << 30),
                                       ("1.5GiB", 3 << 29)])
def test_size_needs_no_device(raw: str, want: int) -> None:
    read = device()
    limit = resolve_limit(read, 0.9, {ENV_LIMIT: raw})
    assert limit.total == want and raw in limit.source
    assert read.calls == []  # a size never touches the device


def test_percent_and_default_share_of_device_memory() -> None:
    assert resolve_limit(device(), 0.9, {ENV_LIMIT: "50%"}).total == GPU // 2
    default = resolve_limit(device(), 0.9, {})
    assert default.total == int(GPU * 0.9) and "gpu_memory_utilization" in default.source
    assert resolve_limit(device(), 0.5, {}).total == GPU // 2


@pytest.mark.parametrize("raw", ["lots", "-1G", "150%", "0%"])
def test_an_unusable_limit_is_warned_about_and_vllms_share_used(raw: str, caplog, monkeypatch) -> None:
    """The default is the share vLLM takes without kvcached: no worse than not having kvcached (settings.LIMIT)."""
    monkeypatch.setattr(settings, "_warned", set())  # settings warn once per value and process
    limit = resolve_limit(device(), 0.9, {ENV_LIMIT: raw})
    assert limit.total == int(GPU * 0.9) and "gpu_memory_utilization" in limit.source
    assert f"{ENV_LIMIT}={raw!r} is not usable" in caplog.text


@pytest.mark.parametrize("env", [{}, {ENV_LIMIT: "10%"}])
def test_a_share_of_unknown_device_memory_says_why(env: dict[str, str]) -> None:
    with pytest.raises(BadValue, match="device's memory is unknown"):
        resolve_limit(device(None), 0.9, env)


def _parallel(size: int = 1, index: int = 0) -> SimpleNamespace:
    return SimpleNamespace(data_parallel_size=size, data_parallel_index=index, data_parallel_rank=index)


@pytest.mark.parametrize("env, parallel, want", [
    ({"KVCACHED_IPC_NAME": "prod"}, _parallel(), "prod"),
    ({"KVCACHED_IPC_NAME": "prod"}, _parallel(2, 1), "prod_dp1"),  # an MoE DP rank keeps its DP size
    ({"KVCACHED_IPC_NAME": "prod"}, _parallel(1, 3), "prod_dp3"),  # a non-MoE rank reset to DP = 1 keeps its index
    ({"KVCACHED_IPC_NAME": "prod", ENV_DP: "1"}, _parallel(1, 0), "prod_dp0"),  # rank 0: only the owner knows
    ({"KVCACHED_IPC_NAME": "prod"}, None, "prod"),
])
def test_engine_name_per_dp_rank(env: dict[str, str], parallel: object, want: str) -> None:
    assert engine_name(parallel, env) == want
