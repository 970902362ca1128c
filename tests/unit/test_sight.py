"""When a run is blind, as a table over credentials, the /proc mount and one pass (docs/CLEANER.md §7)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvcached.node.clean.decide import State, decide
from kvcached.node.clean.rules import SharedReason
from kvcached.node.clean.sight import INITIAL_PID_NS, Cause, Credentials, ProcMount, assess, proc_mount

from .test_decide_table import NOW, ROOT, SEG, facts, proc

ROOT_FULL = Credentials(uid=0, groups=frozenset({0}), ptrace=True, lsm=None)
ROOT_CONFINED = Credentials(uid=0, groups=frozenset({0}), ptrace=True, lsm="cri-containerd.apparmor.d (enforce)")
ROOT_NO_PTRACE = Credentials(uid=0, groups=frozenset({0}), ptrace=False, lsm=None)
USER = Credentials(uid=1000, groups=frozenset({1000, 50}), ptrace=False, lsm=None)
PLAIN = ProcMount("0", None, False)


@pytest.fixture
def host_proc(tmp_path: Path) -> str:
    """A /proc whose PID 1 is in the initial PID namespace, as the host's is."""
    os.makedirs(tmp_path / "host" / "1" / "ns")
    os.symlink(INITIAL_PID_NS, tmp_path / "host" / "1" / "ns" / "pid")
    return str(tmp_path / "host")


@pytest.fixture
def container_proc(tmp_path: Path) -> str:
    """A container's own /proc: its PID 1 in a namespace of its own."""
    os.makedirs(tmp_path / "pod" / "1" / "ns")
    os.symlink("pid:[4026532999]", tmp_path / "pod" / "1" / "ns" / "pid")
    return str(tmp_path / "pod")


def causes(proc_root: str, creds: Credentials, mount: ProcMount = PLAIN, view: object = None) -> set[Cause]:
    return {r.cause for r in assess(proc_root, view, creds=creds, mount=mount).reasons}  # type: ignore[arg-type]


def test_root_on_the_host_sees(host_proc: str) -> None:
    # A root-owned process that is not engine-like and cannot be read (a sandbox's init): no blind spot.
    view = facts(proc(1, uid=0, comm="init", cmdline=("/sbin/init",), unreadable=frozenset({"fd", "environ"})))
    assert causes(host_proc, ROOT_FULL, view=view) == set()
    assert assess(host_proc, view, creds=ROOT_FULL, mount=PLAIN).to_dict() is None


def test_each_cause(host_proc: str, container_proc: str) -> None:
    assert causes(container_proc, ROOT_FULL) == {Cause.PID_NAMESPACE}
    assert causes(host_proc, USER) == {Cause.NO_PTRACE}
    assert causes(host_proc, ROOT_NO_PTRACE) == {Cause.NO_PTRACE}
    assert causes(host_proc, ROOT_NO_PTRACE, ProcMount("invisible", None, False)) == {Cause.NO_PTRACE, Cause.HIDEPID}
    assert causes(host_proc, ROOT_FULL, ProcMount("2", None, True)) == {Cause.SUBSET_PID}  # ptrace sees past hidepid
    # The mount's gid= lets its members past hidepid; not past what no CAP_SYS_PTRACE means for the reads.
    assert causes(host_proc, USER, ProcMount("2", 50, False)) == {Cause.NO_PTRACE}
    assert causes(host_proc, ROOT_FULL, view=facts(errors=["/proc: Permission denied"])) == {Cause.PROC}


def test_a_security_module_is_named(host_proc: str) -> None:
    other = proc(4242, uid=65534, comm="node_exporter", cmdline=("node_exporter",), unreadable=frozenset({"fd"}))
    engine = proc(4343, uid=0, comm="VLLM::EngineCore", unreadable=frozenset({"environ", "fd"}))
    sight = assess(host_proc, facts(other, engine), creds=ROOT_CONFINED, mount=PLAIN)
    (reason,) = sight.reasons
    assert reason.cause is Cause.UNREADABLE and reason.pids == (4242, 4343)
    assert "cri-containerd.apparmor.d" in reason.detail and "Unconfined" in reason.fix
    # An engine-like process of our own user counts too: it could own what we judge.
    assert causes(host_proc, ROOT_CONFINED, view=facts(engine)) == {Cause.UNREADABLE}


def test_proc_mount_reads_mountinfo(tmp_path: Path) -> None:
    os.makedirs(tmp_path / "self")
    (tmp_path / "self" / "mountinfo").write_text(
        f"22 27 0:21 / {tmp_path} rw,relatime - proc proc rw,hidepid=invisible,gid=50,subset=pid\n")
    assert proc_mount(str(tmp_path)) == ProcMount("invisible", 50, True)
    assert proc_mount(str(tmp_path)).hides


def test_hidepid_keeps_another_users_entry_unknown() -> None:
    hidden = facts(hidden_users=True)
    d = decide(SEG, hidden, ROOT, NOW)
    assert (d.state, d.reason) == (State.UNKNOWN, SharedReason.PROC_INCOMPLETE)
    # Our own user's processes are listed under hidepid: our own entry is judged as ever.
    assert decide(SEG._replace(uid=0), hidden, ROOT, NOW).state is State.STALE
    assert decide(SEG, facts(), ROOT, NOW).state is State.STALE
