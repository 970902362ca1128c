#!/usr/bin/env python3
"""kvctl's start-up, as two ratios measured side by side in one run (issue 18):

1. `kvctl gc --dry-run` on an empty root against `python -c "import typer"` in the same
   venv (the framework kvctl is built on): target <= 1.3.
2. One TAB completion (`kvctl g<TAB>`, bash's request: `_KVCTL_COMPLETE=complete_bash`)
   against `python -c pass` (the interpreter with the venv's site): target <= 3.

Cron and completion scripts re-run kvctl all the time (docs/CLEANER.md §2). The four
commands run in turn, A B C D A B C D ..., and each ratio is the median of the ratios
of the runs taken side by side, so that a noisy moment of a shared machine hits both
sides of a pair. Both the wall time and the CPU time (user + system, the kernel's
accounting of the finished child) are printed; on a loaded machine the CPU ratio is the
steadier one. Bytecode is cached, as after `pip install`.

    python bench/bench_cli_start.py [--runs 21] [--json] [--torch-python PY]

`--torch-python PY` adds the old yardstick, `PY -c "import torch"` (kvctl's venv does not
need torch; another venv's Python may hold it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

GC_TARGET = 1.3
TAB_TARGET = 3.0


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall ms, CPU ms) of one run of `cmd`, its output thrown away; a failing command ends the benchmark."""
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        t = time.perf_counter()
        pid = os.posix_spawn(cmd[0], cmd, env, file_actions=[(os.POSIX_SPAWN_DUP2, devnull, 0),
                                                             (os.POSIX_SPAWN_DUP2, devnull, 1),
                                                             (os.POSIX_SPAWN_DUP2, devnull, 2)])
        _, status, usage = os.wait4(pid, 0)
        wall = (time.perf_counter() - t) * 1000
    finally:
        os.close(devnull)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {os.waitstatus_to_exitcode(status)}")
    return wall, (usage.ru_utime + usage.ru_stime) * 1000


def summary(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"median_ms": round(statistics.median(s), 1), "min_ms": round(s[0], 1),
            "p90_ms": round(s[int(0.9 * (len(s) - 1))], 1), "max_ms": round(s[-1], 1), "runs": len(s)}


def paired(a: list[float], b: list[float]) -> float:
    """The median of the ratios of runs taken side by side."""
    return round(statistics.median(x / y for x, y in zip(a, b)), 3)


def measure(runs: int, commands: dict[str, tuple[list[str], dict[str, str]]]) -> dict[str, dict[str, list[float]]]:
    """Each command once to warm caches, then `runs` rounds of all of them in turn."""
    for cmd, env in commands.values():
        timed(cmd, env)
    out: dict[str, dict[str, list[float]]] = {k: {"wall": [], "cpu": []} for k in commands}
    for _ in range(runs):
        for name, (cmd, env) in commands.items():
            wall, cpu = timed(cmd, env)
            out[name]["wall"].append(wall)
            out[name]["cpu"].append(cpu)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=21)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--torch-python", help="also time `PY -c 'import torch'` (the yardstick of issue 11)")
    args = ap.parse_args()
    bindir = os.path.dirname(sys.executable)
    env = {k: v for k, v in os.environ.items() if k not in ("KVCTL_ROOT", "PYTHONPROFILEIMPORTTIME",
                                                            "PYTHONDONTWRITEBYTECODE", "_KVCTL_COMPLETE")}
    with tempfile.TemporaryDirectory(prefix="kvbench") as root, tempfile.TemporaryDirectory(prefix="kvpyc") as pyc:
        # Bytecode cached (in a private prefix, so the checkout stays clean), as after `pip install`:
        # with PYTHONDONTWRITEBYTECODE every run would recompile every module of the checkout.
        env["PYTHONPYCACHEPREFIX"] = pyc
        for sub in ("tmp", "dev/shm"):
            os.makedirs(os.path.join(root, sub))
        tab = {**env, "_KVCTL_COMPLETE": "complete_bash", "COMP_WORDS": "kvctl g", "COMP_CWORD": "1"}
        commands = {
            "gc": ([os.path.join(bindir, "kvctl"), "--root", root, "gc", "--dry-run"], env),
            "typer": ([sys.executable, "-c", "import typer"], env),
            "tab": ([os.path.join(bindir, "kvctl")], tab),
            "python": ([sys.executable, "-c", "pass"], env),
        }
        if args.torch_python:
            commands["torch"] = ([args.torch_python, "-c", "import torch"], env)
        got = measure(args.runs, commands)
    result: dict[str, object] = {
        name: {"wall": summary(m["wall"]), "cpu": summary(m["cpu"])} for name, m in got.items()}
    ratios = {
        "gc_vs_import_typer": {kind: paired(got["gc"][kind], got["typer"][kind]) for kind in ("wall", "cpu")},
        "tab_vs_python": {kind: paired(got["tab"][kind], got["python"][kind]) for kind in ("wall", "cpu")},
    }
    if args.torch_python:
        ratios["gc_vs_import_torch"] = {kind: paired(got["gc"][kind], got["torch"][kind]) for kind in ("wall", "cpu")}
    result.update(ratios=ratios, targets={"gc_vs_import_typer": GC_TARGET, "tab_vs_python": TAB_TARGET},
                  bytecode_cached=True, cpus=os.cpu_count(), load_avg=os.getloadavg())
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    _print(result, got)
    return 0


def _print(result: dict[str, object], got: dict[str, dict[str, list[float]]]) -> None:
    labels = {"gc": "kvctl gc --dry-run (empty root)", "typer": "python -c 'import typer'",
              "tab": "kvctl g<TAB> (complete_bash)", "python": "python -c pass", "torch": "python -c 'import torch'"}
    for name in got:
        w, c = (result[name][k] for k in ("wall", "cpu"))  # type: ignore[index]
        print(f"{labels[name]:34} wall median {w['median_ms']:7.1f} ms (min {w['min_ms']}, p90 {w['p90_ms']})  "
              f"cpu median {c['median_ms']:7.1f} ms  ({w['runs']} runs)")
    ratios = result["ratios"]
    assert isinstance(ratios, dict)
    for key, target, what in (("gc_vs_import_typer", GC_TARGET, "kvctl gc --dry-run / import typer"),
                              ("tab_vs_python", TAB_TARGET, "one TAB completion / python -c pass")):
        r = ratios[key]
        verdict = "; ".join(f"{kind} {r[kind]:.2f}x: {'met' if r[kind] <= target else 'NOT met'}"
                            for kind in ("wall", "cpu"))
        print(f"ratio {what} (median of paired runs, target <= {target}): {verdict}")
    if "gc_vs_import_torch" in ratios:
        r = ratios["gc_vs_import_torch"]
        print(f"ratio kvctl gc --dry-run / import torch: wall {r['wall']:.3f}x, cpu {r['cpu']:.3f}x")
    load = result["load_avg"]
    assert isinstance(load, tuple)
    print(f"machine: {result['cpus']} CPUs, load average {' '.join(f'{x:.2f}' for x in load)}")


if __name__ == "__main__":
    sys.exit(main())
