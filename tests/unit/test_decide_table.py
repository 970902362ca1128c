"""`decide` as a table: every state and reason, no filesystem (docs/CONTRIBUTING.md §2)."""

from __future__ import annotations

import pytest

from kvcached.node.clean.decide import REASONS, Decision, Policy, Reason, State, decide, settle
from kvcached.node.clean.facts import Facts, ProcessInfo
from kvcached.node.clean.rules import SharedReason as Shared
from kvcached.node.clean.scan import Candidate, FileType, Kind
from kvcached.node.state.lease import LockEntry
from kvcached.node.state.sockdiag import Bind

NOW = 1_000_000.0
OLD = NOW - 3600
ROOT = Policy(grace=60, uid=0)
USER = Policy(grace=60, uid=1000)

SOCK = Candidate(kind=Kind.SOCKET, path="/tmp/kvcached-tp-d-x/w0.sock",
                 name="w0.sock", deployment="d", ftype=FileType.SOCKET, ident=(1, 10), uid=1000, mode=0o600,
                 nlink=1, size=0, mtime=OLD, rank=0, stage=0, parent_uid=1000, bind=Bind.UNBOUND)
SEG = Candidate(kind=Kind.SEGMENT, path="/dev/shm/d", name="d", deployment="d",
                ftype=FileType.REGULAR, ident=(2, 20), uid=1000, mode=0o644, nlink=1, size=24, mtime=OLD,
                lease=False)
PGSEG = SEG._replace(name="kvcached_vLLM_4242", deployment="kvcached_vLLM_4242", path="/dev/shm/kvcached_vLLM_4242")
DIR = Candidate(kind=Kind.DIRECTORY, path="/tmp/kvcached-tp-d-x",
                name="kvcached-tp-d-x", deployment="d", ftype=FileType.DIRECTORY, ident=(1, 30), uid=1000,
                mode=0o700, nlink=2, size=0, mtime=OLD, lease=False, children=(SOCK,))


def proc(pid: int, start: float = OLD - 100, **kw: object) -> ProcessInfo:
    base = dict(pid=pid, start_time=start, ppid=1, pgid=pid, uid=1000, comm="python3", cmdline=("python3",),
                ipc_name=None, socket_inodes=frozenset(), held_files=frozenset(), mnt_ns="mnt:[1]",
                net_ns="net:[1]", unreadable=frozenset())
    base.update(kw)
    return ProcessInfo(**base)  # type: ignore[arg-type]


def facts(*procs: ProcessInfo, **kw: object) -> Facts:
    f = Facts(proc_root="/proc", my_mnt_ns="mnt:[1]", my_net_ns="net:[1]", mapped_files={}, lock_table={})
    f.processes = {p.pid: p for p in procs}
    f.unreadable_pids = {p.pid: p.unreadable for p in procs if p.unreadable}
    for k, v in kw.items():
        setattr(f, k, v)
    return f


def d(state: State, reason: Reason) -> Decision:
    return Decision(state, reason, "")


STALE_SOCK = d(State.STALE, Shared.NOT_LISTENING)
LIVE_SOCK = d(State.LIVE, Shared.LISTENING)

CASES = [
    # (id, candidate, facts, policy, children, expected state, expected reason)
    ("socket stale: unlisted, nothing bound", SOCK, facts(), ROOT, (), State.STALE, Shared.NOT_LISTENING),
    (
        "socket live: listed by identity",
        SOCK,
        facts(listeners={SOCK.ident: {99}}, socket_holders={99: {7}}),
        ROOT,
        (),
        State.LIVE,
        Shared.LISTENING,
    ),
    (
        "socket: a listener at the same path string but another file is no evidence",
        SOCK,
        facts(listeners={(1, 11): {99}}, socket_holders={99: {7}}),
        ROOT,
        (),
        State.STALE,
        Shared.NOT_LISTENING,
    ),
    (
        "socket live: bound (no listing names it: another namespace)",
        SOCK._replace(bind=Bind.BOUND),
        facts(),
        ROOT,
        (),
        State.LIVE,
        Shared.BOUND,
    ),
    (
        "socket unknown: bind test denied",
        SOCK._replace(bind=Bind.DENIED, bind_errno="EACCES"),
        facts(),
        ROOT,
        (),
        State.UNKNOWN,
        Shared.BIND_DENIED,
    ),
    (
        "socket unknown: bind test failed",
        SOCK._replace(bind=Bind.ERROR, bind_errno="EIO"),
        facts(),
        ROOT,
        (),
        State.UNKNOWN,
        Shared.BIND_ERROR,
    ),
    ("socket unknown: not tested", SOCK._replace(bind=None), facts(), ROOT, (), State.UNKNOWN, Shared.NOT_TESTED),
    (
        "socket stale: an unreadable network namespace does not matter (the bind test sees them all)",
        SOCK,
        facts(unreadable_netns={"net:[2]"}),
        ROOT,
        (),
        State.STALE,
        Shared.NOT_LISTENING,
    ),
    ("socket young", SOCK._replace(mtime=NOW - 5), facts(), ROOT, (), State.YOUNG, Shared.YOUNG),
    ("socket foreign: fifo", SOCK._replace(ftype=FileType.FIFO), facts(), ROOT, (), State.FOREIGN, Shared.WRONG_TYPE),
    (
        "socket foreign: regular file",
        SOCK._replace(ftype=FileType.REGULAR),
        facts(),
        ROOT,
        (),
        State.FOREIGN,
        Shared.WRONG_TYPE,
    ),
    (
        "socket foreign: directory",
        SOCK._replace(ftype=FileType.DIRECTORY),
        facts(),
        ROOT,
        (),
        State.FOREIGN,
        Shared.WRONG_TYPE,
    ),
    (
        "socket foreign: symlink",
        SOCK._replace(ftype=FileType.SYMLINK),
        facts(),
        ROOT,
        (),
        State.FOREIGN,
        Shared.SYMLINK,
    ),
    (
        "socket foreign: other user, not root",
        SOCK._replace(uid=2000, parent_uid=2000),
        facts(),
        USER,
        (),
        State.FOREIGN,
        Shared.OTHER_USER,
    ),
    (
        "socket foreign: owner differs from dir",
        SOCK._replace(uid=2000),
        facts(),
        ROOT,
        (),
        State.FOREIGN,
        Reason.OWNER_MISMATCH,
    ),
    (
        "socket stale: a live process of its deployment does not revive a node nothing is bound to",
        SOCK,
        facts(proc(7, ipc_name="d")),
        ROOT,
        (),
        State.STALE,
        Shared.NOT_LISTENING,
    ),
    (
        "socket stale: nor does an unreadable process",
        SOCK,
        facts(proc(9, unreadable=frozenset({"environ"}))),
        ROOT,
        (),
        State.STALE,
        Shared.NOT_LISTENING,
    ),
    (
        "dir live: deployment process alive (env name)",
        DIR,
        facts(proc(7, ipc_name="d")),
        ROOT,
        (STALE_SOCK,),
        State.LIVE,
        Reason.OWNER_ALIVE,
    ),
    (
        "segment live: a named process that started after the last change still counts",
        SEG,
        facts(proc(7, start=NOW - 1, ipc_name="d")),
        ROOT,
        (),
        State.LIVE,
        Reason.OWNER_ALIVE,
    ),
    (
        "segment live: lease",
        SEG._replace(lease=True),
        facts(lock_table={(2, 20): [LockEntry(kind="OFDLCK", mode="READ", pid=-1)]}),
        ROOT,
        (),
        State.LIVE,
        Reason.LEASE_HELD,
    ),
    (
        "segment live: held open",
        SEG,
        facts(proc(8, held_files=frozenset({(2, 20)}))),
        ROOT,
        (),
        State.LIVE,
        Shared.HELD_OPEN,
    ),
    ("segment live: mapped", SEG, facts(proc(8), mapped_files={(2, 20): [8]}), ROOT, (), State.LIVE, Shared.HELD_OPEN),
    ("segment stale: nobody", SEG, facts(), ROOT, (), State.STALE, Reason.NO_OWNER),
    ("segment young", SEG._replace(mtime=NOW - 1), facts(), ROOT, (), State.YOUNG, Shared.YOUNG),
    (
        "segment young: half-made 0 bytes",
        SEG._replace(mtime=NOW - 1, size=0),
        facts(),
        ROOT,
        (),
        State.YOUNG,
        Shared.YOUNG,
    ),
    (
        "segment unknown: lease untestable",
        SEG._replace(lease=None),
        facts(),
        ROOT,
        (),
        State.UNKNOWN,
        Reason.LEASE_UNTESTED,
    ),
    (
        "segment unknown: an engine-like process of its uid unreadable",
        SEG,
        facts(proc(9, unreadable=frozenset({"maps", "environ"}))),
        ROOT,
        (),
        State.UNKNOWN,
        Shared.PROC_INCOMPLETE,
    ),
    (
        "segment unknown: an unreadable engine-like process that started after the last change",
        SEG,
        facts(proc(9, start=NOW - 1, unreadable=frozenset({"environ"}))),
        ROOT,
        (),
        State.UNKNOWN,
        Shared.PROC_INCOMPLETE,
    ),
    (
        "segment unknown: found only by its shape",
        SEG._replace(by_shape=True),
        facts(),
        ROOT,
        (),
        State.UNKNOWN,
        Reason.UNNAMED,
    ),
    (
        "segment: an unreadable non-engine process is not a blind spot",
        SEG,
        facts(proc(1, comm="process_api", cmdline=("/process_api",), unreadable=frozenset({"maps"}))),
        ROOT,
        (),
        State.STALE,
        Reason.NO_OWNER,
    ),
    ("segment foreign: hard link", SEG._replace(nlink=2), facts(), ROOT, (), State.FOREIGN, Shared.HARD_LINKED),
    (
        "segment foreign: symlink",
        SEG._replace(ftype=FileType.SYMLINK),
        facts(),
        ROOT,
        (),
        State.FOREIGN,
        Shared.SYMLINK,
    ),
    ("segment foreign: wrong size", SEG._replace(size=4096), facts(), ROOT, (), State.FOREIGN, Reason.BAD_SIZE),
    ("segment foreign: other user", SEG._replace(uid=2000), facts(), USER, (), State.FOREIGN, Shared.OTHER_USER),
    (
        "pgid segment live: group predates last change",
        PGSEG,
        facts(proc(4242, pgid=4242)),
        ROOT,
        (),
        State.LIVE,
        Reason.GROUP_ALIVE,
    ),
    (
        "pgid segment unknown: a newer group holds an engine-like process",
        PGSEG,
        facts(proc(4242, start=NOW - 10, pgid=4242)),
        ROOT,
        (),
        State.UNKNOWN,
        Reason.PGID_AMBIGUOUS,
    ),
    (
        "pgid segment stale: pgid reused by a newer group of no engine-like process",
        PGSEG,
        facts(proc(4242, start=NOW - 10, pgid=4242, comm="bash", cmdline=("-bash",))),
        ROOT,
        (),
        State.STALE,
        Reason.PGID_REUSED,
    ),
    ("dir live: lease held", DIR._replace(lease=True), facts(), ROOT, (STALE_SOCK,), State.LIVE, Reason.LEASE_HELD),
    ("dir live: a live child", DIR, facts(), ROOT, (LIVE_SOCK,), State.LIVE, Reason.CHILD_LIVE),
    (
        "dir unknown: an unknown child",
        DIR,
        facts(),
        ROOT,
        (d(State.UNKNOWN, Shared.BIND_DENIED),),
        State.UNKNOWN,
        Reason.CHILD_UNKNOWN,
    ),
    ("dir young: a young child", DIR, facts(), ROOT, (d(State.YOUNG, Shared.YOUNG),), State.YOUNG, Reason.CHILD_YOUNG),
    (
        "dir foreign: a foreign child",
        DIR,
        facts(),
        ROOT,
        (d(State.FOREIGN, Shared.WRONG_TYPE),),
        State.FOREIGN,
        Reason.CONTAINS_FOREIGN,
    ),
    (
        "dir foreign: unrecognised entry",
        DIR._replace(extras=("junk",)),
        facts(),
        ROOT,
        (STALE_SOCK,),
        State.FOREIGN,
        Reason.CONTAINS_FOREIGN,
    ),
    ("dir stale: all children stale", DIR, facts(), ROOT, (STALE_SOCK,), State.STALE, Reason.ALL_STALE),
    ("dir stale: empty", DIR._replace(children=()), facts(), ROOT, (), State.STALE, Reason.EMPTY_DIR),
    (
        "dir young: empty and fresh",
        DIR._replace(children=(), mtime=NOW - 2),
        facts(),
        ROOT,
        (),
        State.YOUNG,
        Shared.YOUNG,
    ),
    ("dir foreign: bad hash", DIR._replace(hash_ok=False), facts(), ROOT, (), State.FOREIGN, Reason.BAD_HASH),
    ("dir foreign: mount point", DIR._replace(cross_mount=True), facts(), ROOT, (), State.FOREIGN, Shared.MOUNT_POINT),
    ("dir foreign: world-writable", DIR._replace(mode=0o777), facts(), ROOT, (), State.FOREIGN, Reason.WORLD_WRITABLE),
    ("dir foreign: a symlink", DIR._replace(ftype=FileType.SYMLINK), facts(), ROOT, (), State.FOREIGN, Shared.SYMLINK),
    ("dir foreign: a file", DIR._replace(ftype=FileType.REGULAR), facts(), ROOT, (), State.FOREIGN, Shared.WRONG_TYPE),
]


@pytest.mark.parametrize("c, f, policy, children, state, reason", [x[1:] for x in CASES], ids=[x[0] for x in CASES])
def test_decide_table(
    c: Candidate, f: Facts, policy: Policy, children: tuple[Decision, ...], state: State, reason: Reason
) -> None:
    got = decide(c, f, policy, NOW, children)
    assert (got.state, got.reason) == (state, reason), got.detail


# settle: a deployment's strongest evidence keeps its segment and directories.
LIVE_BOUND = Decision(State.LIVE, Shared.BOUND, "bound")
SETTLE = [
    # (id, socket decision, segment decision before, expected segment state, reason; directory likewise)
    (
        "a bound socket keeps an old unheld segment and its directory live",
        LIVE_BOUND,
        Decision(State.STALE, Reason.NO_OWNER, ""),
        State.LIVE,
        Reason.DEPLOYMENT_LIVE,
    ),
    (
        "an unknown socket keeps the segment unknown",
        d(State.UNKNOWN, Shared.BIND_DENIED),
        Decision(State.STALE, Reason.NO_OWNER, ""),
        State.UNKNOWN,
        Reason.DEPLOYMENT_UNKNOWN,
    ),
    (
        "a young socket keeps the segment young",
        d(State.YOUNG, Shared.YOUNG),
        Decision(State.STALE, Reason.NO_OWNER, ""),
        State.YOUNG,
        Reason.DEPLOYMENT_YOUNG,
    ),
    ("all stale stays stale", STALE_SOCK, Decision(State.STALE, Reason.NO_OWNER, ""), State.STALE, Reason.NO_OWNER),
    (
        "a foreign socket is no evidence",
        d(State.FOREIGN, Shared.WRONG_TYPE),
        Decision(State.STALE, Reason.NO_OWNER, ""),
        State.STALE,
        Reason.NO_OWNER,
    ),
    (
        "a live segment keeps an empty directory live",
        STALE_SOCK,
        Decision(State.LIVE, Reason.LEASE_HELD, ""),
        State.LIVE,
        Reason.LEASE_HELD,
    ),
]


@pytest.mark.parametrize("sock_d, seg_d, state, reason", [x[1:] for x in SETTLE], ids=[x[0] for x in SETTLE])
def test_settle(sock_d: Decision, seg_d: Decision, state: State, reason: Reason) -> None:
    dir_d = decide(DIR, facts(), ROOT, NOW, (sock_d,))
    decisions = {SOCK.path: sock_d, SEG.path: seg_d, DIR.path: dir_d}
    settle([DIR, SEG], decisions)
    assert (decisions[SEG.path].state, decisions[SEG.path].reason) == (state, reason)
    assert decisions[SOCK.path] is sock_d, "a socket keeps its own decision"
    if sock_d.state is State.LIVE or seg_d.state is State.LIVE:
        assert decisions[DIR.path].state is State.LIVE
    elif state is not State.STALE:
        assert decisions[DIR.path].state is state


def test_settle_never_lowers_and_never_crosses_deployments() -> None:
    other = SEG._replace(path="/dev/shm/e", name="e", deployment="e")
    decisions = {
        SOCK.path: LIVE_BOUND,
        DIR.path: decide(DIR, facts(), ROOT, NOW, (LIVE_BOUND,)),
        SEG.path: Decision(State.LIVE, Reason.LEASE_HELD, ""),
        other.path: Decision(State.STALE, Reason.NO_OWNER, ""),
    }
    settle([DIR, SEG, other], decisions)
    assert decisions[SEG.path].reason is Reason.LEASE_HELD
    assert decisions[other.path].state is State.STALE


def test_every_state_and_reason_is_covered() -> None:
    states = {x[5] for x in CASES}
    reasons = {x[6] for x in CASES} | {x[4] for x in SETTLE}
    assert states == set(State)
    assert reasons == set(REASONS), set(REASONS) - reasons


def test_live_decision_names_the_serving_pids() -> None:
    got = decide(SOCK, facts(listeners={SOCK.ident: {99}}, socket_holders={99: {7, 8}}), ROOT, NOW)
    assert got.pids == (7, 8)
