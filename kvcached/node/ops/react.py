"""gc --every between its rounds: judge again only the places an event touched (docs/PLACES.md §5).

The data flow, one thread:

    round (gcrun.run_gc, -A) ──> Reactor.after_round: arm the Watch with the
        places the round found and their viewers (ops/events.py)
    Reactor.run_for(pause) ──> Watch.wait ──> Changed (places touched)
        ──> due times (below) ──> judge(places): the gc lock, one /proc pass,
        places.run.scope_of, rounds.judge_place for each touched place only,
        the Watch armed again from that pass ──> Reaction (said by the caller)

When a touched place is judged:

- at once (after COALESCE_S, so that a burst of exits is one judgement) when
  its last viewer besides the sandbox's holder exited: that is the moment
  its dead files can go, and nothing there needs a grace age any more
  (places.run.unseen);
- otherwise SETTLE_S after the first touch since its last judgement: a
  live place keeps its grace age, so judging it at every new file or every
  exit of one of many workers would cost passes over /proc and remove
  nothing more, and the exits of a whole pod killed at once arrive over a
  few milliseconds: its last one makes the judgement.

A change of kvctl's mount table (a new pod's volume, a new sandbox shm)
asks for a pass that only arms the watch, no sooner than SETTLE_S after the
last one: the new place's files and exits are then seen before the next
round. A place touched while the lock is busy (a manual gc) is judged again
SETTLE_S later. The host is never judged here: its rules stay a round's.
The metrics are the rounds' (the reactions are said in the log, one line
each): a place's bytes that a reaction reclaimed show in the next round's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

from .events import Changed, Degraded, Key, Watch, key_of

if TYPE_CHECKING:
    from ..base.place import Place
    from .gcrun import GcOptions, GcResult
    from .rounds import PlaceResult

COALESCE_S = 0.2   # what arrives this soon after a place's last viewer went is judged with it (a burst of exits)
SETTLE_S = 10.0    # a live place touched again is judged no more often than this


class Reaction(NamedTuple):
    """One judgement of the places events touched: what woke it, what was done in each place."""

    started: float                     # wall clock
    took: float                        # seconds, the lock and the /proc pass included
    exited: int                        # watched processes that exited since the last judgement
    files: int                         # places that got new files since the last judgement
    places: Sequence[PlaceResult] = ()  # each place judged: its plans and report
    busy: bool = False                 # the lock was held by another gc: judged again later
    error: str | None = None           # the judgement failed (said; the loop goes on)


class Reactor:
    """The event path of one gc --every loop: a Watch, the places due for a judgement, and the judgement."""

    def __init__(self, opts: GcOptions, stop_fd: int | None, *, stopping: Callable[[], bool] = lambda: False,
                 clock: Callable[[], float] = time.monotonic, watch: Watch | None = None) -> None:
        self.opts = opts
        self.stopping = stopping
        self.clock = clock
        self.watch = watch if watch is not None else Watch(stop_fd, proc_root=opts.proc_root)
        self._due: dict[Key, float] = {}
        self._judged: dict[Key, float] = {}
        self._exited = 0
        self._files = 0
        self._rescan: float | None = None  # when a pass that only arms the watch is due (the mount table changed)
        self._armed = float("-inf")         # when the watch was last armed from a pass

    def close(self) -> None:
        self.watch.close()

    def news(self) -> list[Degraded]:
        """Degraded modes met since the last call (each said once, by the caller)."""
        return self.watch.news()

    def after_round(self, result: GcResult | None) -> None:
        """A round judged every place: watch what it found; nothing it judged is due any more."""
        if result is None or result.found is None:
            return
        now = self.clock()
        self._arm(result.found.others, result.start_times)
        self._armed, self._rescan = now, None
        for pr in result.places:
            k = key_of(pr.place)
            if k is not None:
                self._judged[k] = now
                self._due.pop(k, None)

    def _arm(self, places: Iterable[Place], start_times: Mapping[int, float]) -> None:
        self.watch.arm(list(places), start_times)

    def note(self, changed: Changed) -> None:
        """When each touched place is due (module docstring)."""
        now = self.clock()
        self._exited += changed.exited
        self._files += changed.files
        if changed.mounts and self._rescan is None:
            self._rescan = max(now + COALESCE_S, self._armed + SETTLE_S)
        for k in changed.places:
            # A place that still has viewers keeps its grace age: judged now, it would keep what a moment later
            # (its last viewer gone, a burst of exits being delivered) it could remove.
            when = now + (COALESCE_S if k in changed.orphaned else SETTLE_S)
            self._due[k] = min(self._due.get(k, when), when)

    def run_for(self, seconds: float, said: Callable[[Reaction], None]) -> bool:
        """Wait `seconds` for events, judging what they touch when it is due; True when a stop was asked."""
        deadline = self.clock() + seconds
        while True:
            now = self.clock()
            if now >= deadline:
                return False
            until = min([deadline, *self._due.values(), *([self._rescan] if self._rescan is not None else [])])
            changed = self.watch.wait(max(0.0, until - now))
            if changed.stop or self.stopping():
                return True
            self.note(changed)
            ripe = {k for k, t in self._due.items() if t <= self.clock()}
            if ripe:
                said(self.judge(ripe))
                if self.stopping():
                    return True
            elif self._rescan is not None and self._rescan <= self.clock():
                self.rearm()

    def rearm(self) -> None:
        """A pass that only arms the watch (the mount table changed): no lock, nothing judged."""
        from ..clean.facts import gather_facts
        from ..places.discover import discover

        facts = gather_facts(self.opts.proc_root)
        found = discover(facts, self.opts.layout, kubelet_dir=self.opts.kubelet_dir)
        self._arm(found.others, {pid: i.start_time for pid, i in facts.processes.items()})
        self._armed, self._rescan = self.clock(), None

    def judge(self, keys: set[Key]) -> Reaction:
        """Judge and act on these places alone, under the gc lock, from one /proc pass; arm the watch again."""
        from ..base.errors import KvcachedError
        from ..clean.facts import gather_facts
        from ..clean.rules import DEFAULT_GRACE, Policy
        from ..places.run import scope_of
        from ..state.gclock import GcLock, LockBusy
        from .rounds import judge_place

        opts = self.opts
        started, t0 = time.time(), self.clock()
        exited, files = self._exited, self._files
        lock = None
        if not opts.dry_run:
            lock = GcLock(opts.layout, proc_root=opts.proc_root)
            try:
                lock.acquire()
            except LockBusy:
                for k in keys:
                    self._due[k] = t0 + SETTLE_S
                return Reaction(started, self.clock() - t0, exited, files, busy=True)
            except KvcachedError as e:
                for k in keys:
                    self._due[k] = t0 + SETTLE_S
                return Reaction(started, self.clock() - t0, exited, files, error=str(e))
        self._exited = self._files = 0
        results: list[PlaceResult] = []
        try:
            facts = gather_facts(opts.proc_root)
            policy = Policy(grace=DEFAULT_GRACE if opts.grace is None else opts.grace)
            scope = scope_of(opts.layout, policy, facts, every_place=True, kubelet_dir=opts.kubelet_dir,
                             kvcached=opts.kvcached_pass, engines=opts.engine_pass, names=opts.names,
                             kinds=opts.kinds, engine_kinds=opts.engine_kinds, proc_root=opts.proc_root,
                             grace_given=opts.grace_given, mapped={k[0] for k in keys})
            for pl in scope.places.others:
                if key_of(pl) not in keys:
                    continue
                if self.stopping() and results:
                    break  # SIGTERM: the place in hand was finished; the rest wait for no one
                results.append(judge_place(pl, scope, dry_run=opts.dry_run, time_limit=opts.time_limit))
        finally:
            if lock is not None:
                lock.release()
        now = self.clock()
        self._arm(scope.places.others, {pid: i.start_time for pid, i in facts.processes.items()})
        self._armed, self._rescan = now, None
        for k in keys:
            self._judged[k] = now
            self._due.pop(k, None)
        return Reaction(started, now - t0, exited, files, results)
