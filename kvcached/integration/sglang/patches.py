"""kvcached's patches to SGLang, as one registry: the plugin applies each patch where SGLang imports its target.

Every patch point is recognised by the shape of the installed functions and
classes (a parameter, a call in the source, an attribute), never by a version
string; one whose shape is unknown stands aside with one warning, and those
requiring it with it. docs/SGLANG.md lists each patch, its targets, probe and
requirements.

Each patch module exports `PATCHES`; adding a module is one import below and
its name in `PATCHES`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..patchkit import Patch, Registry
from .claim import PATCHES as CLAIM
from .elastic import PATCHES as ELASTIC
from .owner import PATCHES as OWNER
from .worker_listener import PATCHES as LISTENER

log = logging.getLogger(__name__)

PATCHES: tuple[Patch, ...] = (*LISTENER, *CLAIM, *OWNER, *ELASTIC)

REGISTRY = Registry("SGLang", PATCHES, log)


def home_module(patch: Patch) -> str:
    """The module whose import makes `patch` apply: its first target's (the one the patch is about)."""
    return patch.targets[0].split(":", 1)[0]


def by_home_module(patches: Sequence[Patch] = PATCHES) -> dict[str, tuple[str, ...]]:
    """Patch names by the module whose import applies them, in declaration order."""
    out: dict[str, list[str]] = {}
    for p in patches:
        out.setdefault(home_module(p), []).append(p.name)
    return {m: tuple(names) for m, names in out.items()}
