"""kvctl -A (issue 30): the pass over every place against the host's pass over the same files, side by side.

    .venv/bin/python bench/bench_places.py            # as root (tmpfs mounts in a private mount namespace)
    .venv/bin/python bench/bench_places.py --quick

The node: 50 pod volumes (tmpfs at kubelet-shaped emptyDir paths) of 200 dead
engine files each (SGLang's sgl_shm_mm_<pid>_*, Python's psm_*, NCCL's nccl-*,
backdated past the grace age), against one host /dev/shm (a tmpfs) holding
the same 10,000 files. Timed, interleaved round by round, each from a fresh
/proc pass:

- host: `gc --engines --dry-run`'s work on the one directory: the /proc
  facts, kvcached's plan and the engine plan, both run dry;
- -A: the same over every place: the /proc facts, discovery, every place's
  kvcached plan and engine plan (one maps pass, one NSpid pass), all run dry.

Target: -A / host <= 1.5 (the pass grows with files and processes, not with
places x processes). Everything is made in a private mount namespace, so the
mounts vanish with the process; the script re-runs itself under
`unshare --mount` when it is not in one already.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

PLACES, FILES = 50, 200
_ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def _names(n: int) -> list[str]:
    out = []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            out.append(f"sgl_shm_mm_{40000 + i}_{secrets.token_hex(4)}")
        elif kind == 1:
            out.append(f"psm_{secrets.token_hex(4)}")
        else:
            out.append("nccl-" + "".join(secrets.choice(_ALNUM) for _ in range(6)))
    return out


def _fill(directory: str, names: list[str]) -> None:
    old = time.time() - 3600
    for n in names:
        path = os.path.join(directory, n)
        with open(path, "wb") as f:
            f.write(b"x" * 4096)
        os.utime(path, (old, old))


def _mount(path: str) -> None:
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777,size=256m", "kvcbench", path], check=True)


def build(base: str) -> tuple[str, str, str]:
    """(host root with 10,000 files in its /dev/shm, empty root for -A, kubelet dir with 50 volumes of 200)."""
    host, empty, kubelet = f"{base}/host", f"{base}/empty", f"{base}/kubelet"
    os.makedirs(f"{host}/tmp")
    _mount(f"{host}/dev/shm")
    os.makedirs(f"{empty}/tmp")
    os.makedirs(f"{empty}/dev/shm")
    every: list[str] = []
    for _ in range(PLACES):
        names = _names(FILES)
        vol = f"{kubelet}/pods/{uuid.uuid4()}/volumes/kubernetes.io~empty-dir/dshm"
        _mount(vol)
        _fill(vol, names)
        every += names
    _fill(f"{host}/dev/shm", every)
    return host, empty, kubelet


def host_pass(root: str) -> int:
    """gc --engines --dry-run over the host's one directory; entries judged."""
    from kvcached.node.base.layout import Layout
    from kvcached.node.clean.cleanup import execute, plan
    from kvcached.node.clean.decide import Policy
    from kvcached.node.clean.facts import gather_facts
    from kvcached.node.clean.leftovers.act import plan_engines
    from kvcached.node.clean.report import Source

    layout, policy = Layout(root), Policy(grace=60)
    facts = gather_facts()
    p = plan(layout, policy, facts=facts)
    ep = plan_engines(layout, policy, facts=facts)
    engines = execute(p, ep, dry_run=True).part(Source.ENGINES)
    return len(engines.entries) if engines is not None else 0


def places_pass(root: str, kubelet: str) -> int:
    """gc -A --engines --dry-run: every place found, planned and run dry; entries judged outside the host."""
    from kvcached.node.base.layout import Layout
    from kvcached.node.clean.cleanup import plan
    from kvcached.node.clean.decide import Policy
    from kvcached.node.clean.facts import gather_facts
    from kvcached.node.clean.report import Source
    from kvcached.node.ops.rounds import act
    from kvcached.node.places.run import plan_places

    layout, policy = Layout(root), Policy(grace=60)
    facts = gather_facts()
    host = plan(layout, policy, facts=facts)
    pp = plan_places(layout, policy, facts, engines=True, kubelet_dir=kubelet, host_plan=host)
    results = [act(plan, dry_run=True) for plan in pp.plans]
    return sum(r.report.count(source=Source.ENGINES) for r in results if r.report is not None)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        print("bench_places: skipped (needs root and unshare(1) for tmpfs mounts in a private mount namespace)")
        return 0
    if not args.inside:
        cmd = ["unshare", "--mount", "--propagation", "private", sys.executable, os.path.abspath(__file__), "--inside"]
        return subprocess.run(cmd + (["--quick"] if args.quick else [])).returncode
    base = tempfile.mkdtemp(prefix="kvcbench-places-")
    try:
        host, empty, kubelet = build(base)
        rounds = 3 if args.quick else 7
        assert host_pass(host) == PLACES * FILES, "the host pass must judge every file"
        assert places_pass(empty, kubelet) == PLACES * FILES, "the -A pass must judge every file"
        times: dict[str, list[float]] = {"host": [], "-A": []}
        for _ in range(rounds):
            for key, fn in (("host", lambda: host_pass(host)), ("-A", lambda: places_pass(empty, kubelet))):
                t = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - t)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"bench_places: {PLACES} places x {FILES} files vs one directory of {PLACES * FILES} "
              f"(median of {rounds}, interleaved)")
        print(f"  host pass (one directory)   {med['host'] * 1000:8.1f} ms")
        print(f"  -A pass ({PLACES} pod volumes)   {med['-A'] * 1000:8.1f} ms")
        ratio = med["-A"] / med["host"]
        print(f"  -A / host                   {ratio:8.2f}x  (target <= 1.5)")
        return 0
    finally:
        for point in sorted(_mounted(base), key=len, reverse=True):
            subprocess.run(["umount", point], check=False)
        shutil.rmtree(base, ignore_errors=True)


def _mounted(base: str) -> list[str]:
    with open("/proc/self/mounts") as f:
        return [line.split()[1] for line in f if line.split()[1].startswith(base)]


if __name__ == "__main__":
    sys.exit(main())
