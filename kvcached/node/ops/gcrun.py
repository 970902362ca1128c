"""The gc and delete operations as one call each, so that `kvctl` only parses, calls and renders.

`run_gc(options, ...)`: the node's lock, the plan of every place it judges
(the host's alone, or with -A every place of the node, the host's first:
places/run.py), orphans killed (and the node planned again, once), the
operator's confirmation, the time budget, metrics, and an outcome. With
`engines` (kvctl gc --engines) each place's plan also holds the engines' own
leftovers (kvcached.node.clean.leftovers) from the same /proc pass, and one
guarded act (cleanup.execute) acts on both plans of a place under the same
lock, confirmation and time budget, into that place's report (report.py);
without it the engine pass is never imported. The result lists the places
with their plans and reports (rounds.PlaceResult), the host's first.
`run_delete(...)`: one deployment, through the same decisions, with
delete's own rules for live, foreign and doubtful entries. Questions to the
operator are callbacks: the core never reads a terminal.

The scan, the /proc pass and the decision are imported when a run needs them:
on a node that cannot hold kvcached state (nothing in /tmp or /dev/shm that
any name could make ours) gc reports an empty run without them, which is
most of what `kvctl gc` costs there (a cron run on an idle node;
bench/bench_cli_start.py prints the figure).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple

from ..base.enums import Category, EngineKind, KillOutcome, Kind, Outcome, State
from ..base.errors import InvalidName, KvcachedError
from ..base.layout import Layout
from ..base.place import HOST
from ..clean.present import may_hold_state, rpc_dirs
from ..clean.report import Report

if TYPE_CHECKING:
    from ..clean.cleanup import Plan
    from ..clean.decide import Decision
    from ..clean.facts import Facts
    from ..clean.orphans import KillResult
    from ..clean.sight import Sight
    from ..gpu.holders import GpuHolder, GpuReport
    from ..places.discover import Places
    from ..places.run import PlacePlan
    from .metrics import Sink
    from .rounds import PlaceResult
    from .view import DeploymentView, ProcessView


class NoMatch(KvcachedError):
    """The names given match no deployment on the node."""

    category = Category.NOT_FOUND


class Refused(KvcachedError):
    """delete will not act: the target is live, not ours, or not proven dead without the operator's word."""

    category = Category.REFUSED


class BadRequest(KvcachedError):
    """Options that contradict each other (engine leftovers asked for by deployment name)."""

    category = Category.BAD_INPUT


class GcOptions(NamedTuple):
    """Everything `kvctl gc` can be asked, immutable.

    Given by keyword only (neighbouring flags must not swap in a reorder:
    tests/cli/test_gc_idle.py holds every call site to it). A NamedTuple, not
    a frozen dataclass: every kvctl gc builds one, and a dataclass costs a
    cold start its generated methods (bench/bench_cli_start.py).
    """

    layout: Layout
    names: Sequence[str] = ()          # names or globs; empty: every deployment
    grace: float | None = None         # the grace age; None: decide.DEFAULT_GRACE
    kinds: Sequence[Kind] = ()
    dry_run: bool = False
    yes: bool = False
    time_limit: float | None = 300.0   # the whole run; None or 0: no bound
    kill_orphans: bool = False
    prometheus: str | None = None
    metrics_sink: Sink | None = None   # also (or instead) serve each run's metrics there (gc --every --metrics-port)
    proc_root: str = "/proc"
    engines: bool = False              # also the engines' own leftovers (vLLM, SGLang, NCCL, CUDA)
    engine_kinds: Sequence[EngineKind] = ()  # `--kind` values of engine leftovers: only these (implies engines)
    rpc_dirs: Sequence[str] | None = None    # vLLM's RPC directories besides /tmp; None: VLLM_RPC_BASE_PATH
    all_places: bool = False           # -A: every place of the node, pods included (kvcached.node.places)
    kubelet_dir: str | None = None     # where -A finds the pods' volumes; None: KVCTL_KUBELET_DIR
    every: float | None = None         # gc --every's DURATION, said in the metrics (the agent's runs, not cron's)
    grace_given: bool = False          # --min-age given: no place is judged without it (places.run.unseen)

    @property
    def engine_pass(self) -> bool:
        """Whether the run judges engine leftovers: asked for, and not filtered out by kvcached-only kinds."""
        return (self.engines or bool(self.engine_kinds)) and (bool(self.engine_kinds) or not self.kinds)

    @property
    def kvcached_pass(self) -> bool:
        """Whether the run acts on kvcached's own state: `--kind` naming engine kinds alone leaves it out."""
        return bool(self.kinds) or not self.engine_kinds


class GcResult(NamedTuple):
    """What one gc run found, did and how it ended: every place it judged, the host's first.

    A NamedTuple, immutable: a gc with nothing to judge builds one, and a
    dataclass costs a cold start its generated methods (bench/bench_cli_start.py).
    """

    places: Sequence[PlaceResult]      # each place's plans and report; without -A the host alone
    dry_run: bool                      # what the run really was (a run not confirmed is a dry run)
    outcome: Outcome
    orphans: list[tuple[DeploymentView, ProcessView]]  # the orphaned processes the run saw (none: [])
    all_places: bool = False           # -A: every place of the node was looked for (kvcached.node.places)
    killable: AbstractSet[int] = frozenset()  # orphan pids kvctl may terminate
    killed: Sequence[KillResult] = ()
    declined: bool = False             # stale entries remain because nobody confirmed
    place_errors: Sequence[str] = ()   # -A: what could not be read while finding places
    sight: Sight | None = None         # what the run could not see (sight.py): blind when it has reasons
    gpu: GpuReport | None = None       # the GPU holders, when the run judged engines
    metrics_error: str | None = None   # why --prometheus was not written (a report, not a condition: the work stands)
    found: Places | None = None        # -A: the places found and their viewers (what gc --every's events watch)
    start_times: Mapping[int, float] = {}  # -A: the pass's processes' start times (a pidfd is checked by them)

    @property
    def report(self) -> Report:
        """The host's report: every source's entries in this node's own /tmp and /dev/shm."""
        report = self.places[0].report
        assert report is not None  # the host is always judged
        return report

    @property
    def others(self) -> Sequence[PlaceResult]:
        """-A: every place but the host's."""
        return self.places[1:]


if TYPE_CHECKING:  # only annotations name them: a cold start builds no typing aliases
    # (every place's plans acted on as a dry run, the host's first) -> remove?; None: nobody to ask (cron), so
    # do not remove.
    Confirm = Callable[[list[PlaceResult]], bool]
    Orphans = list[tuple[DeploymentView, ProcessView]]
    ConfirmKill = Callable[[Orphans], bool]
    ConfirmGpuKill = Callable[[list[GpuHolder]], bool]


def _split(names: Sequence[str]) -> tuple[list[str], list[str]]:
    """(exact names the scan must look for, globs to filter deployments by)."""
    exact = [n for n in names if not any(ch in n for ch in "*?[")]
    return exact, list(names)


def make_plan(layout: Layout, names: Sequence[str] = (), grace: float | None = None, kinds: Sequence[Kind] = (),
              extra: Sequence[str] = (), proc_root: str = "/proc", facts: Facts | None = None) -> Plan:
    """The plan every command shows or acts on: names are exact names or globs; grace None: the default."""
    from ..clean.cleanup import plan
    from ..clean.decide import DEFAULT_GRACE, Policy

    exact, globs = _split(names)
    return plan(layout, Policy(grace=DEFAULT_GRACE if grace is None else grace), facts=facts,
                names=exact + list(extra), globs=globs, kinds=kinds, proc_root=proc_root)


def _orphans(p: Plan) -> tuple[Orphans, set[int], Orphans]:
    """(orphans, pids kvctl may kill, their (deployment, process) pairs)."""
    if not p.roots:  # nothing to group: a clean node stays fast
        return [], set(), []
    from ..clean.roles import Role, classify_process

    # Only a worker or an engine is ever orphaned (view._orphan): on a node that runs
    # neither, grouping every entry into deployments would find nothing (and view is not imported).
    if not any(classify_process(i).role in (Role.WORKER, Role.ENGINE) for i in p.facts.processes.values()):
        return [], set(), []
    from .view import build_view

    view = build_view(p, read_segments=False, namespaces=False)
    targets = view.killable_orphans()
    return view.orphans, {o.pid for _, o in targets}, targets


def outcome_of(*reports: Report | None, killed: Sequence[KillResult] = ()) -> Outcome:
    """Failures first (of any report's entries, of any source and place, or a kill), then stale entries left,
    else clean."""
    done = [r for r in reports if r is not None]
    if any(r.failures for r in done) or any(k.outcome is KillOutcome.FAILED for k in killed):
        return Outcome.PARTIAL_FAILURE
    if any(r.stale_remaining for r in done):
        return Outcome.STALE_REMAIN
    return Outcome.CLEAN


def check_options(opts: GcOptions) -> None:
    """Raise BadRequest for options that contradict each other (before any work, and before a loop of runs)."""
    if opts.names and opts.engine_pass:
        raise BadRequest("engine leftovers belong to no deployment: --engines and the engine kinds of --kind take "
                         f"no NAME (given: {' '.join(opts.names)})")


def run_gc(opts: GcOptions, *, confirm: Confirm | None = None, confirm_kill: ConfirmKill | None = None,
           progress: Callable[[Any], None] | None = None, confirm_gpu_kill: ConfirmGpuKill | None = None) -> GcResult:
    """Lock, plan, (kill orphans, plan again), confirm, act within the time budget, write metrics.

    Raises gclock.LockBusy (metrics say so first), NoMatch, BadRequest, and,
    before any work, MetricsError for a metrics target that is no regular file
    (a device, a FIFO, a directory). A metrics file that cannot be written is
    the result's `metrics_error`, after the work. `confirm` sees every place's
    plans acted on as a dry run, the host's first (engine leftovers too, when
    asked for).
    """
    check_options(opts)
    started, wall_start = time.monotonic(), time.time()
    if opts.prometheus:
        from . import metrics  # only then: cron without metrics on a clean node stays fast

        metrics.refuse_non_file(opts.prometheus)  # `--prometheus /dev/null`: a mistake, said before any work
    lock = None
    if not opts.dry_run:  # a dry run changes nothing, so it neither needs nor blocks the lock
        from ..state.gclock import GcLock, LockBusy

        lock = GcLock(opts.layout, proc_root=opts.proc_root)
        try:
            lock.acquire()
        except LockBusy as busy:
            if opts.prometheus or opts.metrics_sink:
                from . import metrics

                try:
                    metrics.write_lock_busy(opts.prometheus, wall_start, time.time(), sink=opts.metrics_sink)
                except metrics.MetricsError as e:  # the busy lock is the news; the metrics are said beside it
                    busy.args = (f"{busy}; metrics not written: {e}",)
            raise
    try:
        # Engine leftovers may sit where no kvcached name does (vLLM's sockets in /tmp): no shortcut then.
        if opts.engine_pass or opts.all_places or may_hold_state(opts.layout.root):
            result = _judge_and_act(opts, started, confirm, confirm_kill, progress, confirm_gpu_kill)
        elif opts.names:
            raise NoMatch(f"no deployment matches {' '.join(opts.names)} under {opts.layout.root}")
        else:
            from ..clean.sight import assess
            from ..places.run import PlacePlan
            from .rounds import PlaceResult

            now = time.time()
            # No pass ran (nothing here could be ours): sight from the credentials and the /proc mount alone.
            empty = Report(dry_run=opts.dry_run, entries=[], errors=[], started=now, finished=now)
            host = PlacePlan(HOST._replace(path=opts.layout.root))
            result = GcResult(places=[PlaceResult(host, empty)], dry_run=opts.dry_run,
                              outcome=Outcome.CLEAN, orphans=[], sight=assess(opts.proc_root))
    finally:
        if lock is not None:
            lock.release()
    return write_metrics(opts, result, wall_start)


def write_metrics(opts: GcOptions, result: GcResult, started: float) -> GcResult:
    """The run's metrics (--prometheus, --metrics-port), if asked for: the result, with why they could not be
    written (a report, not a condition: what was removed and kept is still reported)."""
    if not (opts.prometheus or opts.metrics_sink):
        return result
    from . import metrics

    try:
        metrics.write_report(opts.prometheus, result.report,
                             success=result.outcome is Outcome.CLEAN and not result.dry_run,
                             orphans=len(result.orphans), started=started,
                             sink=opts.metrics_sink, blind=result.sight is not None and result.sight.blind,
                             gpu=result.gpu, places=result.places if result.all_places else None,
                             every=opts.every, fills=result.places)
    except metrics.MetricsError as e:
        return result._replace(metrics_error=str(e))
    return result._replace(metrics_error=None)


def _kvcached_plan(opts: GcOptions, extra: Sequence[str] = ()) -> Plan:
    """The host's kvcached plan (its /proc facts serve every other plan of the run); empty when --kind leaves it out.

    `extra`: names to look for besides the NAMEs and the processes' (a segment named only by processes just
    killed)."""
    p = make_plan(opts.layout, opts.names, opts.grace, opts.kinds, extra=extra, proc_root=opts.proc_root)
    return p if opts.kvcached_pass else replace(p, roots=[])


def _plan_round(opts: GcOptions, p: Plan) -> tuple[list[PlacePlan], Places]:
    """Every place's plans from the host plan's facts, the host's first (its kvcached plan is `p` itself); and
    the places found (-A), with what could not be read while finding them."""
    from ..places.run import plan_place, scope_of

    dirs = rpc_dirs(opts.layout.root) if opts.rpc_dirs is None else tuple(opts.rpc_dirs)
    scope = scope_of(opts.layout, p.policy, p.facts, every_place=opts.all_places, kubelet_dir=opts.kubelet_dir,
                     now=p.now, kvcached=opts.kvcached_pass, engines=opts.engine_pass, names=opts.names,
                     kinds=opts.kinds, engine_kinds=opts.engine_kinds, rpc_dirs=dirs, proc_root=opts.proc_root,
                     grace_given=opts.grace_given)
    return [plan_place(pl, scope, p) for pl in scope.places.all()], scope.places


def _ask(confirm: Confirm, plans: Sequence[PlacePlan]) -> bool:
    """The operator's word on every place's plans, shown as the same plans run dry."""
    from .rounds import act

    return confirm([act(pp, dry_run=True) for pp in plans])


def _kill_orphans(opts: GcOptions, targets: Orphans, confirm_kill: ConfirmKill | None) -> list[KillResult]:
    """--kill-orphans: the orphaned workers of dead deployments ended, once the operator said yes."""
    if not (opts.kill_orphans and not opts.dry_run and targets):
        return []
    if not (opts.yes or (confirm_kill is not None and confirm_kill(targets))):
        return []
    from ..clean.orphans import terminate

    return terminate([o.info for _, o in targets], grace=5.0, proc_root=opts.proc_root)


def _judge_and_act(opts: GcOptions, started: float, confirm: Confirm | None, confirm_kill: ConfirmKill | None,
                   progress: Callable[[Any], None] | None, confirm_gpu: ConfirmGpuKill | None = None) -> GcResult:
    """gc's run under the lock: plan every place, end orphans, confirm, act in each place.

    The node is planned once; only a kill (an orphan, a GPU holder) changes
    what the plans rest on, and then the node is planned again, once per kill.
    """
    p = _kvcached_plan(opts)
    if opts.names and not p.matched and not opts.all_places:  # -A: the names may match in another place (below)
        raise NoMatch(f"no deployment matches {' '.join(opts.names)} under {opts.layout.root}")
    orphans, killable, targets = _orphans(p)
    killed = _kill_orphans(opts, targets, confirm_kill)
    # A segment may be named only by the processes just killed: it is looked for by name from now on.
    extra = sorted({d.name for d, _ in targets}) if killed else []
    if killed:
        p = _kvcached_plan(opts, extra)
        orphans, killable, _ = _orphans(p)

    def left() -> float | None:
        # The bound covers the whole run: planning, killing and every place's removals count against it.
        return max(1e-9, opts.time_limit - (time.monotonic() - started)) if opts.time_limit else None

    if opts.engine_pass:
        from ..gpu.holders import prepare

        prepare(p.facts)  # the engine pass's one read of the maps also finds GPU mappings
    plans, found = _plan_round(opts, p)
    if opts.all_places and opts.names and not any(x.plan is not None and x.plan.matched for x in plans):
        raise NoMatch(f"no deployment matches {' '.join(opts.names)} in any place of the node")
    gpu = None
    if opts.engine_pass:
        from ..gpu.gcstep import gpu_step

        gpu, ended = gpu_step(p.facts, kill=opts.kill_orphans, yes=opts.yes, dry_run=opts.dry_run,
                              confirm=confirm_gpu, time_limit=left(), proc_root=opts.proc_root)
        if ended:  # what they held (their /dev/shm buffers) is judged again without them
            killed += ended
            p = _kvcached_plan(opts, extra)
            plans, found = _plan_round(opts, p)
    dry = opts.dry_run
    declined = False
    # Only a question needs to know whether anything is stale: a dry run and --yes skip the pass over every entry.
    if not dry and not opts.yes and any(pp.any_stale() for pp in plans):
        dry = confirm is None or not _ask(confirm, plans)
        declined = dry
    from ..clean.sight import assess
    from .rounds import act

    places = [act(pp, dry_run=dry, time_limit=left(), progress=progress) for pp in plans]
    return GcResult(places=places, dry_run=dry, outcome=outcome_of(*(r.report for r in places), killed=killed),
                    all_places=opts.all_places,
                    orphans=orphans, killable=killable, killed=killed, declined=declined,
                    place_errors=list(found.errors), sight=assess(opts.proc_root, p.facts), gpu=gpu,
                    found=found if opts.all_places else None,
                    start_times={pid: i.start_time for pid, i in p.facts.processes.items()} if opts.all_places
                    else {})


def _refuse_engine_name(name: str) -> None:
    """A name that no kvcached deployment has but an engine family does: delete does not take engine leftovers."""
    from ..clean.leftovers.families import Where, match_name

    m = match_name(Where.SHM, name) or match_name(Where.RPC, name)
    if m is not None:
        raise Refused(f"{name}: not a kvcached deployment but {m.family.engine}'s ({m.family.what}); delete does not "
                      f"take engine leftovers: 'kvctl gc --engines --kind {m.family.kind}' removes it once it is "
                      "provably dead")


def run_delete(layout: Layout, name: str, *, grace: float | None = None, vouch: bool = False,
               confirm: Callable[[list[tuple[Any, Decision]]], bool] | None = None,
               proc_root: str = "/proc") -> Report:
    """Remove one deployment's segment and stale sockets, through gc's decisions, with delete's rules.

    A live segment, or a segment not ours, is refused (Refused, naming why).
    Entries of unknown or young state are removed only when the operator
    vouches for them (`vouch`, or `confirm` answering yes); live sockets of the
    deployment are always kept.
    """
    from ..clean.cleanup import execute

    try:
        layout.segment_path(name)  # InvalidName: a usage error, before any work
    except InvalidName:
        _refuse_engine_name(name)  # cuda.shm.* is no valid IPC name, but it is a name an operator may try
        raise
    p = make_plan(layout, [name], grace, proc_root=proc_root)
    entries = p.entries()
    if not entries:
        _refuse_engine_name(name)
        raise NoMatch(f"{name}: no such deployment (no segment or socket directory under {layout.root})")
    for c, d in entries:
        if c.kind is Kind.SEGMENT and d.state is State.LIVE:
            who = f" (PID {', '.join(map(str, d.pids))})" if d.pids else ""
            raise Refused(f"{name} is live{who}: {d.detail}; refusing to delete")
        if c.kind is Kind.SEGMENT and d.state is State.FOREIGN:
            _refuse_engine_name(name)  # a file that is no segment but an engine's buffer: say so
            raise Refused(f"{c.path}: not ours to delete ({d.detail})")
    doubtful = [(c, d) for c, d in entries if d.state in (State.UNKNOWN, State.YOUNG)]
    if doubtful and not vouch:
        if confirm is None or not confirm(doubtful):
            what = "; ".join(f"{c.path}: {d.state} ({d.detail})" for c, d in doubtful[:3])
            raise Refused(f"{name}: liveness not proven dead ({what}); re-run with --yes to delete anyway")
    # The operator vouched for these: they go through the same guarded removal as stale ones.
    vouched = {c.path: d._replace(state=State.STALE, detail=d.detail + "; deleted on request")
               for c, d in doubtful}
    return execute(replace(p, decisions={**p.decisions, **vouched}), dry_run=False)
