"""The start-up sweep: an engine that starts with kvcached removes what gc proves dead, in the background.

A node stays clean without cron: each engine that claims its segment (vLLM's,
SGLang's, the harness's; kvcached.integration.engine_claim and
kvcached.runtime.harness call `start_sweep`) also sweeps the provably stale
kvcached state of its own uid on the node, through gc's own plan, decision
and guarded act (docs/CLEANER.md §3), and with KVCACHED_STARTUP_SWEEP_ENGINES
the engines' own dead leftovers too (kvcached.node.clean.leftovers). It runs:

- in a daemon thread, so that the engine never waits on it (READY is not
  held up, and the process's exit is not either);
- once per process start and node root (a forked child is a new start);
- under the node's gc lock: a busy lock means another gc or another serve's
  sweep is at it, so this one skips, and says so;
- within SWEEP_TIME_LIMIT_S for planning and acting together (what is left
  stays for the next sweep or `kvctl gc`);
- as its own uid even when that is root: other users' entries are foreign to
  it (a root engine in a pod does not clean the host for other users);
- logged (logger `kvcached.node.in_engine.sweep`, the engine's log): every path removed
  and one summary line, or why it skipped.

KVCACHED_STARTUP_SWEEP=0 turns it off: nothing is read or touched.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ... import settings
from ..base.layout import Layout
from ..clean.decide import Policy
from ..state.gclock import GcLock
from ..state.lease import ForkSafe

if TYPE_CHECKING:
    from ..clean.report import Report

log = logging.getLogger(__name__)

SWEEP_TIME_LIMIT_S = 10.0

_swept: set[str] = set()  # node roots this process has swept (or is sweeping)
_swept_lock = threading.Lock()
os.register_at_fork(after_in_child=_swept.clear)  # a forked engine is a start of its own


@dataclass(frozen=True)
class OwnUidPolicy(Policy):
    """gc's policy as a user who is not root, whoever runs it: another uid's entries are foreign (never removed)."""

    @property
    def is_root(self) -> bool:  # a plain property where Policy caches one: never root
        return False


class _SweepLock(GcLock, ForkSafe):
    """The gc lock, dropped by a child forked while the sweep holds it (else the child would hold it for its life)."""

    def __init__(self, layout: Layout) -> None:
        super().__init__(layout)
        self._lock = threading.Lock()
        self._track()


@dataclass
class SweepResult:
    """What one sweep did: why it skipped, or the reports of what it judged."""

    skipped: str | None = None
    report: Report | None = None       # every source it judged: kvcached's, then (asked for) the engines'
    seconds: float = 0.0
    removed: list[str] = field(default_factory=list)


def sweep(layout: Layout, *, engines: bool = False, time_limit: float = SWEEP_TIME_LIMIT_S,
          uid: int | None = None) -> SweepResult:
    """One sweep in the caller's thread: the gc lock (busy: skipped), the plan(s), the guarded act; never prompts."""
    from ..clean.present import may_hold_state
    from ..state.gclock import LockBusy, LockUnavailable

    started = time.monotonic()
    if not engines and not may_hold_state(layout.root):
        return SweepResult(seconds=time.monotonic() - started)
    lock = _SweepLock(layout)
    try:
        lock.acquire()
    except (LockBusy, LockUnavailable) as e:
        return SweepResult(skipped=str(e), seconds=time.monotonic() - started)
    try:
        return _judge_and_act(layout, engines, started, time_limit, uid)
    finally:
        lock.release()


def _judge_and_act(layout: Layout, engines: bool, started: float, time_limit: float, uid: int | None) -> SweepResult:
    from ..base.enums import Action
    from ..clean.cleanup import execute, plan

    policy = OwnUidPolicy(uid=os.geteuid() if uid is None else uid)

    def left() -> float:
        return max(1e-9, time_limit - (time.monotonic() - started))

    p = plan(layout, policy)
    plans: list[Any] = [p]
    if engines:
        from ..clean.leftovers.act import plan_engines
        from ..clean.present import rpc_dirs

        plans.append(plan_engines(layout, policy, facts=p.facts, rpc_dirs=rpc_dirs(layout.root)))
    report = execute(*plans, dry_run=False, time_limit=left())
    return SweepResult(report=report, seconds=time.monotonic() - started,
                       removed=[e.path for e in report.entries if e.action is Action.REMOVED])


def _log_result(root: str, r: SweepResult) -> None:
    if r.skipped is not None:
        log.info("kvcached: start-up sweep of %s skipped: %s", root, r.skipped)
        return
    for path in r.removed:
        log.info("kvcached: start-up sweep removed %s", path)
    from ..clean.report import Source

    bits = []
    parts = [(what, r.report.part(source) if r.report is not None else None)
             for what, source in (("kvcached entries", Source.KVCACHED), ("engine leftovers", Source.ENGINES))]
    for what, rep in parts:
        if rep is None:
            continue
        left = len(rep.stale_remaining)
        bits.append(f"{what}: {len(rep.entries)} judged" + (f", {left} stale kept" if left else "")
                    + (f", {len(rep.failures)} failed" if rep.failures else "")
                    + ("; time limit reached" if rep.timed_out else ""))
    level = logging.WARNING if r.report is not None and r.report.failures else logging.INFO
    log.log(level, "kvcached: start-up sweep of %s removed %d in %.2fs (%s)", root, len(r.removed), r.seconds,
            "; ".join(bits) or "nothing of kvcached's here")


def _run(layout: Layout, engines: bool) -> None:
    try:
        # The sweep is the engine's least urgent work: the lowest CPU priority, for this thread only (Linux).
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (OSError, AttributeError):
        pass
    try:
        _log_result(layout.root, sweep(layout, engines=engines))
    except Exception as e:  # never into the engine: it runs on whatever this sweep found
        log.warning("kvcached: start-up sweep of %s failed: %s", layout.root, e)


def start_sweep(layout: Layout) -> threading.Thread | None:
    """Sweep the node in a daemon thread, once per process and root; None when off or already started. Never raises."""
    try:
        if not settings.STARTUP_SWEEP.get():
            log.info("kvcached: start-up sweep off (%s=0)", settings.STARTUP_SWEEP.name)
            return None
        with _swept_lock:
            if layout.root in _swept:
                return None
            _swept.add(layout.root)
        engines = settings.STARTUP_SWEEP_ENGINES.get()
        t = threading.Thread(target=_run, args=(layout, engines), name="kvcached-startup-sweep", daemon=True)
        t.start()
        log.info("kvcached: start-up sweep of %s started in the background%s", layout.root,
                 " (engine leftovers too)" if engines else "")
        return t
    except Exception as e:
        log.warning("kvcached: start-up sweep not started: %s", e)
        return None
