"""The `sglang.srt.plugins` entry point (pyproject: `kvcached = kvcached.integration.sglang.plugin:register`).

SGLang's `load_plugins()` runs once in every process it starts (main, each
scheduler, the detokenizer, the DP controller) and calls `register()` for its
side effects; it logs what a plugin raises and goes on, keeping whatever the
plugin had half done. So `register()` never raises, and every patch is
applied by the kit, all of its wraps or none.

It does nothing unless kvcached is enabled (`ENABLE_KVCACHED=true`,
`KVCACHED_ENABLE=1` or `KVCACHED_ELASTIC=1`, the switch vLLM's plugin reads);
`SGLANG_PLUGINS`, when set and not empty, must name `kvcached` for SGLang to
call it at all.

A patch applies in the processes that import what it hooks, when they import
it: a post-import hook (wrapt's) per target module fires at once for a module
already imported (a scheduler's `sglang.srt.managers.scheduler`) and otherwise
when the module is first imported (main loads plugins before it imports the
engine). A detokenizer, which never imports the scheduler, pays nothing.

Logging: SGLang configures the root logger in each of its processes
(`configure_logger`), and kvcached's records propagate to it: they appear in
SGLang's log stream, in its format, at its level.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType

from .. import Once, run_once

log = logging.getLogger(__name__)

_once = Once()


def _applier(names: tuple[str, ...]) -> Callable[[ModuleType], None]:
    def apply(_module: ModuleType) -> None:
        # Runs inside SGLang's import of the module: nothing may escape into it.
        try:
            from ..publish import publish
            from .patches import REGISTRY

            publish(REGISTRY, REGISTRY.apply(names))  # what kvctl doctor engine reads of this process
        except Exception:
            log.exception("kvcached: SGLang patches %s failed; SGLang continues without them", ", ".join(names))

    return apply


def register() -> None:
    """Apply kvcached's SGLang patches in this process when enabled, each as its target is imported; never raises."""
    run_once(_once, "SGLang", log, _hook_patches)


def _hook_patches() -> None:
    import wrapt  # here: a plugin loaded with kvcached off imports nothing beyond this package

    from ..publish import publish
    from .patches import REGISTRY, by_home_module

    publish(REGISTRY)  # active in this process from now on, its patches said as their modules are imported
    for module_name, names in by_home_module().items():
        wrapt.register_post_import_hook(_applier(names), module_name)
