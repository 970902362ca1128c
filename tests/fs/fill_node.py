"""A node whose places fill up: real small tmpfs mounts, a live process mapping a buffer (tests/fs/test_place_fill.py).

Run as `unshare --mount --propagation private python fill_node.py BASE KVCTL`: every mount is made in that
private namespace and goes with it. Prints one JSON object with what kvctl said, in order:

- the host's /dev/shm under --root is a 64 MiB tmpfs (Docker's and containerd's default size), 61 MiB of it a
  dead vLLM buffer: over the failure threshold;
- pod vllm-0 (namespace serving) has an 8 MiB memory-backed emptyDir at the kubelet's path holding a 3 MiB
  buffer a live process maps, a dead 3.5 MiB one and a 512 KiB file no family names: over the warning one;
- `inspect -A`, `top -A` and `watch -A` (one snapshot each), `top` without -A, `doctor capacity -A` and
  `gc -A --engines --yes --prometheus` see that; then the pod's volume
  is unmounted, its serve ended (the pod is gone) and one more gc writes the metrics again.

Every planted file is backdated an hour and kvctl keeps the default grace age, so files of another test's
namespaces are young to it and never removed.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time

MIB = 1 << 20
POD_UID = "7f3c0000-1111-4222-8333-444455556666"


def _plant(path: str, size: int) -> str:
    with open(path, "wb") as f:
        f.write(secrets.token_bytes(size))  # written, so tmpfs allocates it: used_bytes counts allocated pages
    old = time.time() - 3600
    os.utime(path, (old, old))
    return path


def _kvctl(kvctl: str, base: str, *args: str) -> tuple[int, dict]:
    env = {**os.environ, "KVCTL_LOCK": f"{base}/gc.lock", "NO_COLOR": "1"}
    r = subprocess.run([kvctl, "--root", f"{base}/root", *args], capture_output=True, text=True, env=env, timeout=120)
    return r.returncode, json.loads(r.stdout) if r.stdout.startswith("{") else {"text": r.stdout, "err": r.stderr}


def main(base: str, kvctl: str) -> dict:
    shm = f"{base}/root/dev/shm"
    os.makedirs(shm)
    os.makedirs(f"{base}/root/tmp")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=1777", "kvctest", shm], check=True)
    kubelet = f"{base}/kubelet"
    pod = f"{kubelet}/pods/{POD_UID}"
    vol = f"{pod}/volumes/kubernetes.io~empty-dir/dshm"
    os.makedirs(vol)
    os.makedirs(f"{pod}/volumes/kubernetes.io~projected/kube-api-access")
    with open(f"{pod}/etc-hosts", "w") as f:
        f.write("127.0.0.1 localhost\n10.0.3.9 vllm-0\n")
    with open(f"{pod}/volumes/kubernetes.io~projected/kube-api-access/namespace", "w") as f:
        f.write("serving")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=1777", "kvctest", vol], check=True)
    dead_host = _plant(f"{shm}/psm_{secrets.token_hex(4)}", 61 * MIB)
    live = _plant(f"{vol}/psm_{secrets.token_hex(4)}", 3 * MIB)
    dead_pod = _plant(f"{vol}/psm_{secrets.token_hex(4)}", 7 * MIB // 2)
    _plant(f"{vol}/notours.bin", MIB // 2)
    # The live serve: maps its buffer and closes the descriptor, as multiprocessing.shared_memory's users do.
    holder = subprocess.Popen([sys.executable, "-c", "import mmap, sys\n"
                               "f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 0); f.close()\n"
                               "print('ready', flush=True); sys.stdin.read()", live],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    out: dict = {"root": f"{base}/root", "dead_host": dead_host, "live": live, "dead_pod": dead_pod,
                 "holder": holder.pid, "vol": vol}
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        a = ("-A", "--kubelet-dir", kubelet)
        out["inspect"] = _kvctl(kvctl, base, "inspect", *a, "--json")[1]
        out["inspect_text"] = _kvctl(kvctl, base, "inspect", *a)[1]["text"]
        out["top"] = _kvctl(kvctl, base, "top", *a, "--count", "1")[1]["text"]
        out["watch"] = _kvctl(kvctl, base, "watch", *a, "--count", "1")[1]["text"]
        out["top_host"] = _kvctl(kvctl, base, "top", "--count", "1")[1]["text"]
        out["doctor_rc"], out["doctor"] = _kvctl(kvctl, base, "doctor", "capacity", *a, "--json")
        prom = f"{base}/m.prom"
        out["gc_rc"], out["gc"] = _kvctl(kvctl, base, "gc", *a, "--engines", "--yes", "--json", "--prometheus", prom)
        with open(prom) as f:
            out["prom"] = f.read()
        _stop(holder)
        subprocess.run(["umount", vol], check=True)
        _kvctl(kvctl, base, "gc", *a, "--engines", "--yes", "--json", "--prometheus", prom)
        with open(prom) as f:
            out["prom_after"] = f.read()
    finally:
        _stop(holder)
    return out


def _stop(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        assert p.stdin is not None
        p.stdin.close()
        p.wait(timeout=30)


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
