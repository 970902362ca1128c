"""The node layer's face: what kvctl, the integrations and the runtime import from it.

The node layer reads and cleans a node with the standard library and psutil
only. Its rooms, grouped by whom they serve (docs/ARCHITECTURE.md):

- `base/`: building blocks (enums, errors, units, IPC name rules, Layout, mountinfo, file handles);
- `state/`: node state primitives (the segment, leases, sock_diag, the gc lock);
- `clean/`: the cleaner (the /proc fact pass, scan, decision, guarded act, report; `leftovers/`: the engines' families);
- `places/`: every place of the node kvctl -A judges (pods' volumes, sandbox shm, other mount namespaces);
- `ops/`: the operations kvctl calls (gc and delete, inspect's view, doctor, metrics, demo, orphans);
- `in_engine/`: what engine processes run (the start-up claim and sweep, the owner's captured state).

Callers outside the node layer import names from here, never from a room:
`from kvcached.node import Layout, run_gc`. Each name is loaded on first
use (PEP 562), so `import kvcached.node` costs one small module and a TAB
completion pays only for what it reads. `tests/unit/test_rooms.py` holds the
table below to the rooms and every caller to the face.
"""

from __future__ import annotations

import sys

# name -> (room.module, attribute); attribute None: the name is the module itself.
FACE: dict[str, tuple[str, str | None]] = {
    "Action": ("base.enums", "Action"),
    "Category": ("base.enums", "Category"),
    "EngineKind": ("base.enums", "EngineKind"),
    "Kind": ("base.enums", "Kind"),
    "Outcome": ("base.enums", "Outcome"),
    "State": ("base.enums", "State"),
    "StrEnum": ("base.enums", "StrEnum"),
    "IpcError": ("base.errors", "IpcError"),
    "KvcachedError": ("base.errors", "KvcachedError"),
    "ProtocolError": ("base.errors", "ProtocolError"),
    "SegmentMissing": ("base.errors", "SegmentMissing"),
    "SocketInUse": ("base.errors", "SocketInUse"),
    "UnsafeDirectory": ("base.errors", "UnsafeDirectory"),
    "Layout": ("base.layout", "Layout"),
    "dp_rank_name": ("base.name_rules", "dp_rank_name"),
    "ipc_name_from_env": ("base.name_rules", "ipc_name_from_env"),
    "PUBLISHED_MEMFD": ("base.published", "PUBLISHED_MEMFD"),
    "Published": ("base.published", "Published"),
    "BadValue": ("base.units", "BadValue"),
    "format_duration": ("base.units", "format_duration"),
    "format_size": ("base.units", "format_size"),
    "parse_duration": ("base.units", "parse_duration"),
    "parse_interval": ("base.units", "parse_interval"),
    "parse_percent": ("base.units", "parse_percent"),
    "parse_size": ("base.units", "parse_size"),
    "Plan": ("clean.cleanup", "Plan"),
    "DEFAULT_GRACE": ("clean.decide", "DEFAULT_GRACE"),
    "Policy": ("clean.decide", "Policy"),
    "gather_facts": ("clean.facts", "gather_facts"),
    "plan_engines": ("clean.leftovers.act", "plan_engines"),
    "deployment_names": ("clean.present", "deployment_names"),
    "engine_leftover_count": ("clean.present", "engine_leftover_count"),
    "rpc_dirs": ("clean.present", "rpc_dirs"),
    "Entry": ("clean.report", "Entry"),
    "Report": ("clean.report", "Report"),
    "Source": ("clean.report", "Source"),
    "preview": ("clean.report", "preview"),
    "find_holders": ("gpu.holders", "find_holders"),
    "prepare": ("gpu.holders", "prepare"),
    "OwnerResult": ("in_engine.captured", "OwnerResult"),
    "SegmentCleanup": ("in_engine.captured", "SegmentCleanup"),
    "WorkerSocketCleanup": ("in_engine.captured", "WorkerSocketCleanup"),
    "BufferCleanup": ("in_engine.captured_buffers", "BufferCleanup"),
    "claim_segment": ("in_engine.startup", "claim_segment"),
    "start_sweep": ("in_engine.sweep", "start_sweep"),
    "demo_name": ("ops.demo", "demo_name"),
    "run_demo": ("ops.demo", "run_demo"),
    "Condition": ("ops.detectdoc", "Condition"),
    "DetectDocument": ("ops.detectdoc", "DetectDocument"),
    "EngineSection": ("ops.detectdoc", "EngineSection"),
    "Hazard": ("ops.detectdoc", "Hazard"),
    "PatchReport": ("ops.detectdoc", "PatchReport"),
    "PatchStatus": ("ops.detectdoc", "PatchStatus"),
    "Plugin": ("ops.detectdoc", "Plugin"),
    "ProcessMatch": ("ops.detectdoc", "ProcessMatch"),
    "CheckResult": ("ops.diagnostics", "CheckResult"),
    "Status": ("ops.diagnostics", "Status"),
    "diagnostics": ("ops.diagnostics", None),
    "GcOptions": ("ops.gcrun", "GcOptions"),
    "GcResult": ("ops.gcrun", "GcResult"),
    "check_options": ("ops.gcrun", "check_options"),
    "make_plan": ("ops.gcrun", "make_plan"),
    "outcome_of": ("ops.gcrun", "outcome_of"),
    "run_delete": ("ops.gcrun", "run_delete"),
    "run_gc": ("ops.gcrun", "run_gc"),
    "HeartbeatError": ("ops.heartbeat", "HeartbeatError"),
    "Recorder": ("ops.heartbeat", "Recorder"),
    "check": ("ops.heartbeat", "check"),
    "check_target": ("ops.heartbeat", "check_target"),
    "MetricsServer": ("ops.metrics_http", "MetricsServer"),
    "DeploymentView": ("ops.view", "DeploymentView"),
    "NodeView": ("ops.view", "NodeView"),
    "build_view": ("ops.view", "build_view"),
    "layout_for_pid": ("ops.view", "layout_for_pid"),
    "HOST_PLACE": ("places.discover", "HOST_PLACE"),
    "PlaceResult": ("places.run", "PlaceResult"),
    "plan_places": ("places.run", "plan_places"),
    "view_places": ("places.run", "view_places"),
    "would_remove": ("places.run", "would_remove"),
    "DirLease": ("state.lease", "DirLease"),
    "SegmentLease": ("state.lease", "SegmentLease"),
    "LimitWatch": ("state.segment", "LimitWatch"),
    "MappedReader": ("state.segment", "MappedReader"),
    "SegmentInfo": ("state.segment", "SegmentInfo"),
    "read_segment": ("state.segment", "read_segment"),
    "write_segment": ("state.segment", "write_segment"),
    "Bind": ("state.sockdiag", "Bind"),
    "bound": ("state.sockdiag", "bound"),
}

TYPE_CHECKING = False
if TYPE_CHECKING:  # what mypy reads; at run time names load in __getattr__
    from .base.enums import (
        Action as Action,
    )
    from .base.enums import (
        Category as Category,
    )
    from .base.enums import (
        EngineKind as EngineKind,
    )
    from .base.enums import (
        Kind as Kind,
    )
    from .base.enums import (
        Outcome as Outcome,
    )
    from .base.enums import (
        State as State,
    )
    from .base.enums import (
        StrEnum as StrEnum,
    )
    from .base.errors import (
        IpcError as IpcError,
    )
    from .base.errors import (
        KvcachedError as KvcachedError,
    )
    from .base.errors import (
        ProtocolError as ProtocolError,
    )
    from .base.errors import (
        SegmentMissing as SegmentMissing,
    )
    from .base.errors import (
        SocketInUse as SocketInUse,
    )
    from .base.errors import (
        UnsafeDirectory as UnsafeDirectory,
    )
    from .base.layout import (
        Layout as Layout,
    )
    from .base.name_rules import (
        dp_rank_name as dp_rank_name,
    )
    from .base.name_rules import (
        ipc_name_from_env as ipc_name_from_env,
    )
    from .base.published import (
        PUBLISHED_MEMFD as PUBLISHED_MEMFD,
    )
    from .base.published import (
        Published as Published,
    )
    from .base.units import (
        BadValue as BadValue,
    )
    from .base.units import (
        format_duration as format_duration,
    )
    from .base.units import (
        format_size as format_size,
    )
    from .base.units import (
        parse_duration as parse_duration,
    )
    from .base.units import (
        parse_interval as parse_interval,
    )
    from .base.units import (
        parse_percent as parse_percent,
    )
    from .base.units import (
        parse_size as parse_size,
    )
    from .clean.cleanup import (
        Plan as Plan,
    )
    from .clean.decide import (
        DEFAULT_GRACE as DEFAULT_GRACE,
    )
    from .clean.decide import (
        Policy as Policy,
    )
    from .clean.facts import (
        gather_facts as gather_facts,
    )
    from .clean.leftovers.act import (
        plan_engines as plan_engines,
    )
    from .clean.present import (
        deployment_names as deployment_names,
    )
    from .clean.present import (
        engine_leftover_count as engine_leftover_count,
    )
    from .clean.present import (
        rpc_dirs as rpc_dirs,
    )
    from .clean.report import (
        Entry as Entry,
    )
    from .clean.report import (
        Report as Report,
    )
    from .clean.report import (
        Source as Source,
    )
    from .clean.report import (
        preview as preview,
    )
    from .gpu.holders import (
        find_holders as find_holders,
    )
    from .gpu.holders import (
        prepare as prepare,
    )
    from .in_engine.captured import (
        OwnerResult as OwnerResult,
    )
    from .in_engine.captured import (
        SegmentCleanup as SegmentCleanup,
    )
    from .in_engine.captured import (
        WorkerSocketCleanup as WorkerSocketCleanup,
    )
    from .in_engine.captured_buffers import (
        BufferCleanup as BufferCleanup,
    )
    from .in_engine.startup import (
        claim_segment as claim_segment,
    )
    from .in_engine.sweep import (
        start_sweep as start_sweep,
    )
    from .ops import diagnostics as diagnostics
    from .ops.demo import (
        demo_name as demo_name,
    )
    from .ops.demo import (
        run_demo as run_demo,
    )
    from .ops.detectdoc import (
        Condition as Condition,
    )
    from .ops.detectdoc import (
        DetectDocument as DetectDocument,
    )
    from .ops.detectdoc import (
        EngineSection as EngineSection,
    )
    from .ops.detectdoc import (
        Hazard as Hazard,
    )
    from .ops.detectdoc import (
        PatchReport as PatchReport,
    )
    from .ops.detectdoc import (
        PatchStatus as PatchStatus,
    )
    from .ops.detectdoc import (
        Plugin as Plugin,
    )
    from .ops.detectdoc import (
        ProcessMatch as ProcessMatch,
    )
    from .ops.diagnostics import (
        CheckResult as CheckResult,
    )
    from .ops.diagnostics import (
        Status as Status,
    )
    from .ops.gcrun import (
        GcOptions as GcOptions,
    )
    from .ops.gcrun import (
        GcResult as GcResult,
    )
    from .ops.gcrun import (
        check_options as check_options,
    )
    from .ops.gcrun import (
        make_plan as make_plan,
    )
    from .ops.gcrun import (
        outcome_of as outcome_of,
    )
    from .ops.gcrun import (
        run_delete as run_delete,
    )
    from .ops.gcrun import (
        run_gc as run_gc,
    )
    from .ops.heartbeat import (
        HeartbeatError as HeartbeatError,
    )
    from .ops.heartbeat import (
        Recorder as Recorder,
    )
    from .ops.heartbeat import (
        check as check,
    )
    from .ops.heartbeat import (
        check_target as check_target,
    )
    from .ops.metrics_http import (
        MetricsServer as MetricsServer,
    )
    from .ops.view import (
        DeploymentView as DeploymentView,
    )
    from .ops.view import (
        NodeView as NodeView,
    )
    from .ops.view import (
        build_view as build_view,
    )
    from .ops.view import (
        layout_for_pid as layout_for_pid,
    )
    from .places.discover import (
        HOST_PLACE as HOST_PLACE,
    )
    from .places.run import (
        PlaceResult as PlaceResult,
    )
    from .places.run import (
        plan_places as plan_places,
    )
    from .places.run import (
        view_places as view_places,
    )
    from .places.run import (
        would_remove as would_remove,
    )
    from .state.lease import (
        DirLease as DirLease,
    )
    from .state.lease import (
        SegmentLease as SegmentLease,
    )
    from .state.segment import (
        LimitWatch as LimitWatch,
    )
    from .state.segment import (
        MappedReader as MappedReader,
    )
    from .state.segment import (
        SegmentInfo as SegmentInfo,
    )
    from .state.segment import (
        read_segment as read_segment,
    )
    from .state.segment import (
        write_segment as write_segment,
    )
    from .state.sockdiag import (
        Bind as Bind,
    )
    from .state.sockdiag import (
        bound as bound,
    )


def __getattr__(name: str) -> object:
    """A face name, loaded from its room on first use and kept in this module."""
    try:
        home, attr = FACE[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    # __import__, not importlib.import_module: the import statement's path, which -X importtime
    # reports (tests read it to prove what a TAB press loads).
    full = f"{__name__}.{home}"
    __import__(full)
    mod = sys.modules[full]
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The names loaded so far and every face name."""
    return sorted([*globals(), *FACE])
