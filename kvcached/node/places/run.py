"""Plan and act on one place of the node, or on every place (kvctl -A), from one /proc pass.

Each place is judged by the same scans and decisions as the host (cleanup.plan
for kvcached's own state, leftovers.act.decide_engines for the engines'),
with the facts and evidence as that place sees them (places/evidence.py),
and acted on by the one guarded act (cleanup.execute), inside that place
alone: every directory is re-opened through the path it was judged by and
must still be the directory judged, every entry re-identified before it goes.
Every candidate outside the host carries its place (`origin.place`).

- `Scope`: what every place of one round is judged with (the facts, the
  places found, the names kvcached ties to its state anywhere on the node,
  the filters); `scope_of` makes it.
- `plan_place(place, scope)`: one place's plans (`PlacePlan`); no side effect.
- `act_place(plan, ...)`: the guarded act inside that place, one report.
- `plan_places`: every place's plan, the host's first, from one scope.

A round over the node is plan_place over every place (gc -A asks the operator
between the two), then act_place over each; one place alone (a place an event
touched) is the same two calls (ops/rounds.py).

The grace age guards what a live process may be making or handing on. A
place that no live process can see (`unseen`: no viewer but its sandbox's
holder, every process's mount namespace read, no process hidden) has no one
who could be in the middle of making or taking a file, so it is judged
without one, unless the operator gave --min-age (`Scope.grace_given`). Such a
plan carries the /proc pass's processes, and act_place first looks for a
process started since then that sees the place (the kubelet restarting a
container between the judgement and the act): if there is one, or if that
cannot be told, nothing there is removed this time (`DEFERRED`), and the
next judgement keeps the grace for the new viewer (docs/PLACES.md §5).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple

from ..base.enums import EngineKind, Kind, State
from ..base.layout import Layout
from ..base.place import HOST, Place, Seen

# Only building blocks at import: a gc with nothing to judge names the host's PlacePlan and no more.
if TYPE_CHECKING:
    from ..clean.cleanup import Plan, SourcePlan
    from ..clean.facts import Facts
    from ..clean.leftovers.act import EnginePlan
    from ..clean.report import Entry, Report
    from ..clean.rules import Policy
    from ..clean.scan import Candidate
    from .discover import Places


# The types here are NamedTuples, not dataclasses: a gc with nothing to judge builds the host's PlacePlan, and
# a dataclass costs a cold start its generated methods (bench/bench_cli_start.py).


class PlacePlan(NamedTuple):
    """One place's plans: kvcached's own state in it, the engines' leftovers in it (each None when not asked)."""

    place: Place
    plan: Plan | None = None
    engines: EnginePlan | None = None
    # Judged without a grace age (unseen): the pass's processes, for act_place's look for one started since.
    ungraced: Facts | None = None

    def sources(self) -> list[SourcePlan]:
        return [x for x in (self.plan, self.engines) if x is not None]

    def any_stale(self) -> bool:
        return any(d.state is State.STALE for x in self.sources() for _, d in x.entries())

    def errors(self) -> list[str]:
        """What could not be read about the place and in its plans, each once."""
        out = list(self.place.errors)
        for part in self.sources():
            out += [e for e in part.errors if e not in out]
        return out


class PlacesPlan(NamedTuple):
    """Every place's plan, the host's first, from one /proc pass."""

    places: Places
    plans: list[PlacePlan]
    errors: list[str]

    def any_stale(self) -> bool:
        return any(pp.any_stale() for pp in self.plans)

    @property
    def host(self) -> PlacePlan:
        return self.plans[0]


class Scope(NamedTuple):
    """What every place of one round is judged with: one /proc pass, the places it shows, the run's filters."""

    layout: Layout                      # the host's
    policy: Policy
    facts: Facts
    places: Places
    now: float
    kvcached: bool = True               # judge kvcached's own state
    engines: bool = False               # judge the engines' leftovers
    names: Sequence[str] = ()           # kvcached's deployments by exact name or glob (gc's NAMEs)
    kinds: Sequence[Kind] = ()
    engine_kinds: Sequence[EngineKind] = ()
    rpc_dirs: Sequence[str] = ()        # the host's RPC directories besides /tmp
    proc_root: str = "/proc"
    # Every name kvcached ties to its state anywhere on the node: a segment's name is tied to kvcached by a
    # socket directory that may sit in another place (a container's /tmp and /dev/shm are two filesystems).
    kvcached_names: frozenset[str] = frozenset()
    grace_given: bool = False           # --min-age given: every place keeps it, seen or not


def _kvcached_names(layout: Layout, places: Places, facts: Facts) -> set[str]:
    """Every name kvcached ties to its state anywhere on the node: processes' IPC names, every /tmp's socket dirs."""
    from ..clean.leftovers.scan import kvcached_names

    names = kvcached_names(layout, facts)
    for pl in places.others:
        if pl.seen is Seen.TMP:
            names |= kvcached_names(pl.layout(layout), None)
    return names


def scope_of(layout: Layout, policy: Policy, facts: Facts, *, every_place: bool = True,
             kubelet_dir: str | None = None, now: float | None = None, kvcached: bool = True, engines: bool = False,
             names: Sequence[str] = (), kinds: Sequence[Kind] = (), engine_kinds: Sequence[EngineKind] = (),
             rpc_dirs: Sequence[str] = (), proc_root: str = "/proc", grace_given: bool = False,
             mapped: Collection[int] | None = None) -> Scope:
    """The scope of one round: every place of the node (discover), or the host alone (`every_place` False).

    With the engines asked for, the devices of every place are announced to
    the facts, so that the one read of every process's maps that the first
    place's engine evidence makes serves every other place's too; `mapped`:
    only these devices (the places an event touched, judged alone: each
    device more costs every map line one more search).
    """
    from .discover import Places, discover

    host = HOST._replace(path=layout.root)
    places = discover(facts, layout, kubelet_dir=kubelet_dir) if every_place else Places(host, [])
    if engines:
        facts.also_map(pl.dev for pl in places.others if pl.dev is not None and (mapped is None or pl.dev in mapped))
    return Scope(layout=layout, policy=policy, facts=facts, places=places, now=time.time() if now is None else now,
                 kvcached=kvcached, engines=engines, names=tuple(names), kinds=tuple(kinds),
                 engine_kinds=tuple(engine_kinds), rpc_dirs=tuple(rpc_dirs), proc_root=proc_root,
                 kvcached_names=frozenset(_kvcached_names(layout, places, facts)), grace_given=grace_given)


def unseen(place: Place, scope: Scope) -> bool:
    """Whether no live process can see the place: no viewer but its holder, and nothing hidden that might be one.

    A process whose mount namespace could not be read counts as seeing every
    place already (discover); an engine-like one whose namespace is not
    known at all, or one hidden from this view (hidepid, other users), might
    see it: then it is not unseen.
    """
    if place.is_host or place.errors:
        return False
    facts = scope.facts
    # A process whose namespace could not be read might see the place, if it could be an engine's (the rule
    # every source's evidence follows: a sandbox's init or an sshd we may not ptrace makes no engine files).
    # A zombie has no mount namespace left: it sees nothing.
    if facts.hidepid or facts.hidden_users or any(p.mnt_ns is None and p.proc_state not in ("Z", "X")
                                                  and p.engine_like for p in facts.processes.values()):
        return False
    viewers = set(scope.places.viewers.get(place.dev, ()) if place.dev is not None else ()) | set(place.pids)
    viewers.discard(place.holder)
    return not viewers


def _policy(place: Place, scope: Scope) -> Policy:
    """The place's policy: the scope's, without a grace age where no live process can see the place."""
    if scope.grace_given or not unseen(place, scope):
        return scope.policy
    return replace(scope.policy, grace=0.0)


def _in_place(c: Candidate, place: Place) -> Candidate:
    """The candidate, and everything below it, tagged with its place (`origin.place`)."""
    return c._replace(place=place, children=tuple(_in_place(x, place) for x in c.children))


def _plan_kvcached(place: Place, scope: Scope, policy: Policy) -> Plan:
    """cleanup.plan of one place other than the host, with the facts as the place sees them; only entries on
    its own filesystem."""
    from ..clean.cleanup import plan
    from .evidence import place_facts

    exact = [n for n in scope.names if not any(ch in n for ch in "*?[")]
    p = plan(place.layout(scope.layout), policy, facts=place_facts(scope.facts, scope.places, place),
             names=sorted(scope.kvcached_names | set(exact)), globs=list(scope.names), kinds=scope.kinds,
             now=scope.now)
    kept = [_in_place(c, place) for c in p.roots if c.ident[0] == place.dev]
    dropped = [f"{c.path}: not on the filesystem of {place.path}; not judged" for c in p.roots
               if c.ident[0] != place.dev]
    segments = {k: _in_place(c, place) for k, c in p.segments.items()}
    return replace(p, roots=kept, segments=segments, errors=p.errors + dropped)


def _plan_engines(place: Place, scope: Scope, policy: Policy) -> EnginePlan:
    """One place's engine plan: its scan, the evidence as it sees it, decide_engines (the host's own path)."""
    from ..clean.leftovers.act import decide_engines
    from ..clean.leftovers.evidence import gather_engine_evidence
    from ..clean.leftovers.families import Evidence
    from ..clean.leftovers.scan import scan_engine_state
    from .evidence import creators, for_place

    facts = scope.facts
    found = scan_engine_state(place.layout(scope.layout), facts, scope.rpc_dirs if place.is_host else (),
                              kvcached=scope.kvcached_names, dev=place.dev)
    if not place.is_host:
        found.candidates = [c._replace(place=place) for c in found.candidates]
    ev = gather_engine_evidence(facts, found.candidates, is_root=scope.policy.is_root, proc_root=scope.proc_root)
    if not place.is_host:
        # A PID in a name is its creator's in the place's own PID namespace: the place's viewers say who has it.
        named = {c.creator_pid for c in found.candidates
                 if c.family.evidence is Evidence.CREATOR and c.creator_pid is not None}
        ev = for_place(ev, place, creators(facts, scope.places, named, only=place))
    return decide_engines(place.layout(scope.layout), found, ev, facts, policy, scope.now,
                          kinds=scope.engine_kinds, errors=facts.errors if place.is_host else ())


def plan_place(place: Place, scope: Scope, host_plan: Plan | None = None) -> PlacePlan:
    """One place's plans, as the scope asks for them; no side effects.

    `host_plan`: the host's kvcached plan the caller made from the same facts
    (gc's, which also finds orphans), used as it is for the host.
    """
    if place.is_host:
        plan = host_plan  # gc's: judged even when --kind leaves it nothing to act on (an empty part)
        return PlacePlan(place, plan, _plan_engines(place, scope, scope.policy) if scope.engines else None)
    policy = _policy(place, scope)
    plan = _plan_kvcached(place, scope, policy) if scope.kvcached else None
    return PlacePlan(place, plan, _plan_engines(place, scope, policy) if scope.engines else None,
                     ungraced=scope.facts if policy is not scope.policy else None)


def plan_places(layout: Layout, policy: Policy, facts: Facts, *, kvcached: bool = True, engines: bool = False,
                engine_kinds: Iterable[EngineKind] = (), rpc_dirs: Sequence[str] = (), kubelet_dir: str | None = None,
                host_plan: Plan | None = None, now: float | None = None, proc_root: str = "/proc",
                names: Sequence[str] = (), kinds: Iterable[Kind] = (), grace_given: bool = False) -> PlacesPlan:
    """Find every place (discover) and plan each, host first; no side effects.

    `host_plan`: the host's kvcached plan the caller already made from the
    same facts (gc's, which also finds orphans), used as it is; without one
    the host's is made here. `names` (exact names or globs) and `kinds`
    filter kvcached's entries as gc's do; `grace_given`: the policy's grace
    age was asked for, and holds in every place (Scope.grace_given).
    """
    scope = scope_of(layout, policy, facts, kubelet_dir=kubelet_dir, now=now, kvcached=kvcached, engines=engines,
                     names=tuple(names), kinds=tuple(kinds), engine_kinds=tuple(engine_kinds),
                     rpc_dirs=tuple(rpc_dirs), proc_root=proc_root, grace_given=grace_given)
    if kvcached and host_plan is None:
        host_plan = host_kvcached_plan(scope, sorted(scope.kvcached_names))
    return PlacesPlan(scope.places, [plan_place(pl, scope, host_plan) for pl in scope.places.all()],
                      list(scope.places.errors))


def host_kvcached_plan(scope: Scope, extra: Sequence[str] = ()) -> Plan:
    """The host's kvcached plan in a scope: gc's own (NAMEs as exact names and globs, `extra` names besides)."""
    from ..clean.cleanup import plan

    exact = [n for n in scope.names if not any(ch in n for ch in "*?[")]
    return plan(scope.layout, scope.policy, facts=scope.facts, names=exact + list(extra), globs=list(scope.names),
                kinds=scope.kinds, now=scope.now, proc_root=scope.proc_root)


def _same_directory(place: Place) -> str | None:
    """Why the place may not be acted in now (its directory is gone or another one), None: it may."""
    if place.is_host:
        return None
    try:
        st = os.stat(place.path, follow_symlinks=False)
    except OSError as e:
        return f"{place.path}: {e.strerror}"
    if st.st_dev != place.dev or (place.ino is not None and st.st_ino != place.ino):
        return f"{place.path}: no longer the filesystem judged"
    return None


DEFERRED = ("a process started since the judgement sees the place (a container restarted?); judged again with "
            "the grace age")


def started_since(place: Place, facts: Facts) -> str | None:
    """Why a place judged without a grace age must not be acted on now: a process the pass did not see can see
    it, or it cannot be told whether one does; None: no such process.

    Only processes absent from the pass are read, each one's mount namespace
    once: a restarted container is a new process in a new namespace. A
    namespace's mount table is matched on the place's device alone (not on
    where it is mounted), so a runtime's own copy counts too: more often
    kept, never less.
    """
    from ..base.mounts import read_mountinfo

    proc = facts.proc_root
    try:
        names = os.listdir(proc)
    except OSError as e:
        return f"{proc}: {e.strerror}; not acted on"
    seen: dict[str, bool] = {}
    for name in names:
        if not name.isdigit() or int(name) in facts.processes:
            continue
        try:
            ns = os.readlink(f"{proc}/{name}/ns/mnt")
        except FileNotFoundError:
            continue  # started and gone since
        except OSError as e:
            return f"{proc}/{name}/ns/mnt: {e.strerror}: whether it sees the place is unknown; not acted on"
        if ns == facts.my_mnt_ns:
            continue  # kvctl's own namespace: the node's, where no place is anyone's /dev/shm
        if ns not in seen:
            mounts = read_mountinfo(proc, int(name))
            if mounts is None:
                if os.path.exists(f"{proc}/{name}"):
                    return f"{proc}/{name}/mountinfo: could not be read; not acted on"
                continue
            seen[ns] = any(m.dev == place.dev for m in mounts)
        if seen[ns]:
            return DEFERRED
    return None


def _kept(p: SourcePlan, why: str) -> SourcePlan:
    """The plan with nothing stale left to act on: its place moved since the judgement (unknown: kept)."""
    from ..clean.report import Decision
    from ..clean.rules import SharedReason

    decisions = {k: Decision(State.UNKNOWN, SharedReason.NOT_TESTED, f"{d.detail}; {why}", d.pids)
                 if d.state is State.STALE else d for k, d in p.decisions.items()}
    return replace(p, decisions=decisions, errors=p.errors + [why])


def act_place(pp: PlacePlan, *, dry_run: bool, time_limit: float | None = None,
              progress: Callable[[Entry[Any]], None] | None = None) -> Report | None:
    """Act on one place's stale entries, inside that place alone; None when nothing was asked there."""
    from ..clean.cleanup import execute

    sources = pp.sources()
    if not sources:
        return None
    moved = _same_directory(pp.place)
    if moved is None and pp.ungraced is not None:
        moved = started_since(pp.place, pp.ungraced)
    if moved is not None:
        sources = [_kept(x, moved) for x in sources]
    return execute(*sources, dry_run=dry_run, time_limit=time_limit, progress=progress)
