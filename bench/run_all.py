"""Every benchmark, one after the other, in one run: `make bench` (or `python bench/run_all.py`).

Each script prints its figures with the ratio against the baseline it measures
side by side in the same run; nothing here asserts a time. The scripts run in
sequence, never in parallel, so that one does not load the machine under
another's measurement.

1. bench_cli_start.py  kvctl's start-up: `kvctl gc --dry-run` vs `python -c "import typer"`,
                       one TAB completion vs `python -c pass` (paired runs, one ratio each)
2. bench_gc.py         kvctl gc --dry-run --json vs a bare lstat+connect+stat loop (1,000 and
                       2,000 deployments), where gc's time goes, each safety check's cost,
                       gc --yes vs a bare removal loop, the /proc fact pass vs `ss -xap`, owner cleanup
3. bench_pages.py      extension map+unmap vs a bare mmap/munmap loop; pool alloc/free
4. bench_elastic.py    vLLM's Scheduler step over kvcached's elastic pool vs over vLLM's own
                       (bench/elastic_step.py), the pools' cost per block, and the memory
                       mapped for a bursty trace vs vLLM's full preallocation
5. bench_sglang.py     SGLang's TokenToKVPoolAllocator vs kvcached's elastic one (cost per token, against
                       the same pool and against a pool of what kvcached maps), and the memory mapped for a
                       bursty trace vs the peak in use and SGLang's full preallocation
6. bench_engines.py    plain gc against main's tree (must not be slower), and what `gc --engines`
                       adds over 1,000 psm_ files and 200 processes vs a bare maps-reading loop
7. bench_gpu_holders.py  the GPU-holder pass over 500 processes against the gc --engines run it is part
                       of (paired runs; target: adds ≤ 10 %)
8. bench_places.py     gc -A --engines' pass over 50 pod volumes x 200 files vs the host pass over the
                       same 10,000 files in one directory (root only: tmpfs mounts)
9. bench_agent.py      the DaemonSet's command on a node of 1,000 processes and 50 pod volumes: peak RSS
                       and CPU per run, the figures its requests and limits come from (root only)
10. bench_events.py    gc --every -A's event path on 1,000 processes in 50 pods: idle CPU between rounds,
                       reclaim time from a pod's last SIGKILL, a 10,000-exit burst, a round's cost vs the
                       baseline tree's (root only)
"""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = [["bench_cli_start.py"], ["bench_gc.py"], ["bench_pages.py"], ["bench_elastic.py"], ["bench_sglang.py"],
           ["bench_engines.py"], ["bench_gpu_holders.py"], ["bench_places.py"], ["bench_agent.py"],
           ["bench_events.py"]]


def main() -> int:
    failed = 0
    for script, *args in SCRIPTS:
        print(f"\n### {script}", flush=True)
        r = subprocess.run([sys.executable, os.path.join(HERE, script), *args])
        failed |= r.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
