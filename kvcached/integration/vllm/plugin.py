"""The `vllm.general_plugins` entry point (pyproject: `kvcached = kvcached.integration.vllm.plugin:register`).

vLLM calls `register()` in every process it starts (API server, EngineCore,
workers), possibly more than once. It does nothing unless kvcached is
enabled (`ENABLE_KVCACHED=true`, `KVCACHED_ENABLE=1` or `KVCACHED_ELASTIC=1`), applies the patches
once per process, and never raises into vLLM's start-up: vLLM's loader calls
plugins without a guard, so an exception here would abort the serve.

vLLM configures only its own `vllm` logger (its handler, its format,
`propagate: False`), so records of the `kvcached` logger would reach no
handler but Python's last resort (warnings only, unformatted). `register()`
hands them to the `vllm` logger's handlers: kvcached's lines appear in vLLM's
log stream, in vLLM's format, at vLLM's level (`VLLM_LOGGING_LEVEL`).
"""

from __future__ import annotations

import logging

from .. import Once, run_once

log = logging.getLogger(__name__)

_once = Once()


class VllmLogHandler(logging.Handler):
    """Hands `kvcached` records to whatever handlers the `vllm` logger has at the time.

    Looked up per record: vLLM reconfigures logging in its child processes
    (`configure_logging` in EngineCore and workers), replacing its handlers.
    """

    def emit(self, record: logging.LogRecord) -> None:
        vllm = logging.getLogger("vllm")
        if record.levelno < vllm.getEffectiveLevel():
            return
        for handler in vllm.handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def route_logs_to_vllm() -> None:
    """Send the `kvcached` logger's records through vLLM's handlers, like vLLM's own (and only there). Idempotent."""
    ours = logging.getLogger("kvcached")
    if any(isinstance(h, VllmLogHandler) for h in ours.handlers):
        return
    ours.addHandler(VllmLogHandler())
    # As vLLM does for `vllm`: a root handler the application configured would
    # otherwise print every line a second time in another format.
    ours.propagate = False
    # The plugin may load before vLLM configures its level (and vLLM's children
    # configure theirs again), so the level is vLLM's at each record, checked by
    # the handler; our own logger must only let records through to it.
    ours.setLevel(logging.DEBUG)


def unroute_logs() -> None:
    """Undo `route_logs_to_vllm` (tests)."""
    ours = logging.getLogger("kvcached")
    for h in [h for h in ours.handlers if isinstance(h, VllmLogHandler)]:
        ours.removeHandler(h)
    ours.propagate = True
    ours.setLevel(logging.NOTSET)


def register() -> None:
    """Apply kvcached's vLLM patches in this process when enabled; idempotent; never raises."""
    run_once(_once, "vLLM", log, _apply)


def _apply() -> None:
    route_logs_to_vllm()
    from ..publish import publish
    from .patches import REGISTRY

    publish(REGISTRY, REGISTRY.apply())  # what kvctl doctor engine reads of this process
