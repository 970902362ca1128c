"""Fixtures for the vLLM integration tests: patch state, stand-in deployments, and their reaping."""

from __future__ import annotations

import glob
import os
import signal
from collections.abc import Iterator

import pytest

from ..engines_common import PAGE

VLLM_SKIP = "vLLM 0.33 is not installed here (run scripts/install-vllm.sh in this venv)"


@pytest.fixture
def vllm_env(layout, uniq, monkeypatch) -> Iterator[str]:
    """Engine-process environment on the test's private root: KVCACHED_ROOT and an explicit IPC name."""
    monkeypatch.setenv("KVCACHED_ROOT", layout.root)
    monkeypatch.setenv("KVCACHED_IPC_NAME", uniq)
    monkeypatch.delenv("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", raising=False)
    yield uniq
    # Reap every stand-in the test left: pids the stand-ins published under the root.
    for path in glob.glob(os.path.join(layout.root, "pid-*")):
        if path.endswith(".tmp") or path.endswith("pid-ready"):
            continue
        try:
            with open(path) as f:
                pid = int(f.read())
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError):
            pass


@pytest.fixture
def patched(request) -> Iterator[bool]:
    """Whether this case runs on patched vLLM (param True) or as installed (False); reverted after."""
    from kvcached.integration.patchkit import PatchStatus
    from kvcached.integration.vllm.patches import REGISTRY

    on = bool(getattr(request, "param", True))
    REGISTRY.revert()
    if on:
        applied = REGISTRY.apply()
        # elastic-kv stays off unless KVCACHED_ELASTIC=1 (its own tests turn it on).
        assert applied.pop("elastic-kv") is PatchStatus.DISABLED, applied
        assert all(v is PatchStatus.APPLIED for v in applied.values()), applied
    yield on
    REGISTRY.revert()


@pytest.fixture(autouse=True)
def _sigterm_untouched() -> Iterator[None]:
    """No kvcached code may install a SIGTERM handler in a process that did not ask for one (issue 12)."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    assert signal.getsignal(signal.SIGTERM) is before, "kvcached changed this process's SIGTERM disposition"


@pytest.fixture
def elastic(request, monkeypatch, vllm_env) -> Iterator[bool]:
    """The elastic-kv patch on (param True) or off (False): 64 KiB pages, freed pages released each step.

    The environment is the one the patch reads in every vLLM process: turned
    on, small CPU pages so that a few blocks make a page, no release delay
    (its own test sets one). Reverted after, with the engine plan and the
    process's buffer forgotten.
    """
    from kvcached.integration.patchkit import PatchStatus
    from kvcached.integration.vllm import elastic
    from kvcached.integration.vllm.patches import REGISTRY
    from kvcached.runtime import kvbuffer

    monkeypatch.setenv("KVCACHED_ELASTIC", "1")
    monkeypatch.setenv("KVCACHED_PAGE_SIZE", str(PAGE))
    monkeypatch.setenv("KVCACHED_ELASTIC_RELEASE_DELAY_S", "0")
    on = bool(getattr(request, "param", True))
    REGISTRY.revert()
    if on:
        # elastic-kv requires worker-listener: asking for it applies both, in that order.
        assert REGISTRY.apply(("elastic-kv",)) == {"worker-listener": PatchStatus.APPLIED,
                                                   "elastic-kv": PatchStatus.APPLIED}
    yield on
    REGISTRY.revert()
    elastic.forget_engine()
    kvbuffer.set_local_buffer(None)
