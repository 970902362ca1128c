#!/usr/bin/env python3
"""Cold start of `kvctl gc --dry-run` on an empty root, against `python -c "import torch"` in the same run.

Completion scripts and cron re-run kvctl all the time; DESIGN.md §2 keeps its
start-up light. Target: median < 100 ms (issue 11), and at most a tenth of importing torch.
Runs are interleaved (kvctl, torch, python, typer, kvctl, ...) so that machine load hits all alike.

Two floors are measured in the same run, so the reader sees what is kvctl's own:
the interpreter (`python -c pass`, site and the venv's .pth files included) and the
CLI framework (`python -c "import typer"`). kvctl's share is its median minus typer's.

    python bench/bench_cli_start.py [--runs 21] [--json] [--torch-python PY]

`--torch-python` names the interpreter that imports torch (default: this one);
kvctl's own venv does not need torch, so another venv's Python may hold it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

TARGET_MS = 100.0
TARGET_RATIO = 0.10


def timed(cmd: list[str], env: dict[str, str]) -> float:
    t = time.perf_counter()
    r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, stdin=subprocess.DEVNULL)
    elapsed = (time.perf_counter() - t) * 1000
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr.decode(errors='replace')[-500:]}")
    return elapsed


def summary(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    return {"median_ms": round(statistics.median(s), 1), "min_ms": round(s[0], 1), "max_ms": round(s[-1], 1),
            "p90_ms": round(s[int(0.9 * (len(s) - 1))], 1), "runs": len(s)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=21)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--torch-python", default=sys.executable, help="interpreter for `import torch`")
    args = ap.parse_args()
    kvctl = os.path.join(os.path.dirname(sys.executable), "kvctl")
    if args.torch_python == sys.executable:
        has_torch = importlib.util.find_spec("torch") is not None
    else:
        has_torch = subprocess.run([args.torch_python, "-c", "import importlib.util as u, sys; "
                                    "sys.exit(u.find_spec('torch') is None)"]).returncode == 0
    env = {k: v for k, v in os.environ.items()
           if k not in ("KVCTL_ROOT", "PYTHONPROFILEIMPORTTIME", "PYTHONDONTWRITEBYTECODE")}
    with tempfile.TemporaryDirectory(prefix="kvbench") as root, tempfile.TemporaryDirectory(prefix="kvpyc") as pyc:
        # Bytecode cached (in a private prefix, so the checkout stays clean), as after `pip install`:
        # with PYTHONDONTWRITEBYTECODE every run would recompile every module of the checkout.
        env["PYTHONPYCACHEPREFIX"] = pyc
        for sub in ("tmp", "dev/shm"):
            os.makedirs(os.path.join(root, sub))
        kv_cmd = [kvctl, "--root", root, "gc", "--dry-run"]
        torch_cmd = [args.torch_python, "-c", "import torch"]
        floor_cmds = {"python": [sys.executable, "-c", "pass"], "typer": [sys.executable, "-c", "import typer"]}
        timed(kv_cmd, env)  # warm the page cache and bytecode: we measure start-up, not the first compile
        if has_torch:
            timed(torch_cmd, env)
        kv, torch = [], []
        floors: dict[str, list[float]] = {k: [] for k in floor_cmds}
        for _ in range(args.runs):
            kv.append(timed(kv_cmd, env))
            if has_torch:
                torch.append(timed(torch_cmd, env))
            for k, cmd in floor_cmds.items():
                floors[k].append(timed(cmd, env))
    result: dict[str, object] = {"kvctl_gc_dry_run": summary(kv), "target_median_ms": TARGET_MS,
                                 "bytecode_cached": True,
                                 "floor_python": summary(floors["python"]),
                                 "floor_import_typer": summary(floors["typer"]),
                                 "kvctl_own_ms": round(statistics.median(kv) - statistics.median(floors["typer"]), 1),
                                 "meets_target": statistics.median(kv) < TARGET_MS,
                                 "cpus": os.cpu_count(), "load_avg": os.getloadavg()}
    if has_torch:
        ratio = statistics.median(kv) / statistics.median(torch)
        result.update(import_torch=summary(torch), torch_python=args.torch_python, ratio=round(ratio, 3),
                      meets_ratio=ratio <= TARGET_RATIO)
    else:
        result.update(import_torch=None, ratio=None,
                      note="torch is not installed in this interpreter: the ratio to `import torch` is skipped")
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    k = result["kvctl_gc_dry_run"]
    print(f"kvctl gc --dry-run (empty root): median {k['median_ms']} ms  min {k['min_ms']}  p90 {k['p90_ms']}  "
          f"max {k['max_ms']}  ({k['runs']} runs; target < {TARGET_MS:.0f} ms: "
          f"{'met' if result['meets_target'] else 'NOT met'})")
    py, ty = result["floor_python"], result["floor_import_typer"]
    print(f"floors: python -c pass median {py['median_ms']} ms; python -c 'import typer' median {ty['median_ms']} ms; "
          f"kvctl's own share (kvctl - typer): {result['kvctl_own_ms']} ms")
    if has_torch:
        t = result["import_torch"]
        print(
            f"{args.torch_python} -c 'import torch': median {t['median_ms']} ms  min {t['min_ms']}  p90 {t['p90_ms']}  "
            f"max {t['max_ms']}"
        )
        print(
            f"ratio kvctl / import torch: {result['ratio']} (target <= {TARGET_RATIO}: "
            f"{'met' if result['meets_ratio'] else 'NOT met'})"
        )
    else:
        print(result["note"])
    print(f"machine: {result['cpus']} CPUs, load average {' '.join(f'{x:.2f}' for x in result['load_avg'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
