"""A stand-in engine process for the GPU-holder tests: a title, held device nodes, children; then it waits.

Started as `argv[0]=TITLE python gpu_standin.py SPEC` (what `exec -a` and
setproctitle leave in /proc/<pid>/cmdline), it sets its 15-byte comm with
prctl(PR_SET_NAME) as vLLM's and SGLang's processes do, opens each node in
`hold` with O_PATH (no driver needed: the kernel resolves the node without
calling into one), starts `children`
the same way, writes its PID to `<ready>/<name>` once all of that is done,
and sleeps until a signal ends it.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys  # noqa: F401 - argv

PR_SET_NAME = 15


def main() -> None:
    spec = json.loads(sys.argv[1])
    if spec.get("comm"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_NAME, spec["comm"].encode()[:15], 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NAME)")
    held = [os.open(p, os.O_PATH | os.O_CLOEXEC) for p in spec.get("hold", ())]
    for child in spec.get("children", ()):
        # sys.executable is empty under a title argv[0]: the test hands the interpreter's path down.
        subprocess.Popen([child["title"], __file__, json.dumps(child)], executable=spec["python"], close_fds=True)
    tmp = os.path.join(spec["ready"], f".{spec['name']}.tmp")
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.rename(tmp, os.path.join(spec["ready"], spec["name"]))
    while True:
        signal.pause()
    del held


if __name__ == "__main__":
    main()
