"""gc --every -A's event path (docs/PLACES.md §5): reclaim time, idle CPU, a burst, and a round's cost side by side.

    .venv/bin/python bench/bench_events.py            # as root: 1,000 processes in 50 pods, a 10,000-exit burst
    .venv/bin/python bench/bench_events.py --quick    # 200 processes in 10 pods, a 1,000-exit burst

The node is built inside a private mount namespace (the script re-runs itself under `unshare --mount`), and
goes with it:

- PODS pod volumes (tmpfs at kubelet-shaped emptyDir paths), each one pod's /dev/shm: its "container" (a
  process in a mount namespace of its own, with the volume bind-mounted at /dev/shm) makes three fresh engine
  files there (not backdated: only the event path's rule for a place no live process sees removes them now)
  and forks PROCS / PODS - 1 idle processes, all in one process group;
- the agent: the DaemonSet's own command, `kvctl gc -A --engines --yes --every 10m --json --prometheus ...
  --heartbeat ... --metrics-port ...`.

1. Idle CPU: after the agent's first round, its user + system time over IDLE_S seconds in which nothing
   happens, as a share of one core (target <= 1 %; the DaemonSet's CPU limit is 100m, 10 %).
2. Reclaim: SIGKILL to every process of one pod at once (its last container), then the time until the
   pod's files are gone from its volume, for REPEATS pods (target <= 5 s; without the event path the next
   round does it: up to --every x 1.1, 660 s in the DaemonSet), and the agent's CPU time for each
   judgement.

Sections 1-3 run the agent under the DaemonSet's CPU limit, 100m, where the machine lets the script make a
cgroup v1 cpu group of its own with that CFS quota (it says so, and says when it cannot).
3. Burst: one pod of BURST processes killed at once: the time until its files are gone, and how many
   judgements the agent made for it (coalesced: one per place, the loop never blocked).
4. A round's cost: `run_gc` of the DaemonSet's options as a dry run on this node, this tree against the
   baseline revision's kvcached/ (exported with `git archive`; default: where this branch left main, on
   main the commit before HEAD), interleaved, median and best (target <= 1.0x, within noise).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
TREE = os.path.dirname(HERE)
KVCTL = os.path.join(os.path.dirname(sys.executable), "kvctl")
sys.path.insert(0, HERE)

from bench_engines import _export, _merge_base  # noqa: E402  (the same baseline, exported the same way)
from bench_places import _mount, _mounted  # noqa: E402

CONTAINER = r"""
import os, secrets, signal, subprocess, sys
vol, n, sleepers = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "exec"
subprocess.run(["mount", "--bind", vol, "/dev/shm"], check=True)
os.setpgid(0, 0)
names = [f"sgl_shm_mm_{os.getpid()}_{secrets.token_hex(4)}", f"psm_{secrets.token_hex(4)}",
         "nccl-" + secrets.token_hex(3)]
for name in names:
    with open("/dev/shm/" + name, "wb") as f:
        f.write(b"x" * 65536)
for _ in range(n - 1):
    if os.fork() == 0:
        if sleepers:
            os.execv("/bin/sleep", ["sleep", "86400"])  # small: a burst of thousands fits in memory
        signal.pause()
        os._exit(0)
print(" ".join([str(os.getpgid(0))] + names), flush=True)
signal.pause()
"""

ROUND = r"""
import json, os, sys, time
tree, host, kubelet, reps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
sys.path.insert(0, tree)
from kvcached.node.base.layout import Layout
from kvcached.node.ops.gcrun import GcOptions, run_gc
opts = GcOptions(layout=Layout(host), dry_run=True, engines=True, all_places=True, kubelet_dir=kubelet,
                 time_limit=None)
out = []
for _ in range(reps):
    t0, c0 = time.perf_counter(), time.process_time()
    run_gc(opts)
    out.append([time.perf_counter() - t0, time.process_time() - c0])
print(json.dumps(out))
"""


class Pod:
    def __init__(self, vol: str, n: int, sleepers: bool = False) -> None:
        self.vol = vol
        self.proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", sys.executable, "-c",
                                      CONTAINER, vol, str(n), "exec" if sleepers else "py"],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        pgid, *self.names = self.proc.stdout.readline().split()
        self.pgid = int(pgid)

    def left(self) -> set[str]:
        return set(self.names) & set(os.listdir(self.vol))

    def kill(self) -> None:
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


CPU_CGROUP = "/sys/fs/cgroup/cpu"  # cgroup v1's cpu controller: where this machine kind lets us set a CFS quota


def limit_cgroup(millicores: int) -> str | None:
    """A cpu cgroup of our own with the DaemonSet's CPU limit as its CFS quota, or None where none can be made
    (cgroup v2 only, or read-only): then the figures are unthrottled, and the script says so."""
    path = f"{CPU_CGROUP}/kvcbench-events-{os.getpid()}"
    try:
        os.mkdir(path)
        with open(f"{path}/cpu.cfs_period_us", "w") as f:
            f.write("100000")
        with open(f"{path}/cpu.cfs_quota_us", "w") as f:
            f.write(str(100 * millicores))
    except OSError:
        try:
            os.rmdir(path)
        except OSError:
            pass
        return None
    return path


def drop_cgroup(path: str | None) -> None:
    if path is None:
        return
    for _ in range(50):  # its processes have exited once the agent is reaped; the kernel frees the group then
        try:
            os.rmdir(path)
            return
        except OSError:
            time.sleep(0.1)


class Agent:
    """The DaemonSet's command, its stdout lines collected with their arrival times."""

    def __init__(self, host: str, kubelet: str, base: str, cgroup: str | None = None) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {**os.environ, "KVCTL_LOCK": f"{base}/gc.lock", "KVCTL_SANDBOX_ROOT": f"{base}/sandroot"}
        self.p = subprocess.Popen([KVCTL, "--root", host, "gc", "-A", "--engines", "--yes", "--every", "10m", "--json",
                                   "--kubelet-dir", kubelet, "--prometheus", f"{base}/kvctl.prom", "--heartbeat",
                                   f"{base}/heartbeat", "--metrics-port", str(port)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                  preexec_fn=None if cgroup is None else lambda: _join(cgroup))
        self.lines: list[tuple[float, dict]] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            with self.cond:
                self.lines.append((time.monotonic(), json.loads(line)))
                self.cond.notify_all()

    def wait_lines(self, n: int, timeout: float = 600) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: len(self.lines) >= n, timeout):
                raise SystemExit(f"bench_events: the agent printed {len(self.lines)} of {n} lines")

    def cpu(self) -> float:
        with open(f"/proc/{self.p.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> int:
        self.p.send_signal(signal.SIGTERM)
        return self.p.wait(120)


def _join(cgroup: str) -> None:
    with open(f"{cgroup}/cgroup.procs", "w") as f:
        f.write(str(os.getpid()))


def _volume(kubelet: str) -> str:
    vol = f"{kubelet}/pods/{uuid.uuid4()}/volumes/kubernetes.io~empty-dir/dshm"
    _mount(vol)
    return vol


def _reclaim(pod: Pod, timeout: float = 900) -> float:
    t0 = time.monotonic()
    pod.kill()
    while pod.left():
        if time.monotonic() - t0 > timeout:
            return float("inf")
        time.sleep(0.005)
    return time.monotonic() - t0


def _round_times(tree: str, host: str, kubelet: str, reps: int) -> list[list[float]]:
    r = subprocess.run([sys.executable, "-c", ROUND, tree, host, kubelet, str(reps)], capture_output=True, text=True,
                       check=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    return json.loads(r.stdout)


def run(base: str, quick: bool, baseline_rev: str) -> None:
    pods_n, procs, repeats, burst, idle_s = (10, 200, 3, 1000, 10.0) if quick else (50, 1000, 5, 10_000, 30.0)
    host, kubelet = f"{base}/host", f"{base}/kubelet"
    os.makedirs(f"{host}/tmp")
    _mount(f"{host}/dev/shm")
    pods = [Pod(_volume(kubelet), procs // pods_n) for _ in range(pods_n)]
    print(f"bench_events: {pods_n} pods of {procs // pods_n} processes each ({procs} in all), 3 fresh files per "
          "pod; the DaemonSet's command")

    # 4 first, with every pod alive: a round over the whole node, this tree against the baseline.
    rev = baseline_rev or _merge_base()
    work = os.path.join(base, "baseline")
    os.mkdir(work)
    _export(rev, work)
    rounds, reps = (4, 1) if quick else (10, 1)
    ours: list[list[float]] = []
    theirs: list[list[float]] = []
    for i in range(rounds):
        pair = [(work, theirs), (TREE, ours)]
        for tree, into in (pair if i % 2 else pair[::-1]):
            into.extend(_round_times(tree, host, kubelet, reps))

    cgroup = limit_cgroup(100)
    print("  the agent runs under the DaemonSet's CPU limit, 100m (a cgroup v1 CFS quota of 10 ms per 100 ms)"
          if cgroup else "  no cpu cgroup could be made here: the agent runs unthrottled (the DaemonSet limits "
          "it to 100m)")
    agent = Agent(host, kubelet, base, cgroup)
    try:
        agent.wait_lines(1)
        # The round's line is out before its end (the heartbeat, the watch armed): idle from when a second
        # passes without CPU (at 100m the tail of a round can take seconds).
        settled = agent.cpu()
        for _ in range(60):
            time.sleep(1.0)
            if agent.cpu() == settled:
                break
            settled = agent.cpu()
        c0, t0 = agent.cpu(), time.monotonic()
        time.sleep(idle_s)
        idle = (agent.cpu() - c0) / (time.monotonic() - t0)
        print(f"  1. idle CPU between rounds: {idle * 100:.2f} % of one core over {idle_s:.0f} s "
              f"(target <= 1 %; the DaemonSet's limit: 10 %)")

        times, cpus = [], []
        for pod in pods[:repeats]:
            c = agent.cpu()
            times.append(_reclaim(pod))
            time.sleep(0.5)  # the judgement's end: the watch armed again
            cpus.append(agent.cpu() - c)
        cpu = statistics.median(cpus)
        print(f"  2. reclaim, SIGKILL of a pod's last processes to its files gone: median "
              f"{statistics.median(times):.2f} s, max {max(times):.2f} s over {repeats} pods (target <= 5 s; "
              "without events: the next round, up to 660 s)")
        print(f"     the agent's CPU per judgement: median {cpu:.2f} s")

        n = len(agent.lines)
        big = Pod(_volume(kubelet), burst, sleepers=True)
        time.sleep(30)  # its mount seen, then its processes: the agent watches it from then on (at 100m)
        with agent.cond:
            before = len(agent.lines)
        took = _reclaim(big)
        time.sleep(1.0)
        judged = [doc for _, doc in agent.lines[before:] if doc.get("schema") == "kvctl.gc-event/1"
                  and any(p["path"] == big.vol for p in doc["places"])]
        print(f"  3. a burst of {burst:,} exits in one pod: its files gone {took:.2f} s after the SIGKILL, in "
              f"{len(judged)} judgement(s) of its place ({len(agent.lines) - n} event lines in all)")
    finally:
        code = agent.stop()
        drop_cgroup(cgroup)
        for pod in pods:
            pod.kill()

    a = statistics.median(x[0] for x in ours)
    b = statistics.median(x[0] for x in theirs)
    ac = statistics.median(x[1] for x in ours)
    bc = statistics.median(x[1] for x in theirs)
    print(f"  4. a round (run_gc -A --engines, dry run), {len(ours)} runs each, interleaved:")
    print(f"     {rev[:12]:<12} (baseline): median {b * 1000:7.1f} ms wall, {bc * 1000:7.1f} ms CPU")
    print(f"     this tree              : median {a * 1000:7.1f} ms wall, {ac * 1000:7.1f} ms CPU   ratio "
          f"{a / b:5.3f}x wall, {ac / bc:5.3f}x CPU (target <= 1.0, within noise)")
    print(f"  the agent exited {code} on SIGTERM")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--baseline-rev", default="", help="the revision section 4 compares against")
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if os.geteuid() != 0 or shutil.which("unshare") is None or not hasattr(os, "pidfd_open"):
        print("bench_events: skipped (needs root, unshare(1) and pidfds: tmpfs mounts in a private mount namespace)")
        return 0
    if not args.inside:
        cmd = ["unshare", "--mount", "--propagation", "private", sys.executable, os.path.abspath(__file__), "--inside",
               "--baseline-rev", args.baseline_rev or _merge_base()]
        return subprocess.run(cmd + (["--quick"] if args.quick else [])).returncode
    base = tempfile.mkdtemp(prefix="kvcbench-events-")
    try:
        run(base, args.quick, args.baseline_rev)
        return 0
    finally:
        for point in sorted(_mounted(base), key=len, reverse=True):
            subprocess.run(["umount", "-l", point], check=False)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
