"""kvcached's patches to vLLM, as one registry: `REGISTRY.apply()` is what the plugin runs in every vLLM process.

Every patch point is recognised by the shape of the installed classes and
functions (a method present or absent, a parameter name, an attribute the
source assigns), never by a version string. A point whose shape we do not
recognise makes that patch (and any patch requiring it) stand aside, with one
warning naming it; the others still apply. docs/VLLM.md lists each point, how
it is detected, and what a future vLLM change would break first.

Ray executors, Ray data parallel and external launchers are left alone at run
time (`common.not_covered`).
"""

from __future__ import annotations

import logging

from ..patchkit import Registry
from . import elastic_kv, engine_state, lmcache_shutdown, owner_cleanup, worker_listener

log = logging.getLogger("kvcached.integration.vllm")

REGISTRY = Registry(
    "vLLM",
    (lmcache_shutdown.PATCH, owner_cleanup.PATCH, worker_listener.PATCH, engine_state.PATCH, elastic_kv.PATCH),
    log,
)
