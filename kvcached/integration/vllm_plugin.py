"""The `vllm.general_plugins` entry point (pyproject: `kvcached = ...vllm_plugin:register`).

vLLM calls `register()` in every process it starts (API server, EngineCore,
workers), possibly more than once. It does nothing unless kvcached is
enabled (`ENABLE_KVCACHED=true` or `KVCACHED_ENABLE=1`), applies the patches
once per process, and never raises into vLLM's start-up: vLLM's loader calls
plugins without a guard, so an exception here would abort the serve.
"""

from __future__ import annotations

import logging
import threading

from . import enabled

log = logging.getLogger("kvcached.integration.vllm")

_lock = threading.Lock()
_done = False


def register() -> None:
    """Apply kvcached's vLLM patches in this process when enabled; idempotent; never raises."""
    global _done
    try:
        if not enabled():
            log.debug("kvcached: not enabled (set ENABLE_KVCACHED=true or KVCACHED_ENABLE=1)")
            return
        with _lock:
            if _done:
                return
            _done = True
        from . import vllm_patches

        vllm_patches.apply()
    except Exception:
        log.exception("kvcached: the vLLM plugin failed; vLLM continues without kvcached's patches")
