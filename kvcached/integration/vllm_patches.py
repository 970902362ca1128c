"""The patches kvcached applies to vLLM, found by feature detection, and a report of them.

Every patch point is recognised by the shape of the installed classes and
functions (a method present or absent, a parameter name, an attribute the
source assigns), never by a version string. A point whose shape we do not
recognise disables that patch, with one warning naming it; the others still
apply. docs/VLLM.md lists each point, how it is detected, and what a future
vLLM change would break first.

Patches:

- `lmcache-shutdown`: `LMCacheConnectorV1.shutdown()` forwarding to the
  wrapped LMCache engine/adapter (vLLM's connector inherits the base no-op).
- `owner-cleanup`: `CoreEngineProcManager.__init__`/`.shutdown` and
  `wait_for_engine_startup`: the owner of the engine processes captures the
  deployment's state at READY and removes it after a confirmed engine exit.
- `worker-listener`: `WorkerProc.__init__`/`.shutdown`: the worker's IPC
  listener starts with the worker and stops in its shutdown.
- `engine-state`: `UniProcExecutor`/`MultiprocExecutor` `_init_executor` and
  `shutdown`, `Executor.initialize_from_config`, `KVCacheManager.__init__`:
  the engine claims its segment (and at TP=1 serves `w0.sock`) when its
  executor starts, publishes its KV cache, and gives it all back in the
  executor's shutdown; an executor removes the sockets of workers it killed.

Ray executors, Ray data parallel and external launchers are left alone
(`not_covered`).

`detect()` imports vLLM when called, never at import: `kvctl doctor` calls it
in a subprocess.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging
import os
import re
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

from . import ENV_VLLM_PLUGINS, enabled, layout_from_env, plugin_allowed
from .engine_state import ENV_DP

log = logging.getLogger("kvcached.integration.vllm")

SCHEMA = "kvcached.vllm-detect/1"

M_UTILS = "vllm.v1.engine.utils"
M_CORE = "vllm.v1.engine.core"
M_EXECUTOR = "vllm.v1.executor.multiproc_executor"
M_UNIPROC = "vllm.v1.executor.uniproc_executor"
M_ABSTRACT = "vllm.v1.executor.abstract"
M_KV_MANAGER = "vllm.v1.core.kv_cache_manager"
M_LMCACHE = "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector"
M_ARGS = "vllm.engine.arg_utils"

_MARK = "__kvcached_original__"  # set on every wrapper: the function it wraps
OWNER_ATTR = "_kvcached_owner"
ENGINE_ATTR = "_kvcached_engine"  # on an executor: its engine's EngineState
WORKERS_ATTR = "_kvcached_workers"  # on a MultiprocExecutor: the EngineOwner of its worker processes
LISTENER_ATTR = "_kvcached_listener"
_LISTENER_TRIED = "_kvcached_listener_tried"
_LMCACHE_DONE = "_kvcached_lmcache_shutdown_done"


# The report ------------------------------------------------------------------


@dataclass(frozen=True)
class Condition:
    """A shutdown behaviour of the installed vLLM that leaks state (None: could not tell)."""

    name: str
    present: bool | None
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class PatchStatus:
    """One patch: whether the installed vLLM has its shape, whether it is applied here, and would be when enabled."""

    name: str
    targets: tuple[str, ...]
    applicable: bool  # the installed vLLM has the expected shape and needs this patch
    applied: bool  # installed in this process now
    active: bool  # applied here, or applied by the plugin in vLLM processes started with this environment
    detail: str

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["targets"] = list(self.targets)
        return d


@dataclass(frozen=True)
class VllmReport:
    """What `detect()` found: the vLLM installed, its leak conditions, and our patches."""

    vllm_version: str | None
    error: str | None  # why vLLM could not be inspected, if it could not
    enabled: bool  # ENABLE_KVCACHED / KVCACHED_ENABLE in this environment
    conditions: tuple[Condition, ...]
    patches: tuple[PatchStatus, ...]
    plugin_allowed: bool = True  # False: VLLM_PLUGINS is set and excludes kvcached, vLLM never loads it
    vllm_plugins: str | None = None  # VLLM_PLUGINS as set, if set
    ray_installed: bool = False  # Ray-backed serves are not covered (docs/VLLM.md)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; conditions and patches keyed by name."""
        return {
            "schema": SCHEMA,
            "vllm_version": self.vllm_version,
            "error": self.error,
            "enabled": self.enabled,
            "plugin_allowed": self.plugin_allowed,
            "vllm_plugins": self.vllm_plugins,
            "ray_installed": self.ray_installed,
            "conditions": {c.name: c.to_dict() for c in self.conditions},
            "patches": {p.name: p.to_dict() for p in self.patches},
        }


# Small helpers ---------------------------------------------------------------


def _module(name: str) -> Any:
    return importlib.import_module(name)


def _params(fn: Any) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def _source(fn: Any) -> str | None:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return None


def _original(fn: Any) -> Any:
    """The vLLM function under our wrapper (or `fn` itself when not wrapped)."""
    while fn is not None and hasattr(fn, _MARK):
        fn = getattr(fn, _MARK)
    return fn


def _is_ours(fn: Any) -> bool:
    return fn is not None and hasattr(fn, _MARK)


def _bound(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    try:
        return inspect.signature(fn).bind_partial(*args, **kwargs).arguments.get(name)
    except TypeError:
        return kwargs.get(name)


@contextmanager
def _env(name: str, value: str | None) -> Iterator[None]:
    """`name=value` in os.environ for the block (child processes started in it inherit it); None: unchanged."""
    if value is None:
        yield
        return
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def not_covered(parallel_config: Any) -> str | None:
    """Why kvcached leaves this executor or worker alone (Ray, external launchers), or None when it covers it."""
    if getattr(parallel_config, "use_ray", False) is True:
        return "Ray executor: its workers are Ray actors outside the serve's process group"
    if getattr(parallel_config, "data_parallel_backend", "mp") == "ray":
        return "Ray data parallel: engines are Ray actors that no engine owner cleans up after"
    if getattr(parallel_config, "distributed_executor_backend", None) == "external_launcher":
        return "external launcher (torchrun): every process is its own engine of one TP group"
    return None


class _Shape(Exception):
    """The installed vLLM does not have the shape a patch expects."""


class _NotNeeded(Exception):
    """vLLM already does what the patch would do."""


# Patch: LMCache shutdown forwarding ------------------------------------------


def _lmcache_probe() -> tuple[Any, str]:
    """(LMCacheConnectorV1, detail) when the patch applies; raises _NotNeeded or _Shape otherwise."""
    cls = _module(M_LMCACHE).LMCacheConnectorV1
    own = cls.__dict__.get("shutdown")
    if own is not None and not _is_ours(own):
        raise _NotNeeded("vLLM's LMCacheConnectorV1 defines shutdown() itself (it forwards)")
    src = _source(_original(cls.__init__)) or ""
    if "self._lmcache_engine" not in src:
        raise _Shape("LMCacheConnectorV1.__init__ no longer assigns self._lmcache_engine")
    if not callable(getattr(cls, "shutdown", None)):
        raise _Shape("LMCacheConnectorV1 has no inherited shutdown() to override")
    return cls, "adds LMCacheConnectorV1.shutdown() forwarding to the wrapped LMCache engine/adapter"


def _lmcache_apply() -> Callable[[], None]:
    cls, _ = _lmcache_probe()
    inherited = cls.shutdown  # the base class's, a no-op in vLLM 0.33

    def shutdown(self: Any) -> Any:
        # ensure_kv_transfer_shutdown() calls this once per worker, but other
        # teardown paths may too: forward exactly once.
        if self.__dict__.get(_LMCACHE_DONE):
            return None
        self.__dict__[_LMCACHE_DONE] = True
        _forward_lmcache_shutdown(self)
        return inherited(self)

    shutdown.__qualname__ = f"{cls.__qualname__}.shutdown"
    setattr(shutdown, _MARK, inherited)
    cls.shutdown = shutdown

    def undo() -> None:
        if cls.__dict__.get("shutdown") is shutdown:
            del cls.shutdown

    return undo


def _forward_lmcache_shutdown(connector: Any) -> None:
    engine = getattr(connector, "_lmcache_engine", None)
    if engine is None:
        log.info("kvcached: LMCacheConnectorV1.shutdown(): no LMCache engine to stop")
        return
    kind = type(engine).__qualname__
    # LMCache's own adapter has shutdown(); vLLM's native adapter (use_native=True)
    # has none in 0.33, so take whatever cleanup it offers, and say so when none.
    for method in ("shutdown", "close"):
        fn = getattr(engine, method, None)
        if callable(fn):
            log.info("kvcached: forwarding LMCacheConnectorV1.shutdown() to %s.%s()", kind, method)
            try:
                fn()
            except Exception as e:  # a failing LMCache teardown must not stop the worker's
                log.warning("kvcached: %s.%s() failed: %s", kind, method, e)
            return
    log.warning("kvcached: the LMCache adapter %s offers no shutdown() or close(); LMCache threads may keep "
                "EngineCore alive until it is force-killed", kind)


# Patch: owner-side cleanup -----------------------------------------------------


def _owner_probe() -> tuple[Any, Any, str]:
    mod = _module(M_UTILS)
    mgr = getattr(mod, "CoreEngineProcManager", None)
    wait = _original(getattr(mod, "wait_for_engine_startup", None))
    if mgr is None or wait is None:
        raise _Shape("vllm.v1.engine.utils lacks CoreEngineProcManager or wait_for_engine_startup")
    init = _original(mgr.__init__)
    if "vllm_config" not in _params(init) or "local_client" not in _params(init):
        raise _Shape("CoreEngineProcManager.__init__ no longer takes vllm_config and local_client")
    if "self.processes" not in (_source(init) or ""):
        raise _Shape("CoreEngineProcManager no longer keeps its engine processes in self.processes")
    if "timeout" not in _params(_original(mgr.shutdown)):
        raise _Shape("CoreEngineProcManager.shutdown() no longer takes a timeout")
    params = _params(wait)
    if "launch" not in params or "parallel_config" not in params:
        raise _Shape("wait_for_engine_startup() no longer takes launch and parallel_config")
    return mod, mgr, "captures at READY, cleans up after a confirmed engine exit"


def _owner_apply() -> Callable[[], None]:
    from .engine_owner import EngineOwner

    mod, mgr, _ = _owner_probe()
    orig_init, orig_shutdown, orig_wait = mgr.__init__, mgr.shutdown, mod.wait_for_engine_startup

    @functools.wraps(orig_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = functools.partial(_bound, orig_init, (self, *args), kwargs)
        parallel = getattr(bound("vllm_config"), "parallel_config", None)
        dp = getattr(parallel, "data_parallel_size", 1)
        is_dp = isinstance(dp, int) and dp > 1
        # The engines this starts inherit the marker (fork or spawn) and so name
        # themselves per DP rank, as the names below expect.
        with _env(ENV_DP, "1" if is_dp else None):
            orig_init(self, *args, **kwargs)
        try:
            tp = getattr(parallel, "tensor_parallel_size", None)
            pp = getattr(parallel, "pipeline_parallel_size", None)
            if not isinstance(tp, int) or not isinstance(pp, int):
                log.debug("kvcached: engine manager without a parallel config; no owner cleanup")
                return
            from ..node.naming import dp_rank_name, ipc_name_from_env

            base = ipc_name_from_env()
            start = int(bound("start_index") or 0)
            names = [dp_rank_name(base, start + i) for i in range(len(self.processes))] if is_dp else [base]
            owner = EngineOwner(self.processes, layout_from_env(), names, tp, pp, headless=not bound("local_client"))
            setattr(self, OWNER_ATTR, owner)
        except Exception as e:
            log.warning("kvcached: owner cleanup not set up: %s", e)

    @functools.wraps(orig_wait)
    def wait_for_engine_startup(*args: Any, **kwargs: Any) -> Any:
        result = orig_wait(*args, **kwargs)
        try:
            launch = _bound(orig_wait, args, kwargs, "launch")
            owner = getattr(getattr(launch, "engine_manager", None), OWNER_ATTR, None)
            if owner is not None:
                owner.capture()  # every engine answered READY
        except Exception as e:
            log.warning("kvcached: owner capture failed: %s", e)
        return result

    @functools.wraps(orig_shutdown)
    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        owner = self.__dict__.get(OWNER_ATTR)
        if owner is not None and owner.headless and not owner.captured:
            # Headless: the engines handshake with a remote head, so no READY
            # passes through here. Capture now, while they all still run.
            try:
                if all(getattr(p, "pid", None) is not None and p.exitcode is None for p in self.processes):
                    owner.capture()
            except Exception as e:
                log.warning("kvcached: owner capture failed: %s", e)
        try:
            return orig_shutdown(self, *args, **kwargs)
        finally:
            if owner is not None:
                owner.after_shutdown()

    for fn, orig in ((__init__, orig_init), (shutdown, orig_shutdown), (wait_for_engine_startup, orig_wait)):
        setattr(fn, _MARK, orig)
    mgr.__init__, mgr.shutdown = __init__, shutdown
    mod.wait_for_engine_startup = wait_for_engine_startup

    def undo() -> None:
        mgr.__init__, mgr.shutdown = orig_init, orig_shutdown
        mod.wait_for_engine_startup = orig_wait

    return undo


# Patch: worker listener --------------------------------------------------------

_worker_listener: Any = None
_worker_lock = threading.Lock()


def current_worker_listener() -> Any:
    """The WorkerListener this worker process serves, if any (the runtime registers its commands on it)."""
    return _worker_listener


def _worker_probe() -> tuple[Any, str]:
    cls = getattr(_module(M_EXECUTOR), "WorkerProc", None)
    if cls is None:
        raise _Shape("vllm.v1.executor.multiproc_executor has no WorkerProc")
    init_params = _params(_original(cls.__init__))
    if not {"vllm_config", "rank", "local_rank"} <= set(init_params):
        raise _Shape("WorkerProc.__init__ no longer takes vllm_config, local_rank and rank")
    if _params(_original(getattr(cls, "shutdown", None))) != ["self"]:
        raise _Shape("WorkerProc.shutdown() is missing or takes arguments")
    if _params(_original(getattr(cls, "worker_busy_loop", None))) != ["self"]:
        raise _Shape("WorkerProc.worker_busy_loop() is missing or takes arguments")
    return cls, "starts the worker's IPC listener with WorkerProc and stops it in WorkerProc.shutdown()"


def worker_ranks(parallel_config: Any, rank: int) -> tuple[int, int]:
    """(TP rank, PP stage) of global worker `rank`: from vLLM's groups when up, else from the rank layout."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return get_tp_group().rank_in_group, get_pp_group().rank_in_group
    except Exception:
        pass
    # vLLM orders world ranks as DP × PP × PCP × TP (TP fastest).
    tp = int(getattr(parallel_config, "tensor_parallel_size", 1) or 1)
    pcp = int(getattr(parallel_config, "prefill_context_parallel_size", 1) or 1)
    pp = int(getattr(parallel_config, "pipeline_parallel_size", 1) or 1)
    return rank % tp, (rank // (tp * pcp)) % pp


def start_worker_listener(worker: Any, vllm_config: Any, rank: int) -> Any:
    """Start this worker's listener (never raises); returns it or None."""
    global _worker_listener
    if worker.__dict__.get(_LISTENER_TRIED):
        return worker.__dict__.get(LISTENER_ATTR)
    worker.__dict__[_LISTENER_TRIED] = True
    try:
        from ..runtime.ipc.listener import WorkerListener
        from .engine_state import engine_name

        parallel = getattr(vllm_config, "parallel_config", None)
        why = not_covered(parallel)
        if why is not None:
            log.info("kvcached: worker rank %d serves no socket: %s", rank, why)
            return None
        tp_rank, stage = worker_ranks(parallel, rank)
        listener = WorkerListener(layout_from_env(), engine_name(parallel), tp_rank, stage)
        # Recorded before it binds: a SIGTERM landing in start() raises SystemExit
        # through here, and the worker's shutdown must still find what to stop.
        worker.__dict__[LISTENER_ATTR] = listener
        with _worker_lock:
            _worker_listener = listener
        listener.start()
        log.info("kvcached: worker rank %d (TP %d, PP %d) serves %s", rank, tp_rank, stage, listener.path)
        return listener
    except Exception as e:
        log.warning("kvcached: worker IPC listener not started: %s", e)
        stop_worker_listener(worker)
        return None


def stop_worker_listener(worker: Any) -> None:
    """Stop the worker's listener: close, unlink its node, remove emptied directories. Never raises."""
    global _worker_listener
    listener = getattr(worker, "__dict__", {}).pop(LISTENER_ATTR, None)
    if listener is None:
        return
    try:
        listener.stop()
    except Exception as e:
        log.warning("kvcached: worker IPC listener stop failed: %s", e)
    with _worker_lock:
        if _worker_listener is listener:
            _worker_listener = None


def _worker_apply() -> Callable[[], None]:
    cls, _ = _worker_probe()
    orig_init, orig_shutdown, orig_loop = cls.__init__, cls.shutdown, cls.worker_busy_loop

    @functools.wraps(orig_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        orig_init(self, *args, **kwargs)
        # After the original: vLLM's TP/PP groups are initialised, so the ranks are known.
        start_worker_listener(self, _bound(orig_init, (self, *args), kwargs, "vllm_config"),
                              int(_bound(orig_init, (self, *args), kwargs, "rank") or 0))

    @functools.wraps(orig_loop)
    def worker_busy_loop(self: Any) -> Any:
        # A spawned worker loads plugins inside WorkerProc.__init__ (in
        # WorkerWrapperBase.init_worker), too late to wrap that very call: start
        # the listener here instead, before the first RPC (the KV cache's).
        if not self.__dict__.get(_LISTENER_TRIED):
            start_worker_listener(self, getattr(getattr(self, "worker", None), "vllm_config", None),
                                  int(getattr(self, "rank", 0) or 0))
        return orig_loop(self)

    @functools.wraps(orig_shutdown)
    def shutdown(self: Any) -> Any:
        # First, before vLLM's own teardown: the parent's SIGKILL races this.
        stop_worker_listener(self)
        return orig_shutdown(self)

    for fn, orig in ((__init__, orig_init), (worker_busy_loop, orig_loop), (shutdown, orig_shutdown)):
        setattr(fn, _MARK, orig)
    cls.__init__, cls.worker_busy_loop, cls.shutdown = __init__, worker_busy_loop, shutdown

    def undo() -> None:
        cls.__init__, cls.worker_busy_loop, cls.shutdown = orig_init, orig_loop, orig_shutdown

    return undo


# Patch: the engine's own state ---------------------------------------------------


def _engine_probe() -> tuple[Any, Any, Any, Any, str]:
    uni = getattr(_module(M_UNIPROC), "UniProcExecutor", None)
    mp = getattr(_module(M_EXECUTOR), "MultiprocExecutor", None)
    base = getattr(_module(M_ABSTRACT), "Executor", None)
    kv_manager = getattr(_module(M_KV_MANAGER), "KVCacheManager", None)
    if uni is None or mp is None or base is None or kv_manager is None:
        raise _Shape("UniProcExecutor, MultiprocExecutor, Executor or KVCacheManager is missing")
    for cls in (uni, mp):
        for method in ("_init_executor", "shutdown"):
            if _params(_original(cls.__dict__.get(method))) != ["self"]:
                raise _Shape(f"{cls.__name__}.{method}() is missing or takes arguments")
    if _params(_original(base.__dict__.get("initialize_from_config"))) != ["self", "kv_cache_configs"]:
        raise _Shape("Executor.initialize_from_config(kv_cache_configs) is missing or changed")
    if any(m in uni.__dict__ or m in mp.__dict__ for m in ("initialize_from_config",)):
        raise _Shape("an executor overrides initialize_from_config")
    if not isinstance(getattr(kv_manager, "usage", None), property):
        raise _Shape("KVCacheManager.usage is no longer a property")
    return uni, mp, base, kv_manager, ("the engine claims its segment when its executor starts (and serves "
                                       "w0.sock at TP=1), publishes its KV cache, and gives both back in the "
                                       "executor's shutdown")


def _device_total() -> int | None:
    """One device's total memory, without creating a CUDA context in the engine process."""
    try:
        from vllm.platforms import current_platform

        return int(current_platform.get_device_total_memory(0))  # NVML on CUDA: no context
    except Exception:
        pass
    try:
        import psutil

        # No GPU platform (vLLM's CPU backend, tests): the KV cache lives in host memory.
        return int(psutil.virtual_memory().total)
    except Exception:
        return None


def engine_limit(vllm_config: Any) -> Any:
    """The limit this engine claims with (KVCACHED_LIMIT, else vLLM's memory share of one device)."""
    from ..node.units import BadValue
    from .limits import resolve_limit

    share = getattr(getattr(vllm_config, "cache_config", None), "gpu_memory_utilization", 0.9)
    share = share if isinstance(share, float) and 0 < share <= 1 else 0.9
    try:
        return resolve_limit(_device_total, share)
    except BadValue as e:
        log.warning("kvcached: %s; using vLLM's memory share instead", e)
        return resolve_limit(_device_total, share, {})


def start_engine(executor: Any, *, serve: bool) -> Any:
    """After the executor started: the engine's name, its TP=1 socket, its segment; the EngineState, never raises."""
    global _worker_listener
    try:
        from .engine_state import EngineState, engine_name, register

        parallel = executor.parallel_config
        why = not_covered(parallel)
        if why is not None:
            log.info("kvcached: %s not covered: %s", type(executor).__name__, why)
            return None
        state = EngineState(layout_from_env(), engine_name(parallel))
        executor.__dict__[ENGINE_ATTR] = state
        register(state)
        if serve:
            listener = state.serve(0, 0)
            if listener is not None:
                with _worker_lock:
                    _worker_listener = listener
        # Workers of a DP replica that spans nodes run headless on the other
        # nodes (node_rank_within_dp > 0); the segment is the head engine's.
        if getattr(parallel, "node_rank_within_dp", 0) == 0:
            state.claim(engine_limit(executor.vllm_config))
        return state
    except Exception as e:
        log.warning("kvcached: engine state not set up: %s", e)
        return None


def stop_engine(executor: Any) -> None:
    """Give back what the engine holds: its socket, its lease, its segment. Never raises."""
    global _worker_listener
    state = executor.__dict__.get(ENGINE_ATTR)
    if state is None:
        return
    with _worker_lock:
        if _worker_listener is state.listener:
            _worker_listener = None
    state.release()


def _kv_bytes(kv_cache_configs: Any) -> int:
    """KV cache bytes one rank allocates: its tensors' sizes (the largest rank's, should ranks differ)."""
    try:
        return max((sum(int(t.size) for t in cfg.kv_cache_tensors) for cfg in kv_cache_configs), default=0)
    except (TypeError, AttributeError):
        return 0


def _engine_apply() -> Callable[[], None]:
    from .engine_owner import EngineOwner
    from .engine_state import current_engine

    uni, mp, base, kv_manager, _ = _engine_probe()
    originals = [
        (uni, "_init_executor", uni._init_executor),
        (uni, "shutdown", uni.shutdown),
        (mp, "_init_executor", mp._init_executor),
        (mp, "shutdown", mp.shutdown),
        (base, "initialize_from_config", base.initialize_from_config),
        (kv_manager, "__init__", kv_manager.__init__),
    ]
    orig = {(cls, name): fn for cls, name, fn in originals}

    def uni_init(self: Any) -> None:
        orig[uni, "_init_executor"](self)
        start_engine(self, serve=True)  # TP=1: the model runs here, so this process serves w0.sock

    def uni_shutdown(self: Any) -> Any:
        state = self.__dict__.get(ENGINE_ATTR)
        if state is not None:
            state.stop_serving()  # first, like a worker: whatever kills us next, the node is gone
        try:
            return orig[uni, "shutdown"](self)
        finally:
            stop_engine(self)

    def mp_init(self: Any) -> None:
        orig[mp, "_init_executor"](self)
        state = start_engine(self, serve=False)
        try:
            if state is not None:
                procs = [w.proc for w in getattr(self, "workers", None) or []]
                tp = self.parallel_config.tensor_parallel_size
                pp = self.parallel_config.pipeline_parallel_size
                self.__dict__[WORKERS_ATTR] = EngineOwner(procs, state.layout, [state.name], tp, pp, segments=False)
        except Exception as e:
            log.warning("kvcached: worker cleanup not set up: %s", e)

    def mp_shutdown(self: Any) -> Any:
        owner = self.__dict__.get(WORKERS_ATTR)
        if owner is not None and not owner.captured:
            # A headless node's executor never runs initialize_from_config: capture
            # now, but only while every worker still runs (their nodes are theirs).
            try:
                if all(p.exitcode is None for p in owner.processes):
                    owner.capture()
            except Exception as e:
                log.warning("kvcached: worker capture failed: %s", e)
        try:
            return orig[mp, "shutdown"](self)
        finally:
            if owner is not None:
                owner.after_shutdown()
            stop_engine(self)

    def initialize_from_config(self: Any, kv_cache_configs: Any) -> Any:
        result = orig[base, "initialize_from_config"](self, kv_cache_configs)
        try:
            state = self.__dict__.get(ENGINE_ATTR)
            if state is not None:
                state.track_kv_cache(_kv_bytes(kv_cache_configs))
            owner = self.__dict__.get(WORKERS_ATTR)
            if owner is not None:
                owner.capture()  # every worker ran this RPC: each is in its busy loop, its socket bound
        except Exception as e:
            log.warning("kvcached: KV cache not tracked: %s", e)
        return result

    def kv_manager_init(self: Any, *args: Any, **kwargs: Any) -> None:
        orig[kv_manager, "__init__"](self, *args, **kwargs)
        try:
            engine = current_engine()
            if engine is not None:
                ref = weakref.ref(self)
                engine.follow_usage(lambda: ref().usage)  # type: ignore[union-attr]
        except Exception as e:
            log.warning("kvcached: KV cache usage not followed: %s", e)

    wrappers = {
        (uni, "_init_executor"): uni_init,
        (uni, "shutdown"): uni_shutdown,
        (mp, "_init_executor"): mp_init,
        (mp, "shutdown"): mp_shutdown,
        (base, "initialize_from_config"): initialize_from_config,
        (kv_manager, "__init__"): kv_manager_init,
    }
    for (cls, name), fn in wrappers.items():
        functools.update_wrapper(cast(Any, fn), orig[cls, name])
        setattr(fn, _MARK, orig[cls, name])
        setattr(cls, name, fn)

    def undo() -> None:
        for cls, name, fn in originals:
            setattr(cls, name, fn)

    return undo


# Patch: elastic KV (issue 14) ------------------------------------------------
# The patch itself is kvcached/integration/vllm_elastic.py; only its registration is here.


def _elastic_probe() -> tuple[Any, str]:
    from . import vllm_elastic

    if not vllm_elastic.elastic_enabled():
        raise _NotNeeded(f"elastic KV memory is off (set {vllm_elastic.ENV_ELASTIC}=1)")
    try:
        return vllm_elastic.probe()
    except vllm_elastic.ShapeError as e:
        raise _Shape(str(e)) from None


def _elastic_apply() -> Callable[[], None]:
    _elastic_probe()
    from . import vllm_elastic

    return vllm_elastic.apply()


_ELASTIC_TARGETS = (
    "vllm.v1.executor.abstract:Executor.initialize_from_config",
    "vllm.v1.worker.utils:allocate_kv_cache",
    "vllm.v1.core.kv_cache_manager:KVCacheManager.__init__",
    "vllm.v1.core.kv_cache_coordinator:BlockPool",
    "vllm.v1.core.sched.scheduler:Scheduler.schedule",
    "vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
    "vllm.v1.core.sched.scheduler:Scheduler.finish_requests",
)
# End of the elastic KV registration -------------------------------------------


# Registry --------------------------------------------------------------------


@dataclass(frozen=True)
class _Patch:
    name: str
    targets: tuple[str, ...]
    probe: Callable[[], Any]
    apply: Callable[[], Callable[[], None]]


PATCHES: tuple[_Patch, ...] = (
    _Patch("lmcache-shutdown", (f"{M_LMCACHE}:LMCacheConnectorV1.shutdown",), _lmcache_probe, _lmcache_apply),
    _Patch(
        "owner-cleanup",
        (
            f"{M_UTILS}:CoreEngineProcManager.__init__",
            f"{M_UTILS}:CoreEngineProcManager.shutdown",
            f"{M_UTILS}:wait_for_engine_startup",
        ),
        _owner_probe,
        _owner_apply,
    ),
    _Patch(
        "worker-listener",
        (
            f"{M_EXECUTOR}:WorkerProc.__init__",
            f"{M_EXECUTOR}:WorkerProc.worker_busy_loop",
            f"{M_EXECUTOR}:WorkerProc.shutdown",
        ),
        _worker_probe,
        _worker_apply,
    ),
    _Patch(
        "engine-state",
        (
            f"{M_UNIPROC}:UniProcExecutor._init_executor",
            f"{M_UNIPROC}:UniProcExecutor.shutdown",
            f"{M_EXECUTOR}:MultiprocExecutor._init_executor",
            f"{M_EXECUTOR}:MultiprocExecutor.shutdown",
            f"{M_ABSTRACT}:Executor.initialize_from_config",
            f"{M_KV_MANAGER}:KVCacheManager.__init__",
        ),
        _engine_probe,
        _engine_apply,
    ),
    _Patch("elastic-kv", _ELASTIC_TARGETS, _elastic_probe, _elastic_apply),  # issue 14, vllm_elastic.py
)

_applied: dict[str, Callable[[], None]] = {}
_warned: set[str] = set()
_apply_lock = threading.Lock()


def _probe(p: _Patch) -> tuple[bool, str]:
    try:
        out = p.probe()
        return True, out[-1]
    except _NotNeeded as e:
        return False, f"not needed: {e}"
    except _Shape as e:
        return False, f"unknown vLLM shape: {e}"
    except Exception as e:
        return False, f"cannot inspect: {type(e).__name__}: {e}"


def apply(names: tuple[str, ...] | None = None) -> dict[str, bool]:
    """Apply every applicable patch (or those named) once per process; name → applied. Never raises."""
    out: dict[str, bool] = {}
    with _apply_lock:
        for p in PATCHES:
            if names is not None and p.name not in names:
                continue
            if p.name in _applied:
                out[p.name] = True
                continue
            ok, detail = _probe(p)
            if ok:
                try:
                    _applied[p.name] = p.apply()
                    log.info("kvcached: vLLM patch %s applied", p.name)
                except Exception as e:
                    ok, detail = False, f"apply failed: {type(e).__name__}: {e}"
            if not ok and not detail.startswith("not needed") and p.name not in _warned:
                _warned.add(p.name)
                log.warning("kvcached: vLLM patch %s disabled: %s", p.name, detail)
            elif not ok:
                log.info("kvcached: vLLM patch %s skipped: %s", p.name, detail)
            out[p.name] = p.name in _applied
    return out


def revert(names: tuple[str, ...] | None = None) -> None:
    """Undo applied patches (tests compare patched and unpatched vLLM in one process)."""
    with _apply_lock:
        for p in reversed(PATCHES):
            if (names is None or p.name in names) and p.name in _applied:
                _applied.pop(p.name)()


def applied() -> tuple[str, ...]:
    """Names of the patches installed in this process."""
    return tuple(p.name for p in PATCHES if p.name in _applied)


# Conditions ------------------------------------------------------------------


def _cond_shutdown_timeout() -> Condition:
    name = "shutdown-timeout-zero"
    try:
        args = _module(M_ARGS).EngineArgs
        field = next((f for f in dataclasses.fields(args) if f.name == "shutdown_timeout"), None)
        if field is None or field.default is dataclasses.MISSING:
            return Condition(name, None, "EngineArgs has no shutdown_timeout default")
        zero = field.default == 0
        return Condition(
            name,
            zero,
            f"EngineArgs.shutdown_timeout defaults to {field.default!r}"
            + ("; engines are SIGKILLed almost at once after SIGTERM" if zero else ""),
        )
    except Exception as e:
        return Condition(name, None, f"cannot inspect: {type(e).__name__}: {e}")


_DFL_RE = re.compile(r"signal\.signal\(\s*signal\.SIGTERM\s*,\s*signal\.SIG_DFL\s*\)")
_TEARDOWN_RE = re.compile(r"engine_core\.shutdown\(\s*\)")


def _cond_sigterm_reset() -> Condition:
    name = "sigterm-reset-before-teardown"
    try:
        fn = _module(M_CORE).EngineCoreProc.run_engine_core
        src = _source(fn)
        if src is None:
            return Condition(name, None, "no source for EngineCoreProc.run_engine_core")
        dfl, teardown = _DFL_RE.search(src), _TEARDOWN_RE.search(src)
        if teardown is None:
            return Condition(name, None, "EngineCoreProc.run_engine_core no longer calls engine_core.shutdown()")
        present = dfl is not None and dfl.start() < teardown.start()
        return Condition(
            name,
            present,
            "EngineCoreProc.run_engine_core restores SIG_DFL for SIGTERM before "
            "engine_core.shutdown(): a second SIGTERM kills EngineCore mid-teardown"
            if present
            else "SIGTERM keeps a handler during EngineCore teardown",
        )
    except Exception as e:
        return Condition(name, None, f"cannot inspect: {type(e).__name__}: {e}")


def _cond_lmcache() -> Condition:
    name = "lmcache-no-shutdown-forwarding"
    try:
        cls = _module(M_LMCACHE).LMCacheConnectorV1
        own = cls.__dict__.get("shutdown")
        present = own is None or _is_ours(own)
        return Condition(
            name,
            present,
            "LMCacheConnectorV1 inherits the base no-op shutdown(): the LMCache engine is never stopped"
            if present
            else "LMCacheConnectorV1 defines shutdown()",
        )
    except Exception as e:
        return Condition(name, None, f"cannot inspect: {type(e).__name__}: {e}")


def detect() -> VllmReport:
    """Inspect the installed vLLM: its leak conditions and each patch's status. Imports vLLM; never raises."""
    import importlib.util

    on = enabled()
    allowed = plugin_allowed()
    plugins = os.environ.get(ENV_VLLM_PLUGINS)
    try:
        version = getattr(_module("vllm"), "__version__", None)
    except Exception as e:
        return VllmReport(None, f"vLLM not importable: {type(e).__name__}: {e}", on, (), (), allowed, plugins)
    try:
        ray = importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):
        ray = False
    conditions = (_cond_shutdown_timeout(), _cond_sigterm_reset(), _cond_lmcache())
    patches = []
    for p in PATCHES:
        ok, detail = _probe(p)
        is_applied = p.name in _applied
        patches.append(
            PatchStatus(
                p.name,
                p.targets,
                ok or is_applied,
                is_applied,
                is_applied or (ok and on and allowed),
                detail if ok or not is_applied else "applied",
            )
        )
    return VllmReport(version, None, on, conditions, tuple(patches), allowed, plugins, ray)
