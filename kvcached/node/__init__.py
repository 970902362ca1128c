"""The node layer's face: what kvctl, the integrations and the runtime import from it.

The node layer reads and cleans a node with the standard library and psutil
only. Its rooms, grouped by whom they serve (docs/ARCHITECTURE.md):

- `base/`: building blocks (enums, errors, units, IPC name rules, Layout, places, mountinfo, file handles);
- `state/`: node state primitives (the segment, leases, sock_diag, the gc lock);
- `clean/`: the cleaner (the /proc fact pass, scan, decision, guarded act, report; `leftovers/`: the engines' families);
- `places/`: every place of the node kvctl -A judges (pods' volumes, sandbox shm, other mount namespaces);
- `ops/`: the operations kvctl calls (gc and delete, inspect's view, doctor, metrics, demo, orphans);
- `in_engine/`: what engine processes run (the start-up claim and sweep, the owner's captured state).

Callers outside the node layer import names from here, never from a room:
`from kvcached.node import Layout, run_gc`. `FACE` is the one table of
those names, by the module that holds them; each is loaded on first use
(PEP 562, `__getattr__`: the layer's one lazy loader), so `import
kvcached.node` costs one small module and a TAB completion pays only for
what it reads. mypy reads the same names from the TYPE_CHECKING block below,
one import per module of the table; `tests/unit/test_rooms.py` holds the
two equal, the table true to the rooms, and every caller to the face.
"""

from __future__ import annotations

import sys

# room.module -> the names callers use from it (a name that is a module of the room: the module itself).
FACE: dict[str, tuple[str, ...]] = {
    "base.enums": ("Action", "Category", "EngineKind", "Kind", "Outcome", "State", "StrEnum"),
    "base.errors": ("IpcError", "KvcachedError", "ProtocolError", "SegmentMissing", "SocketInUse",
                    "UnsafeDirectory"),
    "base.layout": ("Layout",),
    "base.name_rules": ("dp_rank_name", "ipc_name_from_env"),
    "base.place": ("HOST_PLACE", "Place"),
    "base.published": ("PUBLISHED_MEMFD", "Published"),
    "base.units": ("BadValue", "format_duration", "format_size", "parse_duration", "parse_interval",
                   "parse_percent", "parse_size"),
    "clean.cleanup": ("Plan", "preview"),
    "clean.facts": ("gather_facts",),
    "clean.leftovers.act": ("plan_engines",),
    "clean.present": ("deployment_names", "engine_leftover_count", "rpc_dirs"),
    "clean.report": ("Entry", "Report", "Source"),
    "clean.rules": ("DEFAULT_GRACE", "Policy"),
    "gpu.holders": ("GpuReport", "find_holders", "prepare"),
    "in_engine.captured": ("SegmentCleanup", "WorkerSocketCleanup"),
    "in_engine.captured_buffers": ("BufferCleanup",),
    "in_engine.startup": ("claim_segment",),
    "in_engine.sweep": ("start_sweep",),
    "ops": ("diagnostics",),
    "ops.demo": ("demo_name", "run_demo"),
    "ops.detectdoc": ("Condition", "DetectDocument", "EngineSection", "Hazard", "PatchReport", "PatchStatus",
                      "Plugin", "ProcessMatch"),
    "ops.diagnostics": ("CheckResult", "Status"),
    "ops.gcrun": ("GcOptions", "GcResult", "check_options", "make_plan", "outcome_of", "run_delete", "run_gc"),
    "ops.heartbeat": ("HeartbeatError", "Recorder", "check", "check_target"),
    "ops.metrics_http": ("MetricsServer",),
    "ops.react": ("Reactor",),
    "ops.rounds": ("PlaceResult", "view_places", "would_remove"),
    "ops.view": ("DeploymentView", "NodeView", "build_view", "layout_for_pid"),
    "places.fill": ("fill_summary", "largest_summary", "place_fills"),
    "places.run": ("plan_places",),
    "state.lease": ("DirLease", "SegmentLease"),
    "state.segment": ("LimitWatch", "MappedReader", "SegmentInfo", "read_segment", "write_segment"),
    "state.sockdiag": ("Bind", "bound"),
}

TYPE_CHECKING = False
if TYPE_CHECKING:  # what mypy reads; at run time each name loads in __getattr__
    from .base.enums import Action, Category, EngineKind, Kind, Outcome, State, StrEnum
    from .base.errors import IpcError, KvcachedError, ProtocolError, SegmentMissing, SocketInUse, UnsafeDirectory
    from .base.layout import Layout
    from .base.name_rules import dp_rank_name, ipc_name_from_env
    from .base.place import HOST_PLACE, Place
    from .base.published import PUBLISHED_MEMFD, Published
    from .base.units import (
        BadValue,
        format_duration,
        format_size,
        parse_duration,
        parse_interval,
        parse_percent,
        parse_size,
    )
    from .clean.cleanup import Plan, preview
    from .clean.facts import gather_facts
    from .clean.leftovers.act import plan_engines
    from .clean.present import deployment_names, engine_leftover_count, rpc_dirs
    from .clean.report import Entry, Report, Source
    from .clean.rules import DEFAULT_GRACE, Policy
    from .gpu.holders import GpuReport, find_holders, prepare
    from .in_engine.captured import SegmentCleanup, WorkerSocketCleanup
    from .in_engine.captured_buffers import BufferCleanup
    from .in_engine.startup import claim_segment
    from .in_engine.sweep import start_sweep
    from .ops import diagnostics
    from .ops.demo import demo_name, run_demo
    from .ops.detectdoc import (
        Condition,
        DetectDocument,
        EngineSection,
        Hazard,
        PatchReport,
        PatchStatus,
        Plugin,
        ProcessMatch,
    )
    from .ops.diagnostics import CheckResult, Status
    from .ops.gcrun import GcOptions, GcResult, check_options, make_plan, outcome_of, run_delete, run_gc
    from .ops.heartbeat import HeartbeatError, Recorder, check, check_target
    from .ops.metrics_http import MetricsServer
    from .ops.react import Reactor
    from .ops.rounds import PlaceResult, view_places, would_remove
    from .ops.view import DeploymentView, NodeView, build_view, layout_for_pid
    from .places.fill import fill_summary, largest_summary, place_fills
    from .places.run import plan_places
    from .state.lease import DirLease, SegmentLease
    from .state.segment import LimitWatch, MappedReader, SegmentInfo, read_segment, write_segment
    from .state.sockdiag import Bind, bound

_HOME: dict[str, str] = {}  # name -> its module, from FACE on the first lookup


def __getattr__(name: str) -> object:
    """A face name, loaded from its room on first use and kept in this module."""
    if not _HOME:
        _HOME.update((n, home) for home, names in FACE.items() for n in names)
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # __import__, not importlib.import_module: the import statement's path, which -X importtime
    # reports (tests read it to prove what a TAB press loads). A name that is a module of the room
    # (ops.diagnostics) is imported as one.
    full = f"{__name__}.{home}"
    __import__(full)
    mod = sys.modules[full]
    if not hasattr(mod, name):
        __import__(f"{full}.{name}")
    value = getattr(mod, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The names loaded so far and every face name."""
    return sorted({*globals(), *(n for names in FACE.values() for n in names)})
