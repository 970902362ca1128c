"""What the SGLang patches share: SGLang's module names, this process's ranks and IPC name, what we stand aside from.

Nothing here imports SGLang at import; `module()` and the readers do when a patch asks.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ... import settings
from ...node import dp_rank_name, ipc_name_from_env
from ..patchkit import ShapeError, params, source

log = logging.getLogger(__name__)

PLUGIN_NAME = "kvcached"  # the entry point's name in group sglang.srt.plugins
TAG = "SGLang"  # the tag of our default IPC name, kvcached_SGLang_<PGID> (docs/NODE.md §1), as upstream's

M_SCHEDULER = "sglang.srt.managers.scheduler"
M_ENGINE = "sglang.srt.entrypoints.engine"
M_COMMON = "sglang.srt.utils.common"
M_TOKENIZER = "sglang.srt.managers.tokenizer_manager"
M_RUNTIME = "sglang.srt.runtime_context"
M_ENVIRON = "sglang.srt.environ"
# What sglang-elastic-kv changes beside them.
M_PLATFORM = "sglang.srt.platforms.interface"
M_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator"
M_POOL = "sglang.srt.mem_cache.memory_pool"
M_ALLOCATOR = "sglang.srt.mem_cache.allocator"
M_BUDGET = "sglang.srt.mem_cache.prefill_budget"

# Where a scheduler's ranks are first known: the worker listener and the segment patches both hook it.
CONFIGURE = f"{M_SCHEDULER}:configure_scheduler_process"


def module(name: str) -> Any:
    """The SGLang module `name`, imported now."""
    return importlib.import_module(name)


def plugin_allowed(environ: Mapping[str, str] | None = None) -> bool:
    """False when `SGLANG_PLUGINS` keeps SGLang from loading our entry point in its processes.

    Parsed as SGLang 0.5.23 parses it (`load_plugins_by_group`): unset or empty
    allows every plugin; otherwise a comma-separated list of entry-point names,
    each stripped, so a value of only commas or blanks allows none.
    """
    raw = settings.SGLANG_PLUGINS.get(environ)
    if not raw:
        return True
    return PLUGIN_NAME in {x.strip() for x in raw.split(",") if x.strip()}


@dataclass(frozen=True)
class Ranks:
    """Where one scheduler sits: SGLang's own ranks, and what kvcached derives from them."""

    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dp_rank: int | None  # None without a DP controller: the serve has one name
    attn_dp_size: int  # > 1 with DP attention: the DP ranks share one TP group

    @property
    def local_tp_size(self) -> int:
        """Schedulers per PP stage of this DP rank: the whole TP group, or its share under DP attention."""
        return max(1, self.tp_size // self.attn_dp_size)

    @property
    def local_tp_rank(self) -> int:
        """This scheduler's index among its DP rank's schedulers of one PP stage: its socket is `w<index>.sock`."""
        return self.tp_rank % self.local_tp_size

    @property
    def claims(self) -> bool:
        """TP rank 0 of PP stage 0 of its DP rank: the scheduler that claims the DP rank's segment."""
        return self.local_tp_rank == 0 and self.pp_rank == 0


def scheduler_ranks() -> Ranks:
    """This scheduler's ranks, from what SGLang published in it (`publish(..., ranks=SpawnRanks(...))`)."""
    parallel = module(M_RUNTIME).get_parallel()
    dp_size = int(parallel.attn_dp_size) if parallel.attn_dp_enabled else 1
    dp = parallel.dp_rank
    return Ranks(tp_rank=int(parallel.tp_rank), tp_size=int(parallel.tp_size), pp_rank=int(parallel.pp_rank),
                 pp_size=int(parallel.pp_size), dp_rank=None if dp is None else int(dp), attn_dp_size=dp_size)


def engine_name(dp_rank: int | None, environ: Mapping[str, str] | None = None) -> str:
    """The IPC name of one DP rank's schedulers: the serve's name, plus `_dp<rank>` in a serve with DP ranks."""
    base = ipc_name_from_env(environ, tag=TAG)
    return base if dp_rank is None else dp_rank_name(base, dp_rank)


def serve_names(num_dp_ranks: int, environ: Mapping[str, str] | None = None) -> list[str]:
    """Every DP rank's IPC name in a serve of `num_dp_ranks` ranks (one name without DP)."""
    if num_dp_ranks <= 1:
        return [engine_name(None, environ)]
    return [engine_name(r, environ) for r in range(num_dp_ranks)]


# SGLang's devices kvcached covers; the others have their own pools and platform plugins.
COVERED_DEVICES = ("cuda", "cpu")


def not_covered() -> str | None:
    """Why kvcached leaves this SGLang process alone (a shape it does not cover), or None when it covers it.

    Read from what SGLang published in the process (its config bags), so it
    answers the same in main, in the DP controller and in every scheduler.
    """
    rt = module(M_RUNTIME)
    if getattr(rt.get_device(), "use_ray", False) is True:
        return "Ray (--use-ray): the schedulers are Ray actors outside the serve's process tree"
    if module(M_ENVIRON).envs.SGLANG_RUST_SERVER.get():
        return "the Rust server (SGLANG_RUST_SERVER): scheduler rank 0 embeds the HTTP server and its stop paths"
    parallel = rt.get_parallel()
    if int(getattr(parallel, "node_rank", 0) or 0) > 0:
        return f"node {parallel.node_rank} of a multi-node serve: node 0 holds the serve's segments"
    device = getattr(rt.get_device(), "device", None)
    if device not in COVERED_DEVICES:
        return f"device {device!r}: kvcached covers {' and '.join(COVERED_DEVICES)}"
    import torch

    if device == "cuda" and getattr(torch.version, "hip", None):
        return "ROCm (HIP): kvcached's GPU backend is CUDA's"
    return None


_said: set[str] = set()


def stand_aside(where: str) -> str | None:
    """`not_covered()`, logged once per process and reason; None when kvcached covers this process."""
    try:
        why = not_covered()
    except Exception as e:  # an unreadable shape is one we do not cover
        why = f"cannot read SGLang's configuration: {type(e).__name__}: {e}"
    if why is not None and why not in _said:
        _said.add(why)
        log.info("kvcached: SGLang %s stands aside: %s", where, why)
    return why


# -- one scheduler process: what the worker listener and the claim share ------------------------------

# This process's scheduler state (its EngineState and ranks); a container, not a module-level alias of
# anything SGLang's hook registry could rebind.
SCHEDULER: dict[str, Any] = {}


def probe_configure() -> Any:
    """The scheduler module, when `configure_scheduler_process` runs after plugins load and after the ranks."""
    mod = module(M_SCHEDULER)
    configure = getattr(mod, "configure_scheduler_process", None)
    run = getattr(mod, "run_scheduler_process", None)
    if configure is None or run is None:
        raise ShapeError("sglang.srt.managers.scheduler lacks configure_scheduler_process or run_scheduler_process")
    if params(configure)[:2] != ["server_args", "gpu_id"]:
        raise ShapeError("configure_scheduler_process no longer takes (server_args, gpu_id, ...)")
    src = source(run) or ""
    calls = [src.find(s) for s in ("load_plugins()", "publish(", "configure_scheduler_process(")]
    if -1 in calls or sorted(calls) != calls:
        raise ShapeError("run_scheduler_process no longer loads plugins, publishes its ranks, then calls "
                         "configure_scheduler_process")
    if not callable(getattr(module(M_RUNTIME), "get_parallel", None)):
        raise ShapeError("sglang.srt.runtime_context has no get_parallel()")
    return mod


def scheduler_engine() -> Any:
    """This scheduler's EngineState (made once, its name and ranks fixed); None where kvcached stands aside."""
    if "engine" in SCHEDULER:
        return SCHEDULER["engine"]
    SCHEDULER["engine"] = None
    if stand_aside("scheduler") is not None:
        return None
    from .. import layout_from_env
    from ..engine_claim import EngineState, register

    ranks = scheduler_ranks()
    engine = EngineState(layout_from_env(), engine_name(ranks.dp_rank))
    register(engine)
    SCHEDULER.update(engine=engine, ranks=ranks)
    return engine
