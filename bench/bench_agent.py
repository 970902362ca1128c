"""The DaemonSet's sizing: the agent's own command line, measured on a node of many engine processes (issue 38).

    .venv/bin/python bench/bench_agent.py             # as root: 1,000 processes, 50 pod volumes, 6 runs
    .venv/bin/python bench/bench_agent.py --quick     # 300 processes, 10 volumes, 3 runs

The node is built the way the other benchmarks build theirs, inside a private mount namespace (the script
re-runs itself under `unshare --mount` when it is not in one), and goes with it:

- PROCS forked processes, each holding three regular files and /dev/null open; one in four is an engine
  (titled VLLM::Worker_TP or sglang::scheduler, as the node's engines are) that maps a live psm_ buffer of
  its own in the host's /dev/shm, and one in ten of those also listens on a vLLM ZMQ socket in /tmp;
- the host's /dev/shm (a tmpfs) holds 10,000 dead engine files (sgl_shm_mm_*, psm_*, nccl-*, 4 KiB each,
  backdated past the grace), /tmp 1,000 dead vLLM socket nodes;
- VOLUMES pod volumes (tmpfs at kubelet-shaped emptyDir paths) of 200 dead files each.

Then the DaemonSet's own command, `kvctl gc --engines --all-namespaces --every ... --json --prometheus
... --heartbeat ... --metrics-port ...`, as a dry run (a run with --yes would leave the next nothing to
judge: every run here judges the full set, the worst case a node gives), with a 10 ms pause between runs
(so that the time between two runs' lines is one run), under `/usr/bin/time -v` for RUNS runs, and its
probe `kvctl gc --check-heartbeat` once. It prints the peak RSS, the CPU per run (the process's user +
system time over its runs, start-up included) and each run's wall time, the figures
contrib/kubernetes/README.md's "Resources" and the manifest's requests and limits come from.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
KVCTL = os.path.join(os.path.dirname(sys.executable), "kvctl")
sys.path.insert(0, HERE)

from bench_places import _fill, _mount, _mounted, _names  # noqa: E402  (the same node, built the same way)


def build(base: str, volumes: int) -> tuple[str, str]:
    """(host root, kubelet dir): dead engine files in the host's /dev/shm, dead sockets in /tmp, pod volumes."""
    host, kubelet = f"{base}/host", f"{base}/kubelet"
    os.makedirs(f"{host}/tmp")
    _mount(f"{host}/dev/shm")
    _fill(f"{host}/dev/shm", _names(10_000))
    old = time.time() - 3600
    for _ in range(1000):
        path = f"{host}/tmp/{uuid.uuid4()}"
        s = socket.socket(socket.AF_UNIX)
        s.bind(path)
        s.close()  # bound once, nobody listens: what a killed serve leaves
        os.utime(path, (old, old), follow_symlinks=False)
    for _ in range(volumes):
        vol = f"{kubelet}/pods/{uuid.uuid4()}/volumes/kubernetes.io~empty-dir/dshm"
        _mount(vol)
        _fill(vol, _names(200))
    return host, kubelet


def spawn(n: int, host: str, base: str) -> list[int]:
    """n idle processes; one in four an engine mapping a live buffer of its own, one in ten of those listening."""
    files = []
    for i in range(3):
        path = os.path.join(base, f"log{i}")
        with open(path, "w"):
            pass
        files.append(path)
    libc = ctypes.CDLL(None)
    pids = []
    for i in range(n):
        pid = os.fork()
        if pid == 0:
            try:
                held = [os.open(f, os.O_RDONLY) for f in files] + [os.open(os.devnull, os.O_RDONLY)]
                if i % 4 == 0:
                    libc.prctl(15, b"VLLM::Worker_TP" if i % 8 == 0 else b"sglang::schedul", 0, 0, 0)
                    fd = os.open(f"{host}/dev/shm/psm_{i:08x}", os.O_RDWR | os.O_CREAT, 0o600)
                    os.ftruncate(fd, 1 << 16)
                    held.append(fd)
                    keep = mmap.mmap(fd, 1 << 16)
                    keep[0] = 1
                    if i % 40 == 0:
                        srv = socket.socket(socket.AF_UNIX)
                        srv.bind(f"{host}/tmp/{uuid.uuid4()}")
                        srv.listen()
                signal.pause()
            finally:
                os._exit(0)
        pids.append(pid)
    return pids


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _time_v(stderr: str) -> dict[str, float]:
    got = {}
    for key, pattern in (("user", r"User time \(seconds\): ([\d.]+)"), ("sys", r"System time \(seconds\): ([\d.]+)"),
                         ("rss_kib", r"Maximum resident set size \(kbytes\): (\d+)")):
        m = re.search(pattern, stderr)
        got[key] = float(m.group(1)) if m else float("nan")
    return got


def measure(host: str, kubelet: str, runs: int, base: str) -> None:
    hb, prom = f"{base}/heartbeat", f"{base}/kvctl.prom"
    env = {**os.environ, "KVCTL_LOCK": f"{base}/gc.lock", "KVCTL_EVERY_MIN_S": "0.01"}
    argv = ["/usr/bin/time", "-v", KVCTL, "--root", host, "gc", "--dry-run", "--engines", "--all-namespaces",
            "--kubelet-dir", kubelet, "--every", "0.01s", "--json", "--prometheus", prom, "--heartbeat", hb,
            "--metrics-port", str(_free_port())]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    walls, judged = [], 0
    assert p.stdout is not None
    last = time.monotonic()
    for _ in range(runs):
        doc = json.loads(p.stdout.readline())
        now = time.monotonic()
        walls.append(now - last)  # a pause of 10 ms between runs: the time between two lines is one run
        last = now
        if "summary" not in doc:
            p.kill()
            raise SystemExit(f"bench_agent: the run failed: {doc}")
        judged = doc["summary"]["entries"]
    # To kvctl, not to time(1), which would die of it without its report: kvctl ends its loop and time reports.
    with open(f"/proc/{p.pid}/task/{p.pid}/children") as f:
        (child,) = map(int, f.read().split())
    os.kill(child, signal.SIGTERM)
    _, err = p.communicate(timeout=600)
    loop = _time_v(err)
    probe = subprocess.run(["/usr/bin/time", "-v", KVCTL, "gc", "--check-heartbeat", hb, "--max-age", "20m"],
                           capture_output=True, text=True, env=env, timeout=60)
    one = _time_v(probe.stderr)
    cpu = (loop["user"] + loop["sys"]) / runs
    print(f"  entries judged per run: {judged} (every place), {runs} runs")
    print(f"  agent: peak RSS {loop['rss_kib'] / 1024:.0f} MiB; CPU {cpu:.2f} s per run "
          f"(user {loop['user']:.2f} s + sys {loop['sys']:.2f} s over the {runs} runs, start-up included)")
    print(f"  each run's wall time (the first with start-up): {', '.join(f'{w:.2f}' for w in walls)} s")
    print(f"  probe (gc --check-heartbeat): peak RSS {one['rss_kib'] / 1024:.0f} MiB, "
          f"CPU {one['user'] + one['sys']:.2f} s, exit {probe.returncode}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--procs", type=int)
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if os.geteuid() != 0 or shutil.which("unshare") is None or not os.path.exists("/usr/bin/time"):
        print("bench_agent: skipped (needs root, unshare(1) and /usr/bin/time: tmpfs mounts in a private namespace)")
        return 0
    if not args.inside:
        cmd = ["unshare", "--mount", "--propagation", "private", sys.executable, os.path.abspath(__file__), "--inside"]
        return subprocess.run(cmd + sys.argv[1:]).returncode
    procs = args.procs or (300 if args.quick else 1000)
    volumes, runs = (10, 3) if args.quick else (50, 6)
    base = tempfile.mkdtemp(prefix="kvcbench-agent-")
    pids: list[int] = []
    try:
        host, kubelet = build(base, volumes)
        pids = spawn(procs, host, base)
        time.sleep(1.0)
        with open("/proc/loadavg") as f:
            load = f.read().split()[0]
        print(f"bench_agent: the DaemonSet's command over {sum(e.isdigit() for e in os.listdir('/proc'))} processes "
              f"({procs} planted processes, {procs // 4} of them engines mapping a live buffer), "
              f"{volumes} pod volumes x 200 dead files, 10,000 dead files and 1,000 dead sockets on the host; "
              f"load {load}, {os.cpu_count()} cores")
        measure(host, kubelet, runs, base)
        return 0
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        for pid in pids:
            os.waitpid(pid, 0)
        for point in sorted(_mounted(base), key=len, reverse=True):
            subprocess.run(["umount", point], check=False)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
