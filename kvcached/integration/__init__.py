"""Engine integrations (vLLM and SGLang). Runtime layer: loaded only inside engine processes, and by `detect`.

Importing this package, or any of its modules but the engines' subclasses
(`vllm.elastic_alloc`, `sglang.elastic_alloc`, `sglang.elastic_buffers`),
imports neither an engine nor torch: the patches import their engine when
they are applied or probed.

- here: `enabled()`, and `run_once`, every engine plugin's entry-point frame
  (its work once per process, only when kvcached is enabled, nothing raised
  into the engine). A plugin the engine loads with kvcached off imports this
  package alone: no wrapt, no patch kit.
- `patchkit`: the kit every engine's patches are made with (Patch, Registry, wrap).
- `running`: what one process shares between them (its engines, its worker listener).
- `engine_claim`, `engine_owner`, `limits`, `engine_elastic`: engine-agnostic
  halves (what an engine holds; the owner's cleanup duty; the limit an engine
  claims with; what both engines' elastic pools take from the deployment).
- `vllm/` and `sglang/`: each engine's plugin, its patches and its elastic KV,
  one file name per role in both (docs/ARCHITECTURE.md's table), and what
  `detect` reports about it.
- `detect`: `python -m kvcached.integration.detect --json` (kvcached.detect/1), read by `kvctl doctor`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .. import settings
from ..node import Layout


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """True when kvcached is switched on: upstream's `ENABLE_KVCACHED`, our `KVCACHED_ENABLE`, or
    `KVCACHED_ELASTIC` (elastic KV memory needs the other patches: the worker listener)."""
    return any(s.get(environ) for s in (settings.ENABLE_KVCACHED, settings.ENABLE, settings.ELASTIC))


def layout_from_env(environ: Mapping[str, str] | None = None) -> Layout:
    """The node layout engine processes use: `/`, or `KVCACHED_ROOT` (tests, chroots); raises SettingError
    for a relative `KVCACHED_ROOT` (settings.ROOT says why it is strict)."""
    return Layout(root=settings.ROOT.get(environ))


@dataclass
class Once:
    """Whether a plugin's work has run in this process; tests set `done` back to False to load the plugin again."""

    done: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


def run_once(once: Once, engine: str, log: logging.Logger, work: Callable[[], None]) -> None:
    """Run a plugin's `work` once per process, only when kvcached is enabled; log, never raise, into `engine`.

    Engines call their plugins in every process they start, some more than
    once, and vLLM's loader calls them without a guard: an exception here
    would abort the serve.
    """
    try:
        if not enabled():
            log.debug("kvcached: not enabled (set ENABLE_KVCACHED=true or KVCACHED_ENABLE=1)")
            return
        with once.lock:
            if once.done:
                return
            once.done = True
        work()
    except Exception:
        log.exception("kvcached: the %s plugin failed; %s continues without kvcached's patches", engine, engine)
