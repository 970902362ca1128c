"""`decide_engine` as a table: every state and reason of every family, no filesystem (docs/CONTRIBUTING.md §2)."""

from __future__ import annotations

import pytest

from kvcached.node.clean.decide import Policy, State
from kvcached.node.clean.leftovers.decide import REASONS, EngineReason, decide_engine, settle_groups
from kvcached.node.clean.leftovers.evidence import Blind, EngineEvidence, Proc
from kvcached.node.clean.leftovers.families import Engine, EngineKind, Where, match_name
from kvcached.node.clean.leftovers.scan import EngineCandidate
from kvcached.node.clean.report import Decision
from kvcached.node.clean.rules import SharedReason as Shared
from kvcached.node.clean.scan import FileType
from kvcached.node.state.sockdiag import Bind

NOW = 1_000_000.0
OLD = NOW - 3600
ROOT = Policy(grace=60, uid=0)
USER = Policy(grace=60, uid=1000)


def cand(name: str, where: Where = Where.SHM, **kw: object) -> EngineCandidate:
    m = match_name(where, name)
    assert m is not None, name
    parent = "/dev/shm" if where is Where.SHM else "/tmp"
    base: dict[str, object] = dict(
        family=m.family, path=f"{parent}/{name}", name=name, parent=parent, parent_ident=(1, 2),
        ftype=FileType.REGULAR if where is Where.SHM else FileType.SOCKET, ident=(1, 100), uid=1000, mode=0o600,
        nlink=1, size=4096, allocated=4096, mtime=OLD, ctime=OLD, creator_pid=m.creator_pid, group=m.group,
        bind=None if where is Where.SHM else Bind.UNBOUND)
    base.update(kw)
    return EngineCandidate(**base)  # type: ignore[arg-type]


PSM = cand("psm_0a1b2c3d")
NCCL = cand("nccl-Ab3dE9")
CUDA = cand("cuda.shm.3e9.52f2.1")
LOADS = cand("sglang_loads_default_0a1b2c3d.shm")
SGL = cand("sgl_shm_mm_4242_deadbeef")
ARGS = cand("multi_tokenizer_args_4242")
TORCH = cand("torch_4242_3262000796_0")
SEM = cand("sem.mp-ab12cd_9", mode=0o600, size=32)
LOKY = cand("sem.loky-4242-ab12cd_9", mode=0o600, size=32)
IPC = cand("0a1b2c3d-e4f5-4a6b-8c7d-e8f9a0b1c2d3", Where.RPC, mode=0o755, size=0, allocated=0)
SGL_IPC = cand("tmpab12cd_9", Where.RPC, ident=(1, 200), mode=0o755, size=0, allocated=0)
EV = EngineEvidence()
SHM_FILES = [PSM, NCCL, CUDA, LOADS, SGL, ARGS, TORCH, SEM, LOKY]


def ev(**kw: object) -> EngineEvidence:
    return EngineEvidence(**kw)  # type: ignore[arg-type]


CASES = [
    # (id, candidate, evidence, policy, expected state, expected reason)
    ("buffer stale: nothing maps or holds it", PSM, EV, ROOT, State.STALE, EngineReason.UNUSED),
    ("nccl stale", NCCL, EV, USER, State.STALE, EngineReason.UNUSED),
    ("cuda stale", CUDA, EV, USER, State.STALE, EngineReason.UNUSED),
    ("load snapshot stale", LOADS, EV, USER, State.STALE, EngineReason.UNUSED),
    ("buffer live: mapped only", PSM, ev(mapped={PSM.ident: (7,)}), ROOT, State.LIVE, EngineReason.MAPPED),
    ("buffer live: held only", PSM, ev(held={PSM.ident: (7,)}), ROOT, State.LIVE, Shared.HELD_OPEN),
    ("buffer live: another file mapped is no evidence", PSM, ev(mapped={(1, 101): (7,)}), ROOT, State.STALE,
     EngineReason.UNUSED),
    ("buffer young", PSM._replace(mtime=NOW - 5), EV, ROOT, State.YOUNG, Shared.YOUNG),
    ("buffer live beats young", PSM._replace(mtime=NOW), ev(mapped={PSM.ident: (7,)}), ROOT, State.LIVE,
     EngineReason.MAPPED),
    ("buffer unknown: another PID namespace", PSM, ev(view_gap="a container"), ROOT, State.UNKNOWN,
     EngineReason.VIEW_INCOMPLETE),
    ("buffer unknown: its owner's engine unread", PSM, ev(blind=(Blind(9, 1000),)), ROOT, State.UNKNOWN,
     Shared.PROC_INCOMPLETE),
    ("buffer stale: another user's unread process cannot open a 0600 file", PSM, ev(blind=(Blind(9, 1001),)),
     ROOT, State.STALE, EngineReason.UNUSED),
    ("buffer unknown: a 0644 file, anyone's unread process", PSM._replace(mode=0o644),
     ev(blind=(Blind(9, 1001),)), ROOT, State.UNKNOWN, Shared.PROC_INCOMPLETE),
    ("buffer unknown: hidepid and a file others may open", PSM._replace(mode=0o644), ev(hidden_users=True), USER,
     State.UNKNOWN, EngineReason.HIDDEN_PROCESSES),
    ("buffer stale: hidepid but a private file", PSM, ev(hidden_users=True), USER, State.STALE,
     EngineReason.UNUSED),
    # foreign
    ("symlink", PSM._replace(ftype=FileType.SYMLINK), ev(mapped={PSM.ident: (7,)}), ROOT, State.FOREIGN,
     Shared.SYMLINK),
    ("a FIFO in /dev/shm", PSM._replace(ftype=FileType.FIFO), EV, ROOT, State.FOREIGN, Shared.WRONG_TYPE),
    ("a directory in /dev/shm", NCCL._replace(ftype=FileType.DIRECTORY), EV, ROOT, State.FOREIGN,
     Shared.WRONG_TYPE),
    ("hard-linked", PSM._replace(nlink=2), EV, ROOT, State.FOREIGN, Shared.HARD_LINKED),
    ("a mount point", PSM._replace(cross_mount=True), EV, ROOT, State.FOREIGN, Shared.MOUNT_POINT),
    ("another user's, not root", PSM._replace(uid=1001), EV, USER, State.FOREIGN, Shared.OTHER_USER),
    ("another user's, as root", PSM._replace(uid=1001), EV, ROOT, State.STALE, EngineReason.UNUSED),
    # SGLang: the creator PID, with its start time
    ("sglang live: creator alive, started before", SGL, ev(by_any_pid={4242: (Proc(4242, OLD - 10),)}), USER,
     State.LIVE, EngineReason.CREATOR_ALIVE),
    ("sglang live: creator alive in a container (NSpid)", SGL, ev(by_any_pid={4242: (Proc(88001, OLD - 10),)}),
     USER, State.LIVE, EngineReason.CREATOR_ALIVE),
    ("sglang live: started within the clock's slack", SGL, ev(by_any_pid={4242: (Proc(4242, OLD + 0.9),)}), USER,
     State.LIVE, EngineReason.CREATOR_ALIVE),
    ("sglang stale: creator gone", SGL, EV, USER, State.STALE, EngineReason.CREATOR_GONE),
    ("sglang stale: PID now a later process's", SGL, ev(by_any_pid={4242: (Proc(4242, OLD + 5),)}), USER,
     State.STALE, EngineReason.PID_REUSED),
    # utime moves the mtime back, never the ctime: a creator that started after the mtime but before the
    # ctime may still be the creator.
    ("sglang live: backdated mtime, ctime says the creator may have made it", SGL._replace(ctime=OLD + 100),
     ev(by_any_pid={4242: (Proc(4242, OLD + 5),)}), USER, State.LIVE, EngineReason.CREATOR_ALIVE),
    ("sglang live: mapped although the creator is gone", SGL, ev(mapped={SGL.ident: (9,)}), USER, State.LIVE,
     EngineReason.MAPPED),
    ("sglang unknown: creator gone, but a blind spot", SGL, ev(blind=(Blind(9, 1000),)), USER, State.UNKNOWN,
     Shared.PROC_INCOMPLETE),
    ("sglang unknown: creator gone, another PID namespace", SGL, ev(view_gap="a container"), USER,
     State.UNKNOWN, EngineReason.VIEW_INCOMPLETE),
    ("sglang live: creator alive, even from inside a container view", SGL,
     ev(view_gap="a container", by_any_pid={4242: (Proc(4242, OLD - 10),)}), USER, State.LIVE,
     EngineReason.CREATOR_ALIVE),
    ("sglang young: creator gone a moment ago", SGL._replace(mtime=NOW - 1, ctime=NOW - 1), EV, USER, State.YOUNG,
     Shared.YOUNG),
    ("tokenizer args stale: creator gone", ARGS, EV, USER, State.STALE, EngineReason.CREATOR_GONE),
    ("tokenizer args live: creator alive", ARGS, ev(by_any_pid={4242: (Proc(4242, OLD - 10),)}), USER,
     State.LIVE, EngineReason.CREATOR_ALIVE),
    # torch's file_system shares: the PID in the name, with its start time, or a process mapping it
    ("torch live: its creator alive (a sender's share not yet opened by its receiver)", TORCH,
     ev(by_any_pid={4242: (Proc(4242, OLD - 10),)}), USER, State.LIVE, EngineReason.CREATOR_ALIVE),
    ("torch live: its receiver maps it, the creator gone", TORCH, ev(mapped={TORCH.ident: (9,)}), USER,
     State.LIVE, EngineReason.MAPPED),
    ("torch stale: creator gone, nothing maps it", TORCH, EV, USER, State.STALE, EngineReason.CREATOR_GONE),
    ("torch stale: PID now a later process's", TORCH, ev(by_any_pid={4242: (Proc(4242, OLD + 5),)}), USER,
     State.STALE, EngineReason.PID_REUSED),
    # multiprocessing's semaphores: every process that has one open maps it
    ("semaphore live: mapped", SEM, ev(mapped={SEM.ident: (7, 8)}), USER, State.LIVE, EngineReason.MAPPED),
    ("semaphore stale: nothing maps it", SEM, EV, USER, State.STALE, EngineReason.UNUSED),
    ("semaphore young", SEM._replace(mtime=NOW - 5), EV, USER, State.YOUNG, Shared.YOUNG),
    ("loky semaphore live: its creator alive", LOKY, ev(by_any_pid={4242: (Proc(4242, OLD - 10),)}), USER,
     State.LIVE, EngineReason.CREATOR_ALIVE),
    ("loky semaphore stale: creator gone, nothing maps it", LOKY, EV, USER, State.STALE,
     EngineReason.CREATOR_GONE),
    # vLLM's ZMQ IPC sockets: a bound socket, by identity; never a connect
    ("ipc live: listed by identity", IPC, ev(listeners={IPC.ident: (5,)}), USER, State.LIVE,
     Shared.LISTENING),
    ("ipc live: bound, not yet listening", IPC._replace(bind=Bind.BOUND), EV, USER, State.LIVE,
     Shared.BOUND),
    ("ipc stale: nothing bound", IPC, EV, USER, State.STALE, Shared.NOT_LISTENING),
    ("ipc stale although another PID namespace: the bind test sees them all", IPC, ev(view_gap="a container"),
     USER, State.STALE, Shared.NOT_LISTENING),
    ("ipc young", IPC._replace(mtime=NOW - 1), EV, USER, State.YOUNG, Shared.YOUNG),
    ("ipc unknown: bind test denied", IPC._replace(bind=Bind.DENIED, bind_errno="EACCES"), EV, ROOT,
     State.UNKNOWN, Shared.BIND_DENIED),
    ("ipc unknown: bind test failed", IPC._replace(bind=Bind.ERROR, bind_errno="EIO"), EV, ROOT, State.UNKNOWN,
     Shared.BIND_ERROR),
    ("ipc unknown: not tested", IPC._replace(bind=None), EV, ROOT, State.UNKNOWN, Shared.NOT_TESTED),
    ("ipc: a symlink", IPC._replace(ftype=FileType.SYMLINK), EV, ROOT, State.FOREIGN, Shared.SYMLINK),
    ("ipc: another user's, not root", IPC._replace(uid=1001), EV, USER, State.FOREIGN, Shared.OTHER_USER),
    # SGLang's ZMQ IPC sockets (tempfile's names): the same evidence as vLLM's, their own identity
    ("sglang ipc live: listed by identity", SGL_IPC, ev(listeners={SGL_IPC.ident: (5,)}), USER, State.LIVE,
     Shared.LISTENING),
    ("sglang ipc stale: only another socket is listed", SGL_IPC, ev(listeners={IPC.ident: (5,)}), USER,
     State.STALE, Shared.NOT_LISTENING),
    ("sglang ipc live: bound, not yet listening", SGL_IPC._replace(bind=Bind.BOUND), EV, USER, State.LIVE,
     Shared.BOUND),
    ("sglang ipc stale: nothing bound", SGL_IPC, EV, USER, State.STALE, Shared.NOT_LISTENING),
    ("sglang ipc young", SGL_IPC._replace(mtime=NOW - 1), EV, USER, State.YOUNG, Shared.YOUNG),
    ("sglang ipc unknown: not tested", SGL_IPC._replace(bind=None), EV, ROOT, State.UNKNOWN,
     Shared.NOT_TESTED),
    ("sglang ipc: the empty file zmq never bound is a name only", SGL_IPC._replace(ftype=FileType.REGULAR,
     bind=None), EV, ROOT, State.FOREIGN, Shared.WRONG_TYPE),
    ("sglang ipc: a symlink", SGL_IPC._replace(ftype=FileType.SYMLINK, bind=None), EV, ROOT, State.FOREIGN,
     Shared.SYMLINK),
    ("sglang ipc: another user's, not root", SGL_IPC._replace(uid=1001), EV, USER, State.FOREIGN,
     Shared.OTHER_USER),
]


@pytest.mark.parametrize(("case", "c", "evidence", "policy", "state", "reason"), CASES, ids=[c[0] for c in CASES])
def test_decide_engine(case: str, c: EngineCandidate, evidence: EngineEvidence, policy: Policy, state: State,
                       reason: EngineReason) -> None:
    d = decide_engine(c, evidence, policy, NOW)
    assert (d.state, d.reason) == (state, reason), (case, d)


def test_every_reason_is_reachable() -> None:
    seen = {r for *_, r in CASES} | {EngineReason.GROUP_LIVE, EngineReason.GROUP_UNKNOWN, EngineReason.GROUP_YOUNG}
    assert seen == set(REASONS)


def test_evidence_names_the_processes() -> None:
    d = decide_engine(PSM, ev(mapped={PSM.ident: (9, 7)}, held={PSM.ident: (7, 8)}), ROOT, NOW)
    assert d.pids == (7, 8, 9)
    d = decide_engine(SGL, ev(by_any_pid={4242: (Proc(88001, OLD - 10), Proc(88002, OLD + 60))}), USER, NOW)
    assert d.pids == (88001,)


def _offload(seg: str = "", **kw: object) -> EngineCandidate:
    return cand(f"vllm_offload_e0.mmap{seg}", **kw)


def test_a_live_segment_keeps_its_whole_offload_region() -> None:
    main, one, two = _offload(ident=(1, 1)), _offload(".1", ident=(1, 2)), _offload(".2", ident=(1, 3))
    evidence = ev(mapped={two.ident: (7,)})
    decisions = {c.path: decide_engine(c, evidence, ROOT, NOW) for c in (main, one, two)}
    assert decisions[main.path].state is State.STALE
    settle_groups([main, one, two], decisions)
    assert [decisions[c.path].reason for c in (main, one)] == [EngineReason.GROUP_LIVE] * 2
    assert decisions[main.path].pids == (7,)
    assert decisions[two.path].reason is EngineReason.MAPPED


def test_a_young_or_unknown_member_keeps_the_region_from_stale() -> None:
    main, one = _offload(ident=(1, 1)), _offload(".1", ident=(1, 2), mtime=NOW)
    decisions = {c.path: decide_engine(c, EV, ROOT, NOW) for c in (main, one)}
    settle_groups([main, one], decisions)
    assert decisions[main.path].reason is EngineReason.GROUP_YOUNG
    main, one = _offload(ident=(1, 1)), _offload(".1", ident=(1, 2), mode=0o644)
    evidence = ev(blind=(Blind(9, 1001),))
    decisions = {c.path: decide_engine(c, evidence, ROOT, NOW) for c in (main, one)}
    settle_groups([main, one], decisions)
    assert decisions[main.path].reason is EngineReason.GROUP_UNKNOWN


def test_foreign_members_are_no_evidence_and_stale_regions_stay_stale() -> None:
    main, link = _offload(ident=(1, 1)), _offload(".1", ident=(1, 2), ftype=FileType.SYMLINK)
    decisions: dict[str, Decision] = {c.path: decide_engine(c, EV, ROOT, NOW) for c in (main, link)}
    settle_groups([main, link], decisions)
    assert decisions[main.path].state is State.STALE
    assert decisions[link.path].state is State.FOREIGN


def test_the_family_kinds_are_the_documented_ones() -> None:
    assert [str(k) for k in EngineKind] == ["vllm-shm", "vllm-ipc", "sglang-shm", "sglang-ipc", "nccl-shm",
                                            "cuda-shm", "torch-shm", "python-sem"]
    assert {c.kind for c in SHM_FILES} | {IPC.kind, SGL_IPC.kind} == set(EngineKind)
    assert (IPC.kind, SGL_IPC.kind, SGL_IPC.engine) == (EngineKind.VLLM_IPC, EngineKind.SGLANG_IPC, Engine.SGLANG)
