"""The libraries' own /dev/shm families (torch's file_system shares, multiprocessing's and loky's semaphores),
made by the real libraries in real child processes on the machine's /dev/shm: kept while their processes
live, removed once they are dead.

torch and glibc put these names in the real /dev/shm whatever root a test uses, so every plan here is limited
to the names the test's own children made (as engine_plant.engine_plan does), and each child runs in its own
session: a SIGKILL to its process group takes its helpers (torch_shm_manager, multiprocessing's resource
tracker) with it, the way a killed serve's pod loses them, so that nothing unlinks the files behind kvctl.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from kvcached.node.base.layout import Layout
from kvcached.node.clean.cleanup import Action, execute
from kvcached.node.clean.decide import Policy, State
from kvcached.node.clean.leftovers.act import EnginePlan, plan_engines
from kvcached.node.clean.leftovers.decide import EngineReason
from kvcached.node.clean.leftovers.families import EngineKind

from .engine_plant import needs_whole_view

SHM = "/dev/shm"

# A tensor shared by torch's file_system strategy, as torch.multiprocessing does before it pickles one. With
# `drop`, the sender's case after put(): its storage is freed while a shared reference stays for the receiver
# (reduce_storage's _shared_incref), so the file outlives every mapping of it and only its creator is alive.
TORCH_SHARE = """
import os, sys, torch, torch.multiprocessing as mp
mp.set_sharing_strategy("file_system")
t = torch.ones(4096)
t.share_memory_()
storage = t.untyped_storage()
name = storage._share_filename_cpu_()[1].decode().lstrip("/")
if sys.argv[1] == "drop":
    storage._shared_incref()
    del t, storage
print(name, flush=True)
sys.stdin.read()
"""
# multiprocessing's Lock under spawn (fork would unlink its name at once); with `loky`, named as loky names
# every SemLock once imported (loky/backend/__init__.py patches SemLock._make_name to /loky-<pid>-<8>).
SEMAPHORE = """
import os, sys, multiprocessing
from multiprocessing import synchronize
if sys.argv[1] == "loky":
    synchronize.SemLock._make_name = staticmethod(
        lambda: f"/loky-{os.getpid()}-{next(synchronize.SemLock._rand)}")
lock = multiprocessing.get_context("spawn").Lock()
print("sem." + lock._semlock.name.lstrip("/"), flush=True)
sys.stdin.read()
"""


class Session:
    """A child in a session of its own, which says the /dev/shm name it made."""

    def __init__(self, code: str, arg: str) -> None:
        self.p = subprocess.Popen([sys.executable, "-c", code, arg], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, start_new_session=True)
        assert self.p.stdout is not None
        self.name = self.p.stdout.readline().strip()
        assert self.name, f"the child said no name (exit {self.p.poll()})"
        self.path = os.path.join(SHM, self.name)
        old = time.time() - 3600  # past the grace age: only evidence keeps it
        os.utime(self.path, (old, old))

    def kill(self) -> None:
        """SIGKILL to the child's whole process group, helpers included, and the child reaped."""
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.p.wait(timeout=30)
        # Its helpers are its group's too; wait until none is left, or one could still unlink the file.
        while any(_pgid(int(d)) == self.p.pid for d in os.listdir("/proc") if d.isdigit()):
            time.sleep(0.05)

    def close(self) -> None:
        if self.p.poll() is None:
            self.kill()
        if os.path.lexists(self.path):
            os.unlink(self.path)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


@pytest.fixture
def sessions() -> Iterator[list[Session]]:
    made: list[Session] = []
    yield made
    for s in made:
        s.close()


def _plan(*names: str) -> EnginePlan:
    return plan_engines(Layout("/"), Policy(grace=60), names=list(names))


def _decided(s: Session) -> tuple[EngineKind, State, object, tuple[int, ...]]:
    ((c, d),) = _plan(s.name).entries()
    return c.kind, d.state, d.reason, tuple(d.pids)


def _removed_after_death(s: Session, reason: EngineReason) -> None:
    s.kill()
    assert os.path.exists(s.path), "its own helpers removed it: the test proves nothing"
    p = _plan(s.name)
    ((_, d),) = p.entries()
    assert (d.state, d.reason) == (State.STALE, reason)
    report = execute(p, dry_run=False)
    assert [e.action for e in report.entries] == [Action.REMOVED] and not os.path.exists(s.path)


@needs_whole_view
def test_a_torch_file_system_share_is_kept_while_mapped_and_removed_after_its_creator_dies(
        sessions: list[Session]) -> None:
    pytest.importorskip("torch", reason="torch comes with vLLM's install (scripts/install-vllm.sh)")
    s = Session(TORCH_SHARE, "keep")
    sessions.append(s)
    assert s.name.startswith(f"torch_{s.p.pid}_")
    kind, state, reason, pids = _decided(s)
    assert (kind, state, reason) == (EngineKind.TORCH_SHM, State.LIVE, EngineReason.MAPPED) and s.p.pid in pids
    _removed_after_death(s, EngineReason.CREATOR_GONE)


@needs_whole_view
def test_a_torch_share_its_sender_dropped_is_kept_by_its_live_creator_alone(sessions: list[Session]) -> None:
    pytest.importorskip("torch", reason="torch comes with vLLM's install (scripts/install-vllm.sh)")
    s = Session(TORCH_SHARE, "drop")
    sessions.append(s)
    with open(f"/proc/{s.p.pid}/maps") as maps:
        assert s.name not in maps.read(), "the sender must no longer map it"
    assert _decided(s) == (EngineKind.TORCH_SHM, State.LIVE, EngineReason.CREATOR_ALIVE, (s.p.pid,))
    _removed_after_death(s, EngineReason.CREATOR_GONE)


@needs_whole_view
@pytest.mark.parametrize(("flavour", "reason"), [("mp", EngineReason.UNUSED), ("loky", EngineReason.CREATOR_GONE)])
def test_a_named_semaphore_is_kept_while_open_and_removed_after_its_processes_die(
        sessions: list[Session], flavour: str, reason: EngineReason) -> None:
    s = Session(SEMAPHORE, flavour)
    sessions.append(s)
    assert s.name.startswith("sem.mp-" if flavour == "mp" else f"sem.loky-{s.p.pid}-"), s.name
    kind, state, why, pids = _decided(s)
    assert (kind, state, why) == (EngineKind.PYTHON_SEM, State.LIVE, EngineReason.MAPPED) and s.p.pid in pids
    _removed_after_death(s, reason)


def test_a_name_no_family_knows_stays_untouched(tmp_path) -> None:
    """Shapes beside the new families' (another program's semaphore, a torch name of another version)."""
    layout = Layout(str(tmp_path))
    os.makedirs(layout.shm_dir)
    names = ["sem.other-ab12cd_9", "sem.mp-short", "torch_4242_7", "torch_4242_1_2.bak"]
    for n in names:
        path = os.path.join(layout.shm_dir, n)
        with open(path, "wb") as f:
            f.write(b"x" * 4096)
        os.utime(path, (1, 1))
    p = plan_engines(layout, Policy(grace=0))
    assert list(p.entries()) == []
    report = execute(p, dry_run=False)
    assert report.entries == [] and sorted(os.listdir(layout.shm_dir)) == sorted(names)
