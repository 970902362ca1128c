"""Engine leftovers (issue 20): plain gc before/after, and what asking for engine state costs, side by side.

    .venv/bin/python bench/bench_engines.py                    # both (~1-2 min)
    .venv/bin/python bench/bench_engines.py --quick
    .venv/bin/python bench/bench_engines.py --baseline-rev main  # section 1's baseline (default: where
                                                                 # this branch left main; on main, HEAD~1)

1. Plain gc before/after: `execute(plan(...), dry_run=True)` over bench_gc's
   node (N = 1,000 stale deployments x 8 sockets + N segments), timed in child
   interpreters that import either this tree's kvcached or the baseline
   revision's (exported with `git archive`, nothing installed), interleaved
   round by round. Target: this tree / baseline <= 1.0 (within noise): plain
   gc never calls the engine pass.
2. The engine pass: 1,000 dead `psm_` files (64 KiB each, 8 of them mapped by
   live processes) and 200 extra processes that each map a file of their
   own in the same tmpfs, on a private root inside /dev/shm (so that the
   maps pass matches the real tmpfs device, as on a node). Timed, interleaved:
   the /proc fact pass alone; plain gc (`kvctl gc`'s plan + dry run); plain
   gc plus the engine plan + dry run on the same facts (`gc --engines`); and
   a bare loop with the same syscalls' floor (list /dev/shm, lstat each
   entry, read every process's maps once).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

from bench_gc import make_stale_node

from kvcached.node.base.layout import Layout
from kvcached.node.clean.cleanup import execute, plan
from kvcached.node.clean.decide import Policy
from kvcached.node.clean.facts import gather_facts
from kvcached.node.clean.leftovers.act import plan_engines

TREE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import kvcached
assert kvcached.__file__.startswith(sys.argv[1]), kvcached.__file__
from kvcached.node.clean.cleanup import execute, plan
from kvcached.node.clean.decide import Policy
from kvcached.node.base.layout import Layout
layout, policy, out = Layout(sys.argv[2]), Policy(grace=0.0), []
execute(plan(layout, policy), dry_run=True)  # warm: imports, first /proc reads
for _ in range(int(sys.argv[3])):
    t = time.perf_counter()
    execute(plan(layout, policy), dry_run=True)
    out.append(time.perf_counter() - t)
print(json.dumps(out))
"""


def _export(rev: str, dest: str) -> None:
    """The baseline revision's kvcached/ package, as files (no build: the node layer is pure Python)."""
    archive = subprocess.run(["git", "-C", TREE, "archive", "--format=tar", rev, "kvcached"], capture_output=True,
                             check=True).stdout
    tar_path = os.path.join(dest, "base.tar")
    with open(tar_path, "wb") as f:
        f.write(archive)
    with tarfile.open(tar_path) as t:
        t.extractall(dest, filter="data")


def _child_times(tree: str, base: str, reps: int) -> list[float]:
    r = subprocess.run([sys.executable, "-c", _CHILD, tree, base, str(reps)], capture_output=True, text=True,
                       check=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    return json.loads(r.stdout)


def _merge_base() -> str:
    """Where this branch left main; on main itself (nothing to compare), the commit before HEAD."""
    def git(*args: str) -> str:
        r = subprocess.run(["git", "-C", TREE, *args], capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else ""

    base = git("merge-base", "main", "HEAD")
    return "HEAD~1" if not base or base == git("rev-parse", "HEAD") else base


def bench_plain(rev: str, quick: bool) -> None:
    print(f"== 1. plain gc dry run, this tree vs {rev[:12]}, 1,000 stale deployments (8,000 sockets) ==")
    work = tempfile.mkdtemp(prefix="kvbe", dir="/tmp")
    try:
        baseline = os.path.join(work, "baseline")
        os.mkdir(baseline)
        _export(rev, baseline)
        node = os.path.join(work, "n")
        make_stale_node(node, 1000)
        # Many short rounds, which tree goes first alternating: on a shared machine the load moves
        # within seconds, and long runs of one tree would measure the load, not the code.
        rounds, reps = (6, 2) if quick else (20, 2)
        ours: list[float] = []
        theirs: list[float] = []
        for i in range(rounds):
            pair = [(baseline, theirs), (TREE, ours)]
            for tree, into in (pair if i % 2 else pair[::-1]):
                into.extend(_child_times(tree, node, reps))
        a, b = statistics.median(ours), statistics.median(theirs)
        print(f"    {rev[:12]:<12} (baseline)     : median {b * 1000:7.1f} ms, best {min(theirs) * 1000:7.1f} ms "
              f"({len(theirs)} runs)")
        print(f"    this tree                 : median {a * 1000:7.1f} ms, best {min(ours) * 1000:7.1f} ms   "
              f"ratio {a / b:5.3f}x median, {min(ours) / min(theirs):5.3f}x best (target <= 1.0, within noise)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _mappers(n: int, shm_dir: str) -> list[int]:
    """Fork n processes, each mapping a 64 KiB file of its own in `shm_dir`, then idle."""
    pids = []
    for i in range(n):
        path = os.path.join(shm_dir, f"mapper-{i}")
        with open(path, "wb") as f:
            f.write(b"\0" * 65536)
        pid = os.fork()
        if pid == 0:
            try:
                with open(path, "r+b") as f:
                    m = mmap.mmap(f.fileno(), 65536)
                signal.pause()
                m.close()
            finally:
                os._exit(0)
        pids.append(pid)
    return pids


def _reap(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in pids:
        os.waitpid(pid, 0)


def _bare_floor(layout: Layout) -> None:
    fd = os.open(layout.shm_dir, os.O_RDONLY | os.O_DIRECTORY)
    for name in os.listdir(fd):
        os.stat(name, dir_fd=fd, follow_symlinks=False)
    os.close(fd)
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/maps", "rb") as f:
                    f.read()
            except OSError:
                pass


def bench_engine_pass(quick: bool, files: int, procs: int) -> None:
    print(f"== 2. the engine pass: {files} dead psm_ files, {procs} extra processes mapping tmpfs files ==")
    root = tempfile.mkdtemp(prefix="kvbe", dir="/dev/shm")
    pids: list[int] = []
    live: list[mmap.mmap] = []
    try:
        for sub in ("tmp", "dev/shm"):
            os.makedirs(os.path.join(root, sub))
        layout = Layout(root)
        old = time.time() - 3600
        for i in range(files):
            path = os.path.join(layout.shm_dir, f"psm_{i:08x}")
            with open(path, "wb") as f:
                f.write(b"\0" * 65536)
            os.utime(path, (old, old))
            if i % (files // 8 or 1) == 0:
                with open(path, "r+b") as f:
                    live.append(mmap.mmap(f.fileno(), 65536))
        pids = _mappers(procs, os.path.join(root, "tmp"))
        policy = Policy(grace=60)
        runs: dict[str, list[float]] = {"facts": [], "plain": [], "engines": [], "bare": []}

        def timed(key: str, fn) -> None:  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            fn()
            runs[key].append(time.perf_counter() - t)

        def plain() -> None:
            execute(plan(layout, policy), dry_run=True)

        def with_engines() -> None:
            f = gather_facts()
            execute(plan(layout, policy, facts=f), dry_run=True)
            execute(plan_engines(layout, policy, facts=f), dry_run=True)

        check = execute(plan_engines(layout, policy), dry_run=True)
        for _ in range(3 if quick else 9):  # interleaved, so that a noisy moment hits all alike
            timed("bare", lambda: _bare_floor(layout))
            timed("facts", gather_facts)
            timed("plain", plain)
            timed("engines", with_engines)
        med = {k: statistics.median(v) for k, v in runs.items()}
        seen = len(gather_facts().processes)
        print(f"  processes on the node: {seen}; plan: {check.summary()['states']}")
        print(f"    bare listdir+lstat+read maps  : {med['bare'] * 1000:8.1f} ms")
        print(f"    /proc fact pass alone         : {med['facts'] * 1000:8.1f} ms")
        print(f"    plain gc dry run              : {med['plain'] * 1000:8.1f} ms")
        added = med["engines"] - med["plain"]
        print(f"    gc --engines dry run          : {med['engines'] * 1000:8.1f} ms   "
              f"{med['engines'] / med['plain']:5.2f}x plain gc; the engine pass adds "
              f"{added * 1000:6.1f} ms, {added / med['bare']:4.2f}x the bare floor")
    finally:
        for m in live:
            m.close()
        _reap(pids)
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats")
    ap.add_argument("--baseline-rev", default=None,
                    help="the revision section 1 compares against (default: git merge-base main HEAD)")
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--procs", type=int, default=200)
    ap.add_argument("--only", choices=("plain", "engines"))
    args = ap.parse_args()
    print(f"kvcached engine-pass benchmarks: python {sys.version.split()[0]}, {os.cpu_count()} cpus, "
          f"load {os.getloadavg()[0]:.2f}")
    if args.only in (None, "plain"):
        bench_plain(args.baseline_rev or _merge_base(), args.quick)
    if args.only in (None, "engines"):
        bench_engine_pass(args.quick, args.files, args.procs)


if __name__ == "__main__":
    main()
