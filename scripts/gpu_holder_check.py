"""gpu-check's GPU-holder case (issue 28): an orphaned engine holding real GPU memory, found and freed by kvctl.

1. A parent starts a child titled `VLLM::EngineCore` (argv[0] and comm, as vLLM
   sets them) that allocates several GiB with torch on GPU 0; the parent is
   SIGKILLed, so the child is reparented with its memory held.
2. `kvctl inspect --json` must report the child in `gpu_holders` as an orphan,
   holding at least the allocation by NVML's figure.
3. `kvctl gc --engines --kill-orphans --yes --json` must end it (SIGTERM, then
   SIGKILL after the grace) and report it reaped with its GPU memory back.
4. NVML must list the process no more, and the GPU's used memory be back to
   within a margin of what it was before the allocation.

Prints one line per check ("PASS name", "FAIL name: why", "SKIP name: why")
and exits 1 on any failure. Usage: python scripts/gpu_holder_check.py [GiB]
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

GiB = 1 << 30
MARGIN = 512 << 20  # NVML's used figure moves by the driver's own bookkeeping, not by our processes

CHILD = r"""
import ctypes, os, signal, sys, time
ctypes.CDLL(None).prctl(15, b"VLLM::EngineCor", 0, 0, 0)
import torch
x = torch.empty(int(sys.argv[1]) * (1 << 30), dtype=torch.uint8, device="cuda:0")
x.fill_(1)
torch.cuda.synchronize()
with open(sys.argv[2], "w") as f:
    f.write(str(os.getpid()))
while True:
    signal.pause()
"""

# argv[0] as vLLM's setproctitle leaves it; under that name the interpreter cannot find its venv from argv[0],
# so its site-packages (torch) are handed down on PYTHONPATH.
PARENT = r"""
import os, site, subprocess, sys
env = dict(os.environ, PYTHONPATH=os.pathsep.join(site.getsitepackages()))
child = subprocess.Popen(["VLLM::EngineCore", "-c", sys.argv[1], sys.argv[2], sys.argv[3]], executable=sys.executable,
                         env=env)
sys.exit(child.wait() or 3)  # only when the child failed: the check SIGKILLs this parent first
"""


def say(status: str, name: str, why: str = "") -> None:
    print(f"{status} {name}" + (f": {why}" if why else ""), flush=True)


def nvml_used() -> tuple[int | None, set[int]]:
    """GPU 0's used bytes and its compute processes, from NVML (None, set() without nvidia-ml-py or NVML)."""
    try:
        import pynvml
    except ImportError:
        return None, set()
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None, set()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        return int(pynvml.nvmlDeviceGetMemoryInfo(h).used), {
            int(p.pid) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)}
    finally:
        pynvml.nvmlShutdown()


def kvctl(root: str, *args: str) -> dict:
    kv = os.path.join(os.path.dirname(sys.executable), "kvctl")
    cmd = [kv] if os.path.exists(kv) else [sys.executable, "-m", "kvctl.cli"]
    r = subprocess.run([*cmd, "--root", root, *args], capture_output=True, text=True, timeout=120)
    return json.loads(r.stdout)


def main() -> int:
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    root = tempfile.mkdtemp(prefix="gpu-holder-check-")
    os.makedirs(os.path.join(root, "tmp"))
    os.makedirs(os.path.join(root, "dev", "shm"))
    ready = os.path.join(root, "ready")
    used0, _ = nvml_used()
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(size), ready], start_new_session=True)
    failed = False
    pid = None
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(ready) and time.monotonic() < deadline and parent.poll() is None:
            time.sleep(0.2)
        if not os.path.exists(ready):
            say("FAIL", "gpu-holder-orphan", "the child did not allocate its memory within 120 s "
                f"(its parent: {'exit ' + str(parent.returncode) if parent.poll() is not None else 'alive'})")
            return 1
        time.sleep(0.2)
        pid = int(open(ready).read())
        parent.kill()
        parent.wait()
        doc = kvctl(root, "inspect", "--json")
        mine = [h for h in doc.get("gpu_holders", []) if h["pid"] == pid]
        if not mine or mine[0]["state"] != "orphan":
            failed = True
            say("FAIL", "gpu-holder-orphan", f"inspect says {mine[0]['state'] if mine else 'nothing'} for PID {pid}")
        elif used0 is None:
            say("PASS", "gpu-holder-orphan", f"PID {pid} ({mine[0]['title']}); NVML absent: "
                f"{doc.get('gpu_memory_note')}")
        elif (mine[0]["gpu_memory_bytes"] or 0) < size * GiB:
            failed = True
            say("FAIL", "gpu-holder-orphan", f"NVML's figure {mine[0]['gpu_memory_bytes']} < {size} GiB "
                f"({doc.get('gpu_memory_note')})")
        else:
            say("PASS", "gpu-holder-orphan", f"PID {pid} ({mine[0]['title']}) holds "
                f"{mine[0]['gpu_memory_bytes'] / GiB:.1f} GiB by NVML, {mine[0]['reason']}")
        gc = kvctl(root, "gc", "--engines", "--kill-orphans", "--yes", "--json")
        done = [k for k in gc.get("killed", []) if k["pid"] == pid]
        if not done or done[0]["outcome"] not in ("terminated", "killed"):
            failed = True
            say("FAIL", "gpu-holder-freed", f"gc says {done[0] if done else 'nothing'} for PID {pid}")
        else:
            say("PASS", "gpu-holder-freed", f"{done[0]['outcome']}: {done[0]['detail']}")
        used1, procs = nvml_used()
        if used0 is None or used1 is None:
            say("SKIP", "gpu-holder-memory-back", "NVML not reachable (nvidia-ml-py or libnvidia-ml.so.1 missing)")
        elif pid in procs or used1 > used0 + MARGIN:
            failed = True
            say("FAIL", "gpu-holder-memory-back", f"NVML: used {used1} after, {used0} before; listed: {pid in procs}")
        else:
            say("PASS", "gpu-holder-memory-back", f"used {used1 / GiB:.2f} GiB after, {used0 / GiB:.2f} GiB before")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(root, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
