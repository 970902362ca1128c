"""The `owner-cleanup` patch: the process that owns vLLM's engine processes cleans up after their confirmed exit.

`CoreEngineProcManager` (under MPClient, the `--api-server-count > 1`
supervisor, or a headless launcher) gets an `EngineOwner` that captures the
deployment's segment and worker sockets once every engine answered READY
(`wait_for_engine_startup`), and after the original shutdown, once every
engine process has an exit code, removes what no live process serves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ... import settings
from ..patchkit import Changes, Patch, ShapeError
from .common import M_UTILS, argument, environ_set, module, params, source

log = logging.getLogger(__name__)

OWNER_ATTR = "_kvcached_owner"  # on a CoreEngineProcManager: its EngineOwner


@dataclass(frozen=True)
class OwnerTargets:
    """The objects this patch wraps."""

    utils: Any  # vllm.v1.engine.utils
    manager: Any  # CoreEngineProcManager


def probe() -> OwnerTargets:
    """vLLM's engine manager and start-up wait, when their shapes are the ones this patch knows."""
    mod = module(M_UTILS)
    mgr = getattr(mod, "CoreEngineProcManager", None)
    wait = getattr(mod, "wait_for_engine_startup", None)
    if mgr is None or wait is None:
        raise ShapeError("vllm.v1.engine.utils lacks CoreEngineProcManager or wait_for_engine_startup")
    init_params = params(mgr.__init__)
    if "vllm_config" not in init_params or "local_client" not in init_params:
        raise ShapeError("CoreEngineProcManager.__init__ no longer takes vllm_config and local_client")
    if "self.processes" not in (source(mgr.__init__) or ""):
        raise ShapeError("CoreEngineProcManager no longer keeps its engine processes in self.processes")
    if "timeout" not in params(mgr.shutdown):
        raise ShapeError("CoreEngineProcManager.shutdown() no longer takes a timeout")
    wait_params = params(wait)
    if "launch" not in wait_params or "parallel_config" not in wait_params:
        raise ShapeError("wait_for_engine_startup() no longer takes launch and parallel_config")
    return OwnerTargets(mod, mgr)


def _manager_init(wrapped: Any, manager: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    parallel = getattr(argument(wrapped, args, kwargs, "vllm_config"), "parallel_config", None)
    dp = getattr(parallel, "data_parallel_size", 1)
    is_dp = isinstance(dp, int) and dp > 1
    # The engines this starts inherit the marker (fork or spawn) and so name
    # themselves per DP rank, as the names below expect.
    with environ_set(settings.DP_SERVE.name, "1" if is_dp else None):
        wrapped(*args, **kwargs)
    try:
        tp = getattr(parallel, "tensor_parallel_size", None)
        pp = getattr(parallel, "pipeline_parallel_size", None)
        if not isinstance(tp, int) or not isinstance(pp, int):
            log.debug("kvcached: engine manager without a parallel config; no owner cleanup")
            return
        from ...node import dp_rank_name, ipc_name_from_env
        from .. import layout_from_env
        from ..engine_owner import EngineOwner

        base = ipc_name_from_env()
        start = int(argument(wrapped, args, kwargs, "start_index") or 0)
        names = [dp_rank_name(base, start + i) for i in range(len(manager.processes))] if is_dp else [base]
        headless = not argument(wrapped, args, kwargs, "local_client")
        owner = EngineOwner(manager.processes, layout_from_env(), names, tp, pp, headless=headless)
        setattr(manager, OWNER_ATTR, owner)
    except Exception as e:
        log.warning("kvcached: owner cleanup not set up: %s", e)


def _wait_for_engine_startup(wrapped: Any, _instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    result = wrapped(*args, **kwargs)
    try:
        launch = argument(wrapped, args, kwargs, "launch")
        owner = getattr(getattr(launch, "engine_manager", None), OWNER_ATTR, None)
        if owner is not None:
            owner.capture()  # every engine answered READY
    except Exception as e:
        log.warning("kvcached: owner capture failed: %s", e)
    return result


def _manager_shutdown(wrapped: Any, manager: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    owner = manager.__dict__.get(OWNER_ATTR)
    if owner is not None and owner.headless and not owner.captured:
        # Headless: the engines handshake with a remote head, so no READY
        # passes through here. Capture now, while they all still run.
        try:
            if all(getattr(p, "pid", None) is not None and p.exitcode is None for p in manager.processes):
                owner.capture()
        except Exception as e:
            log.warning("kvcached: owner capture failed: %s", e)
    try:
        return wrapped(*args, **kwargs)
    finally:
        if owner is not None:
            owner.after_shutdown()


def install(changes: Changes, found: OwnerTargets) -> None:
    """Wrap the manager's __init__ and shutdown, and the module's wait_for_engine_startup."""
    changes.wrap(found.manager, "__init__", _manager_init)
    changes.wrap(found.manager, "shutdown", _manager_shutdown)
    # launch_core_engines looks the function up in its module at call time, so wrapping the module's name is enough.
    changes.wrap(found.utils, "wait_for_engine_startup", _wait_for_engine_startup)


PATCH = Patch(
    name="owner-cleanup",
    does="the owner of the engine processes captures at READY and cleans up after a confirmed engine exit",
    targets=(f"{M_UTILS}:CoreEngineProcManager.__init__", f"{M_UTILS}:CoreEngineProcManager.shutdown",
             f"{M_UTILS}:wait_for_engine_startup"),
    probe=probe,
    install=install,
)

PATCHES: tuple[Patch, ...] = (PATCH,)
