"""LMCache shutdown forwarding, through vLLM's own `ensure_kv_transfer_shutdown()`.

The connector is vLLM's real `LMCacheConnectorV1`, built by its real
`__init__` (LMCache's adapter module replaced by a recording one, since
LMCache needs a GPU), or for the native adapter (`use_native=True`, whose
module imports LMCache at its top) created without `__init__` and given a
recording adapter.
"""

from __future__ import annotations

import logging
import sys
import types
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM 0.33 is not installed here (run scripts/install-vllm.sh in this venv)")
pytestmark = pytest.mark.vllm

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown, kv_transfer_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1  # noqa: E402

from .. import conftest  # noqa: E402

both = conftest.both()


class RecordingAdapter:
    """Stands for LMCache's own LMCacheConnectorV1Impl: records shutdown() calls."""

    def __init__(self, vllm_config: Any, role: Any, parent: Any) -> None:
        self.parent = parent
        self.shutdowns = 0

    def shutdown(self) -> None:
        self.shutdowns += 1


class NativeAdapterWithClose:
    def __init__(self) -> None:
        self.closes = 0

    def close(self) -> None:
        self.closes += 1


class NativeAdapterBare:
    """vLLM 0.33's native LMCacheConnectorV1Impl offers no shutdown() and no close()."""


@pytest.fixture
def lmcache_module(monkeypatch) -> None:
    """Install `lmcache.integration.vllm.vllm_v1_adapter` as a recording stand-in for the connector's lazy import."""
    names = ["lmcache", "lmcache.integration", "lmcache.integration.vllm", "lmcache.integration.vllm.vllm_v1_adapter"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules[names[-1]].LMCacheConnectorV1Impl = RecordingAdapter  # type: ignore[attr-defined]


def _connector() -> LMCacheConnectorV1:
    cfg = SimpleNamespace(kv_transfer_config=KVTransferConfig(
        kv_connector="LMCacheConnectorV1", kv_role="kv_both", kv_connector_extra_config={"use_native": False}))
    return LMCacheConnectorV1(vllm_config=cfg, role=KVConnectorRole.WORKER, kv_cache_config=None)


def _shutdown_through_vllm(connector: Any, monkeypatch) -> None:
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", connector)
    ensure_kv_transfer_shutdown()  # what vLLM's Worker.shutdown() calls
    ensure_kv_transfer_shutdown()  # a second teardown path finds nothing left
    assert kv_transfer_state._KV_CONNECTOR_AGENT is None


@both
def test_shutdown_reaches_lmcache_once(lmcache_module, patched, monkeypatch) -> None:
    """Exactly once with the patch (even when shutdown() is called again), zero times without it."""
    connector = _connector()
    adapter = connector._lmcache_engine
    assert isinstance(adapter, RecordingAdapter)
    _shutdown_through_vllm(connector, monkeypatch)
    connector.shutdown()
    assert adapter.shutdowns == (1 if patched else 0)


def test_native_adapter_cleanup_is_forwarded(patched, monkeypatch, caplog) -> None:
    """use_native=True: forward to what the adapter offers (close()), and log it."""
    connector = object.__new__(LMCacheConnectorV1)
    connector._lmcache_engine = adapter = NativeAdapterWithClose()
    with caplog.at_level(logging.INFO, logger="kvcached.integration.vllm"):
        _shutdown_through_vllm(connector, monkeypatch)
    assert adapter.closes == 1
    assert "NativeAdapterWithClose.close()" in caplog.text


def test_native_adapter_without_cleanup_is_logged(patched, monkeypatch, caplog) -> None:
    """An adapter that offers no cleanup at all: say so clearly, do not fail the worker's teardown."""
    connector = object.__new__(LMCacheConnectorV1)
    connector._lmcache_engine = NativeAdapterBare()
    with caplog.at_level(logging.WARNING, logger="kvcached.integration.vllm"):
        _shutdown_through_vllm(connector, monkeypatch)
    assert "NativeAdapterBare offers no shutdown() or close()" in caplog.text


def test_failing_lmcache_shutdown_does_not_raise(lmcache_module, patched, monkeypatch, caplog) -> None:
    """LMCache raising in shutdown() is logged; vLLM's teardown goes on."""
    connector = _connector()

    def boom() -> None:
        raise RuntimeError("lmcache exploded")

    connector._lmcache_engine.shutdown = boom
    with caplog.at_level(logging.WARNING, logger="kvcached.integration.vllm"):
        _shutdown_through_vllm(connector, monkeypatch)
    assert "lmcache exploded" in caplog.text


def test_vllm_that_forwards_is_left_alone(patched, monkeypatch) -> None:
    """Where vLLM's connector defines shutdown() itself, the patch is not needed and changes nothing."""
    from kvcached.integration.patchkit import PatchStatus
    from kvcached.integration.vllm.detect import conditions
    from kvcached.integration.vllm.patches import REGISTRY

    REGISTRY.revert()

    def own_shutdown(self: Any) -> None:
        self._lmcache_engine.shutdown()

    monkeypatch.setattr(LMCacheConnectorV1, "shutdown", own_shutdown, raising=False)
    assert REGISTRY.apply(("lmcache-shutdown",)) == {"lmcache-shutdown": PatchStatus.NOT_NEEDED}
    assert LMCacheConnectorV1.__dict__["shutdown"] is own_shutdown
    status = {p.name: p for p in REGISTRY.report()}["lmcache-shutdown"]
    assert status.status is PatchStatus.NOT_NEEDED and "defines shutdown() itself" in status.reason
    cond = {c.name: c for c in conditions()}["lmcache-no-shutdown-forwarding"]
    assert cond.present is False


def test_the_override_is_removed_on_revert(patched) -> None:
    """The patch adds shutdown() where vLLM only inherits it; reverting removes it, leaving the base's."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvcached.integration.vllm.patches import REGISTRY

    assert ("shutdown" in LMCacheConnectorV1.__dict__) is patched
    REGISTRY.revert(("lmcache-shutdown",))
    assert "shutdown" not in LMCacheConnectorV1.__dict__
    assert LMCacheConnectorV1.shutdown is KVConnectorBase_V1.shutdown
