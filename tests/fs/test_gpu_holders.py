"""GPU holders found by device number, judged by the orphan rule, and ended safely: real processes, real nodes.

The device nodes are made with mknod in the test's own directory (NVIDIA's
major 195, DRM's 226, AMD's render nodes among them) and held by real child
processes with engine titles: argv[0] as `exec -a` sets it, comm through
prctl(PR_SET_NAME). No driver is loaded on this machine, so the nodes are
opened O_PATH, which the kernel allows without one.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kvcached.node.base.enums import KillOutcome
from kvcached.node.clean.facts import gather_facts
from kvcached.node.gpu.devices import Device, device_table
from kvcached.node.gpu.gcstep import gpu_step
from kvcached.node.gpu.holders import find_holders, mapped_uses
from kvcached.node.gpu.judge import HolderState
from kvcached.node.gpu.kill import gpu_fds_left, terminate_holders
from tests.fs.gpu_fixtures import node
from tests.waiting import wait_for, wait_for_state

NO_NVML = dict(memory=False)


def _serve(n: dict[str, str], tag: str = "") -> dict:
    """vLLM's shape: the API server starts EngineCore, which starts one worker per TP rank."""
    workers = tuple(node(f"VLLM::Worker_TP{r}_PP0", f"worker{r}{tag}", comm="VLLM::Worker_TP",
                         hold=(n["nvidiactl"], n[f"nvidia{r}"])) for r in (0, 1))
    engine = node("VLLM::EngineCore", f"engine{tag}", hold=(n["nvidiactl"], n["nvidia0"]), children=workers)
    return node("VLLM::APIServer", f"api{tag}", children=(engine,))


def _holders(**kw: object) -> dict[int, object]:
    return {h.pid: h for h in find_holders(gather_facts(), **{**NO_NVML, **kw}).holders}


def test_an_engine_whose_api_server_was_sigkilled_is_an_orphan_and_is_ended(gpu_nodes, standins) -> None:
    api = standins.start(_serve(gpu_nodes))
    engine, w0, w1 = standins.pids("engine", "worker0", "worker1")
    api.kill()
    api.wait()
    wait_for(lambda: os.stat(f"/proc/{engine}").st_nlink and open(f"/proc/{engine}/stat").read().split(") ")[1]
             .split()[1] != str(api.pid))
    found = _holders()
    assert found[engine].state is HolderState.ORPHAN, found[engine].reason
    assert "reparented" in found[engine].reason
    assert found[engine].title == "VLLM::EngineCore"
    # The workers' EngineCore is alive, but it is an orphan: so are they.
    assert {found[w].state for w in (w0, w1)} == {HolderState.ORPHAN}
    assert {u.device.name for u in found[w1].devices} == {"nvidiactl", "nvidia1"}
    assert found[w1].gpus == ["1"]
    assert all(u.via == "fd" for u in found[engine].devices)
    results = terminate_holders([found[p] for p in (engine, w0, w1)], grace=5.0, time_limit=30)
    assert {r.pid: r.outcome for r in results} == {p: KillOutcome.TERMINATED for p in (engine, w0, w1)}
    for pid in (engine, w0, w1):
        assert not gpu_fds_left("/proc", pid, device_table())


def test_a_live_serves_workers_are_kept(gpu_nodes, standins) -> None:
    api = standins.start(_serve(gpu_nodes))
    engine, w0, w1 = standins.pids("engine", "worker0", "worker1")
    found = _holders()
    for pid in (engine, w0, w1):
        assert found[pid].state is HolderState.SERVING, found[pid].reason
        assert found[pid].serve == f"VLLM::APIServer (PID {api.pid})"
    report, killed = gpu_step(gather_facts(), kill=True, yes=True, dry_run=False, confirm=None, time_limit=10)
    assert not [k for k in killed if k.pid in (engine, w0, w1)]
    assert all(os.path.exists(f"/proc/{p}") for p in (engine, w0, w1))


def test_a_training_job_is_reported_and_never_killed(gpu_nodes, standins) -> None:
    # Its parent (a launcher) dies too: whatever its parent, a process that is no engine's is not ours to end.
    launcher = standins.start(node("python", "launcher", children=(
        node("python", "train", comm="python", hold=(gpu_nodes["nvidia0"], gpu_nodes["renderD128"])),)))
    (train,) = standins.pids("train")
    launcher.kill()
    launcher.wait()
    h = _holders()[train]
    assert h.state is HolderState.FOREIGN and h.serve is None
    assert {u.device.name for u in h.devices} == {"nvidia0", "renderD128"}
    (r,) = terminate_holders([h], grace=1.0, time_limit=5)
    assert r.outcome is KillOutcome.FAILED and "never killed" in r.detail
    assert wait_for_state(train, "S", timeout=5) == "S"


def test_the_engine_of_a_serve_whose_api_server_died_under_a_live_shell_is_an_orphan(gpu_nodes, standins) -> None:
    sh = standins.start(_serve(gpu_nodes), shell=True)
    api, engine = standins.pids("api", "engine")
    assert open(f"/proc/{api}/cmdline", "rb").read().split(b"\0")[0] == b"VLLM::APIServer"  # exec -a's doing
    os.kill(api, signal.SIGKILL)
    wait_for(lambda: _holders()[engine].state is HolderState.ORPHAN)
    # The shell, the group's leader, lives on: the group alone would call this engine's serve alive.
    assert sh.poll() is None and os.getpgid(engine) == sh.pid
    assert "reparented" in _holders()[engine].reason


def test_an_orphan_whose_pid_is_reused_before_the_kill_is_never_signalled(gpu_nodes, standins) -> None:
    api = standins.start(node("VLLM::APIServer", "api", children=(
        node("VLLM::EngineCore", "engine", hold=(gpu_nodes["nvidia0"],)),
        node("VLLM::EngineCore", "engine2", hold=(gpu_nodes["nvidia1"],)))))
    engine, engine2 = standins.pids("engine", "engine2")
    api.kill()
    api.wait()
    wait_for(lambda: _holders().get(engine2) is not None and _holders()[engine2].state is HolderState.ORPHAN)
    found = _holders()
    # A PID cannot be made to be reused on demand: the process behind `engine` stands for a newcomer by carrying
    # another start time than the pass recorded, which is exactly what the pidfd check compares.
    newcomer = dataclasses.replace(found[engine], info=found[engine].info._replace(
        start_time=found[engine].info.start_time - 100))
    # And `engine2` exits between the pass and the kill.
    os.kill(engine2, signal.SIGKILL)
    wait_for(lambda: not os.path.exists(f"/proc/{engine2}") or open(f"/proc/{engine2}/stat").read().split(") ")[1][0]
             in "ZX")
    results = {r.pid: r for r in terminate_holders([newcomer, found[engine2]], grace=1.0, time_limit=5)}
    assert results[engine].outcome is KillOutcome.REPLACED
    assert results[engine2].outcome is KillOutcome.GONE
    assert wait_for_state(engine, "S", timeout=5) == "S"  # never signalled


def test_a_holder_that_mapped_a_device_and_closed_its_descriptor_is_found_through_maps(tmp_path) -> None:
    # The kernel here lets no test map a GPU node: without the driver, opening one for I/O is ENXIO and an O_PATH
    # descriptor cannot be mapped; /dev/mem is refused (ENXIO) and /dev/zero's shared mapping is an anonymous
    # shmem object that maps does not name by the node. So a regular file stands in for the node, and the table
    # of known GPU nodes is told its identity: the maps read and the match by (st_dev, st_ino) are the real ones.
    path = tmp_path / "mapped-node"
    path.write_bytes(b"\0" * mmap.PAGESIZE)
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import ctypes, mmap, os, sys
        # libc's mmap, not Python's: mmap.mmap keeps a dup of the descriptor for as long as the mapping lives.
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        fd = os.open({str(path)!r}, os.O_RDWR)
        addr = libc.mmap(None, {mmap.PAGESIZE}, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        os.close(fd)
        print("ready", flush=True)
        sys.stdin.read()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        assert not [t for t in os.listdir(f"/proc/{child.pid}/fd") if os.readlink(f"/proc/{child.pid}/fd/{t}")
                    == str(path)]
        st = os.stat(path)
        known = {(st.st_dev, st.st_ino): Device("nvidia", 195, 3, "nvidia3", 3)}
        uses: dict = {}
        mapped_uses(gather_facts(), known, uses)
        assert [(u.device.name, u.via) for u, _ in uses[child.pid].values()] == [("nvidia3", "map")]
    finally:
        child.communicate("", timeout=10)


def test_stopped_holders_say_so(gpu_nodes, standins) -> None:
    standins.start(node("VLLM::EngineCore", "engine", hold=(gpu_nodes["nvidia0"],)))
    (engine,) = standins.pids("engine")
    os.kill(engine, signal.SIGSTOP)
    wait_for_state(engine, "T")
    assert _holders()[engine].proc_state == "T"
    os.kill(engine, signal.SIGCONT)


@pytest.mark.parametrize("scheduler", ["sglang::scheduler_DP1_TP0", "sglang::data_parallel_controller"])
def test_sglang_children_reparented_to_init_are_orphans(gpu_nodes, standins, scheduler: str) -> None:
    main = standins.start(node("python", "main", children=(node(scheduler, "sched", hold=(gpu_nodes["nvidia0"],)),)))
    (sched,) = standins.pids("sched")
    found = _holders()
    assert found[sched].state is HolderState.SERVING and found[sched].serve == f"sglang main (PID {main.pid})"
    main.kill()
    main.wait()
    wait_for(lambda: _holders()[sched].state is HolderState.ORPHAN)


VFORK_HOLDER = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <sys/prctl.h>
#include <unistd.h>
int main(int argc, char **argv) {
    int fd = open(argv[1], O_PATH);
    if (fd < 0 || prctl(PR_SET_NAME, "VLLM::EngineCor", 0, 0, 0) != 0) return 2;
    FILE *f = fopen(argv[2], "w");
    fprintf(f, "%d", getpid());
    fclose(f);
    /* The parent of a vfork waits for its child's exec or exit in a killable uninterruptible sleep: /proc shows
       it in D until then, which is the one D state a test can make on purpose. */
    if (vfork() == 0) { sleep(60); _exit(0); }
    return 0;
}
"""


def test_a_holder_in_uninterruptible_sleep_is_reported_and_not_waited_on_past_the_grace(gpu_nodes, tmp_path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the vfork holder")
    (tmp_path / "holder.c").write_text(VFORK_HOLDER)
    exe = tmp_path / "holder"
    subprocess.run([cc, "-O1", "-o", str(exe), str(tmp_path / "holder.c")], check=True, capture_output=True,
                   timeout=120)
    ready = tmp_path / "pid"
    launcher = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                                 "subprocess.Popen(sys.argv[1:]); time.sleep(60)", str(exe), gpu_nodes["nvidia0"],
                                 str(ready)], start_new_session=True)
    child = None
    try:
        wait_for(lambda: ready.exists() and ready.read_text())
        pid = int(ready.read_text())
        wait_for_state(pid, "D")
        child = int(open(f"/proc/{pid}/task/{pid}/children").read().split()[0])
        launcher.kill()
        launcher.wait()
        wait_for(lambda: _holders()[pid].state is HolderState.ORPHAN)
        h = _holders()[pid]
        assert h.proc_state == "D"
        report = find_holders(gather_facts(), memory=False)
        assert pid in {s.pid for s in report.stuck}
        # A real D holder may never wake; this one sleeps killably, so SIGKILL ends it. What the test proves: it
        # gets SIGKILL at once and the wait on it is the grace, not the run's whole time limit.
        t = time.monotonic()
        (r,) = terminate_holders([h], grace=2.0, time_limit=60)
        assert time.monotonic() - t < 10
        assert r.outcome in (KillOutcome.TERMINATED, KillOutcome.FAILED), r
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
            wait_for(lambda: not os.path.exists(f"/proc/{child}"), timeout=20)  # reaped by init
