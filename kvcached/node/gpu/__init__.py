"""GPU holders: which processes hold a GPU, which serve each belongs to, and which are orphans to end.

The face of the room: `find_holders` (one pass over the /proc facts),
`prepare` (before the engine pass, so that one read of the maps serves both),
`terminate_holders` (the guarded kill). NVML is imported only inside a pass
that found an NVIDIA holder, never when kvctl starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .holders import GpuHolder, GpuReport, find_holders, prepare
    from .judge import HolderState
    from .kill import terminate_holders

__all__ = ["GpuHolder", "GpuReport", "HolderState", "find_holders", "prepare", "terminate_holders"]

_WHERE = {"GpuHolder": "holders", "GpuReport": "holders", "find_holders": "holders", "prepare": "holders",
          "HolderState": "judge", "terminate_holders": "kill"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
