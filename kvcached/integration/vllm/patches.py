"""kvcached's patches to vLLM, as one registry: `REGISTRY.apply()` is what the plugin runs in every vLLM process.

Every patch point is recognised by the shape of the installed classes and
functions (a method present or absent, a parameter name, an attribute the
source assigns), never by a version string. A point whose shape we do not
recognise makes that patch (and any patch requiring it) stand aside, with one
warning naming it; the others still apply. docs/VLLM.md lists each point, how
it is detected, and what a future vLLM change would break first.

Ray executors, Ray data parallel and external launchers are left alone at run
time (`common.not_covered`).

Each patch module exports `PATCHES`, as SGLang's do; adding a module is one
import below and its `PATCHES` in the registry's.
"""

from __future__ import annotations

import logging

from ..patchkit import Patch, Registry
from . import claim, elastic, lmcache_shutdown, owner, worker_listener

log = logging.getLogger(__name__)

PATCHES: tuple[Patch, ...] = (*lmcache_shutdown.PATCHES, *owner.PATCHES, *worker_listener.PATCHES,
                               *claim.PATCHES, *elastic.PATCHES)

REGISTRY = Registry("vLLM", PATCHES, log)
