"""A node with pods, built from real mount and PID namespaces and real tmpfs mounts (tests/fs/test_places.py).

Run as `unshare --mount --propagation private python places_node.py BASE KVCTL SCENARIO`: every mount is
made in that private namespace (the machine's own mount table never changes, and the mounts go with the
namespace), every "container" is `unshare --mount --pid --fork` below it. Prints one JSON object.

Scenario "node": one kvctl gc -A run over
- pod A: an emptyDir tmpfs at the kubelet's path, mounted at /dev/shm in container 1 (dead: its SGLang, Python
  and NCCL files stay) and container 2 (alive, PID 1 in a new PID namespace as container 1 was: it makes, maps
  and holds its own); also a symbolic link and a bind mount pointing at the host's files;
- pod B: an emptyDir with no process left (its volume alone);
- container C: a tmpfs of its own at /dev/shm, two processes sharing it, a dead buffer and a held one;
- container D: tmpfs /tmp and /dev/shm with kvcached's own state, one deployment live, one dead;
- sandbox S: a containerd sandbox shm mount with a dead buffer;
- service E: a PrivateTmp=-like /tmp (a directory of the host's /tmp filesystem) with a dead and a live vLLM
  ZMQ socket.
Scenario "pgid": plan only (nothing is acted on), two pod volumes each with an upstream-like segment named by
its creator's process group as its own PID namespace numbers it (kvcached_proc_1): one container dead, one alive.
Scenario "replace": plan pod A's dead files, replace its filesystem by another tmpfs with the same names,
act: nothing is removed.
Scenario "events": `kvctl gc -A --engines --yes --every 10m --json` running, as the DaemonSet runs it; pod A's
only container makes fresh files and is SIGKILLed (its files must go before the next round), pod B's container
lives and makes, closes and opens again a file of its own, the host has a fresh dead file (its rules stay a
round's); then a Reactor asked to stop mid-judgement finishes one place of two.
Scenario "restart": pod A's dead container's fresh files planned without a grace age (no process sees the
volume; with the grace age given, they are young), a new container started on the volume before the act:
nothing is removed; once it is gone, a judgement removes them.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time
import uuid

OLD = 3600.0  # how far back every planted file is dated: past any grace, so only evidence keeps it

CONTAINER = textwrap.dedent("""
    import json, mmap, os, secrets, subprocess, sys, time
    vol, role = sys.argv[1], sys.argv[2]
    if vol == "tmpfs":
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777", "kvctest", "/dev/shm"], check=True)
    else:
        subprocess.run(["mount", "--bind", vol, "/dev/shm"], check=True)
    pid = os.getpid()
    def make(name):
        path = "/dev/shm/" + name
        with open(path, "wb") as f:
            f.write(b"x" * 65536)
        old = time.time() - 3600
        os.utime(path, (old, old))
        return name
    alnum = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    names = [make(f"sgl_shm_mm_{pid}_{secrets.token_hex(4)}"), make(f"psm_{secrets.token_hex(4)}"),
             make("nccl-" + "".join(secrets.choice(alnum) for _ in range(6)))]
    keep = []
    if role == "live":
        f = open("/dev/shm/" + names[1], "r+b")
        keep.append(mmap.mmap(f.fileno(), 65536))  # mapped, then closed: only the map shows it
        f.close()
        keep.append(os.open("/dev/shm/" + names[2], os.O_RDWR))  # held open, never mapped
    if role == "pair":
        # A second process of the same container: one place, however many processes see it.
        child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        keep.append(os.open("/dev/shm/" + names[2], os.O_RDWR))
    print(json.dumps({"pid": pid, "names": names}), flush=True)
    if role == "die":
        sys.exit(0)
    sys.stdin.read()
""")

KVCACHED_CONTAINER = textwrap.dedent("""
    import json, os, subprocess, sys, time
    from kvcached.node.base.layout import Layout
    from kvcached.node.state.segment import create_segment
    from kvcached.runtime.ipc.listener import WorkerListener
    import kvcached.runtime.ipc.protocol  # noqa: F401 (imported before /tmp is covered)
    live, dead = sys.argv[1], sys.argv[2]
    for d in ("/tmp", "/dev/shm"):
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777", "kvctest", d], check=True)
    layout = Layout()
    create_segment(layout.segment_path(live), 1 << 30)
    listener = WorkerListener(layout, live, 0)
    listener.start()
    create_segment(layout.segment_path(dead), 1 << 30)
    os.makedirs(layout.socket_dir(dead))
    old = time.time() - 3600
    for p in (layout.segment_path(dead), layout.socket_dir(dead), layout.segment_path(live)):
        os.utime(p, (old, old))
    print(json.dumps({"pid": os.getpid(), "live": live, "dead": dead}), flush=True)
    sys.stdin.read()
""")


PRIVATE_TMP = textwrap.dedent("""
    import json, os, socket, subprocess, sys, time, uuid
    # A PrivateTmp= service: its /tmp a directory of the host's own /tmp filesystem, in its own mount namespace.
    subprocess.run(["mount", "--bind", sys.argv[1], "/tmp"], check=True)
    dead, live = f"/tmp/{uuid.uuid4()}", f"/tmp/{uuid.uuid4()}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(dead)
    s.close()  # the node stays; nothing is bound to it any more
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(live)
    srv.listen(4)
    old = time.time() - 3600
    for p in (dead, live):
        os.utime(p, (old, old))
    print(json.dumps({"pid": os.getpid(), "dead": os.path.basename(dead), "live": os.path.basename(live)}),
          flush=True)
    sys.stdin.read()
""")


def _container(code: str, *args: str, env: dict[str, str] | None = None,
               pid_ns: bool = True) -> tuple[subprocess.Popen[str], dict]:
    ns = ["--mount", "--pid", "--fork"] if pid_ns else ["--mount"]
    p = subprocess.Popen(["unshare", *ns, "--propagation", "private", sys.executable, "-c", code, *args],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    assert p.stdout is not None
    line = p.stdout.readline()
    if not line:
        p.wait()
        raise SystemExit(f"container did not start ({p.returncode})")
    return p, json.loads(line)


def _host_pid(ns_pid_proc: subprocess.Popen[str]) -> int:
    """The container's PID 1 as the host sees it: `unshare --fork`'s only child."""
    with open(f"/proc/{ns_pid_proc.pid}/task/{ns_pid_proc.pid}/children") as f:
        return int(f.read().split()[0])


def _volume(kubelet: str, uid: str, name: str, pod: str) -> str:
    vol = f"{kubelet}/pods/{uid}/volumes/kubernetes.io~empty-dir/{name}"
    os.makedirs(vol)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777", "kvctest", vol], check=True)
    with open(f"{kubelet}/pods/{uid}/etc-hosts", "w") as f:
        f.write(f"# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n10.1.2.3\t{pod}\n")
    return vol


def _plant(directory: str, name: str) -> str:
    path = os.path.join(directory, name)
    with open(path, "wb") as f:
        f.write(b"y" * 4096)
    old = time.time() - OLD
    os.utime(path, (old, old))
    return name


def _kvctl(kvctl: str, base: str, *args: str, json_out: bool = True) -> dict:
    r = subprocess.run([kvctl, "--root", f"{base}/root", *args, "--kubelet-dir", f"{base}/kubelet",
                        *(["--json"] if json_out else [])], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "KVCTL_SANDBOX_ROOT": f"{base}/sandroot", "NO_COLOR": "1"})
    if r.returncode not in (0, 3):  # clean, or stale entries left (a dry run)
        raise SystemExit(f"kvctl {' '.join(args)}: exit {r.returncode}: {r.stderr}")
    return {"code": r.returncode, "doc": json.loads(r.stdout) if json_out else r.stdout, "stderr": r.stderr}


def node(base: str, kvctl: str) -> dict:
    """Scenario "node" (the module docstring)."""
    kubelet = f"{base}/kubelet"
    for d in ("root/tmp", "root/dev/shm", "outside"):
        os.makedirs(f"{base}/{d}")
    out: dict = {"uid_a": str(uuid.uuid4()), "uid_b": str(uuid.uuid4())}
    vol_a = _volume(kubelet, out["uid_a"], "dshm", "sglang-0")
    vol_b = _volume(kubelet, out["uid_b"], "cache", "sglang-1")
    procs: list[subprocess.Popen[str]] = []
    try:
        c1, out["c1"] = _container(CONTAINER, vol_a, "die")
        c1.wait()
        # Container 2's PID 1 must start after container 1's files last changed, beyond the start-time slack.
        time.sleep(2.5)
        c2, out["c2"] = _container(CONTAINER, vol_a, "live")
        procs.append(c2)
        out["c2"]["host_pid"] = _host_pid(c2)
        # A symbolic link and a bind mount in the pod's volume, both at engine names, both at the host's files.
        host_files = [_plant(f"{base}/outside", n) for n in ("victim-link", "victim-bind")]
        link = f"psm_{secrets.token_hex(4)}"
        os.symlink(f"{base}/outside/victim-link", f"{vol_a}/{link}")
        bind = _plant(vol_a, "nccl-BiNdMt")
        subprocess.run(["mount", "--bind", f"{base}/outside/victim-bind", f"{vol_a}/{bind}"], check=True)
        out["planted"] = {"link": link, "bind": bind, "host_files": host_files}
        out["b_files"] = [_plant(vol_b, f"sgl_shm_mm_7_{secrets.token_hex(4)}"), _plant(vol_b, "nccl-dEaD00")]
        c3, out["c3"] = _container(CONTAINER, "tmpfs", "pair")
        procs.append(c3)
        out["c3"]["host_pid"] = _host_pid(c3)
        c4, out["c4"] = _container(KVCACHED_CONTAINER, f"live{os.getpid()}", f"dead{os.getpid()}",
                                   env={"KVCACHED_IPC_NAME": f"live{os.getpid()}"})
        procs.append(c4)
        out["c4"]["host_pid"] = _host_pid(c4)
        os.makedirs(f"{base}/privtmp", mode=0o1777)
        c5, out["c5"] = _container(PRIVATE_TMP, f"{base}/privtmp", pid_ns=False)
        procs.append(c5)
        sandbox = f"{base}/sandroot/run/containerd/io.containerd.grpc.v1.cri/sandboxes/{secrets.token_hex(32)}/shm"
        os.makedirs(sandbox)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777", "kvctest", sandbox], check=True)
        out["sandbox"] = {"path": sandbox, "files": [_plant(sandbox, f"psm_{secrets.token_hex(4)}")]}
        out["inspect"] = _kvctl(kvctl, base, "inspect", "-A")
        out["doctor"] = _kvctl(kvctl, base, "doctor", "-A", "pods")
        out["inspect_text"] = _kvctl(kvctl, base, "inspect", "-A", json_out=False)
        out["dry"] = _kvctl(kvctl, base, "gc", "-A", "--engines", "--dry-run", "--prometheus", f"{base}/gc.prom")
        with open(f"{base}/gc.prom") as f:
            out["metrics"] = f.read()
        out["dry_text"] = _kvctl(kvctl, base, "gc", "-A", "--engines", "--dry-run", json_out=False)
        out["gc"] = _kvctl(kvctl, base, "gc", "-A", "--engines", "--yes")
        out["named"] = _kvctl(kvctl, base, "gc", "-A", "--dry-run", out["c4"]["live"])
        out["nomatch"] = subprocess.run([kvctl, "--root", f"{base}/root", "gc", "-A", "--dry-run", "nosuchname",
                                         "--kubelet-dir", kubelet], capture_output=True, text=True).returncode
        out["left"] = {"a": sorted(os.listdir(vol_a)), "b": sorted(os.listdir(vol_b)),
                       "c3": sorted(os.listdir(f"/proc/{out['c3']['host_pid']}/root/dev/shm")),
                       "c4_shm": sorted(os.listdir(f"/proc/{out['c4']['host_pid']}/root/dev/shm")),
                       "c4_tmp": sorted(os.listdir(f"/proc/{out['c4']['host_pid']}/root/tmp")),
                       "sandbox": sorted(os.listdir(sandbox)), "privtmp": sorted(os.listdir(f"{base}/privtmp")),
                       "outside": sorted(os.listdir(f"{base}/outside"))}
        subprocess.run(["umount", f"{vol_a}/{bind}"], check=True)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return out


FRESH = textwrap.dedent("""
    import json, os, secrets, subprocess, sys
    vol = sys.argv[1]
    subprocess.run(["mount", "--bind", vol, "/dev/shm"], check=True)
    pid = os.getpid()
    names = []
    for name in (f"sgl_shm_mm_{pid}_{secrets.token_hex(4)}", f"psm_{secrets.token_hex(4)}"):
        with open("/dev/shm/" + name, "wb") as f:  # made and closed: nothing holds or maps it
            f.write(b"z" * 65536)
        names.append(name)
    print(json.dumps({"pid": pid, "names": names}), flush=True)
    for line in sys.stdin:  # each line: open every file again by name, as a reader started later would
        for name in names:
            with open("/dev/shm/" + name, "rb") as f:
                f.read(1)
        print("reopened", flush=True)
""")


def _loop(kvctl: str, base: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([kvctl, "--root", f"{base}/root", "gc", "-A", "--engines", "--yes", "--every", "10m",
                             "--json", "--kubelet-dir", f"{base}/kubelet", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "KVCTL_SANDBOX_ROOT": f"{base}/sandroot", "NO_COLOR": "1"})


def events(base: str, kvctl: str) -> dict:
    """Scenario "events" (the module docstring)."""
    from kvcached.node import GcOptions, Layout
    from kvcached.node.clean.facts import gather_facts
    from kvcached.node.ops.events import key_of
    from kvcached.node.ops.react import Reactor
    from kvcached.node.places.discover import discover

    kubelet = f"{base}/kubelet"
    for d in ("root/tmp", "root/dev/shm"):
        os.makedirs(f"{base}/{d}")
    vol_a = _volume(kubelet, str(uuid.uuid4()), "dshm", "crashloop-0")
    vol_b = _volume(kubelet, str(uuid.uuid4()), "dshm", "steady-0")
    host_file = f"psm_{secrets.token_hex(4)}"
    with open(f"{base}/root/dev/shm/{host_file}", "wb") as f:
        f.write(b"h" * 4096)  # fresh, and nobody's: a round keeps it young, and no event judges the host
    out: dict = {"host_file": host_file}
    a, out["a"] = _container(FRESH, vol_a)
    b, out["b"] = _container(FRESH, vol_b)
    procs = [a, b]
    loop = _loop(kvctl, base)
    try:
        assert loop.stdout is not None
        out["round"] = json.loads(loop.stdout.readline())
        killed = time.monotonic()
        os.kill(_host_pid(a), signal.SIGKILL)  # the container's PID 1: its whole PID namespace goes
        while set(out["a"]["names"]) & set(os.listdir(vol_a)):
            if time.monotonic() - killed > 60:
                break
            time.sleep(0.02)
        out["reclaim_s"] = time.monotonic() - killed
        out["event"] = json.loads(loop.stdout.readline())
        b.stdin.write("again\n")  # type: ignore[union-attr]
        b.stdin.flush()  # type: ignore[union-attr]
        out["b_reopened"] = b.stdout.readline().strip()  # type: ignore[union-attr]
        out["left"] = {"a": sorted(os.listdir(vol_a)), "b": sorted(os.listdir(vol_b)),
                       "host": sorted(os.listdir(f"{base}/root/dev/shm"))}
        loop.send_signal(signal.SIGTERM)
        out["loop_exit"] = loop.wait(60)
        out["loop_stderr"] = loop.stderr.read()  # type: ignore[union-attr]

        # Stopped mid-judgement: two dead places touched, the stop asked while the first is judged.
        vols = [_volume(kubelet, str(uuid.uuid4()), "dshm", f"stop-{i}") for i in range(2)]
        for v in vols:
            _plant(v, f"psm_{secrets.token_hex(4)}")
        asked = []
        r = Reactor(GcOptions(layout=Layout(f"{base}/root"), yes=True, all_places=True, engines=True,
                              kubelet_dir=kubelet), None, stopping=lambda: bool(asked))
        found = discover(gather_facts(), Layout(f"{base}/root"), kubelet_dir=kubelet)
        keys = {key_of(pl) for pl in found.others if pl.path in vols}
        import kvcached.node.ops.rounds as rounds

        real = rounds.judge_place

        def judge_place(*args: object, **kw: object) -> object:
            asked.append(1)  # SIGTERM arrives while this place is judged
            return real(*args, **kw)  # type: ignore[arg-type]

        rounds.judge_place = judge_place  # type: ignore[assignment]
        reaction = r.judge(keys)  # type: ignore[arg-type]
        r.close()
        out["stopped"] = {"keys": len(keys), "judged": len(reaction.places),
                          "left": [len(os.listdir(v)) for v in vols]}
    finally:
        if loop.poll() is None:
            loop.kill()
            loop.wait()
        for p in procs:
            p.kill()
            p.wait()
    return out


def restart(base: str) -> dict:
    """Scenario "restart" (the module docstring)."""
    from kvcached.node.base.layout import Layout
    from kvcached.node.clean.decide import Policy
    from kvcached.node.clean.facts import gather_facts
    from kvcached.node.ops.rounds import act
    from kvcached.node.places.run import plan_places

    os.makedirs(f"{base}/root/tmp")
    os.makedirs(f"{base}/root/dev/shm")
    vol = _volume(f"{base}/kubelet", str(uuid.uuid4()), "dshm", "restarted-0")
    c1, dead = _container(FRESH, vol)
    os.kill(_host_pid(c1), signal.SIGKILL)
    c1.wait()

    def plan(given: bool = False) -> object:
        return plan_places(Layout(f"{base}/root"), Policy(grace=60), gather_facts(), kvcached=False, engines=True,
                           kubelet_dir=f"{base}/kubelet", grace_given=given)

    given = {c.name: str(d.state) for x in plan(True).plans if x.engines  # type: ignore[attr-defined]
             for c, d in x.engines.entries()}
    pp = plan()
    judged = {c.name: str(d.state) for x in pp.plans if x.engines for c, d in x.engines.entries()}  # type: ignore
    c2, live = _container(FRESH, vol)  # the kubelet restarts the container between the judgement and the act
    try:
        results = [act(x, dry_run=False) for x in pp.plans]  # type: ignore[attr-defined]
        acted = {e.candidate.name: [str(e.action), e.decision.detail] for r in results if r.report
                 for e in r.report.entries}
        left = sorted(os.listdir(vol))
    finally:
        os.kill(_host_pid(c2), signal.SIGKILL)
        c2.wait()
    again = [act(x, dry_run=False) for x in plan().plans]  # type: ignore[attr-defined]
    removed = sorted(e.candidate.name for r in again if r.report for e in r.report.entries
                     if str(e.action) == "removed")
    return {"dead": dead, "live": live, "judged": judged, "given": given, "acted": acted, "left": left,
            "removed": removed}


UPSTREAM_SEGMENT = textwrap.dedent("""
    import fcntl, os, struct, subprocess, sys, time
    vol, role = sys.argv[1], sys.argv[2]
    subprocess.run(["mount", "--bind", vol, "/dev/shm"], check=True)
    os.setpgid(0, 0)  # its own group: PGID 1 in its PID namespace, as an engine that leads its group
    name = f"kvcached_proc_{os.getpgid(0)}"
    fd = os.open("/dev/shm/" + name, os.O_RDWR | os.O_CREAT, 0o644)  # upstream's way: open, flock, write, close
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.pwrite(fd, struct.pack("=qqq", 1 << 30, 0, 0), 0)
    os.close(fd)
    print(json.dumps({"pid": os.getpid(), "name": name}), flush=True)
    if role == "live":
        sys.stdin.read()
""").replace("import fcntl,", "import json, fcntl,")


def pgid(base: str) -> dict:
    """Scenario "pgid" (the module docstring): the decisions only."""
    from kvcached.node.base.layout import Layout
    from kvcached.node.clean.decide import Policy
    from kvcached.node.clean.facts import gather_facts
    from kvcached.node.places.run import plan_places

    os.makedirs(f"{base}/root/tmp")
    os.makedirs(f"{base}/root/dev/shm")
    dead_vol = _volume(f"{base}/kubelet", str(uuid.uuid4()), "dshm", "upstream-dead")
    live_vol = _volume(f"{base}/kubelet", str(uuid.uuid4()), "dshm", "upstream-live")
    c1, dead = _container(UPSTREAM_SEGMENT, dead_vol, "die")
    c1.wait()
    c2, live = _container(UPSTREAM_SEGMENT, live_vol, "live")
    try:
        live["host_pid"] = _host_pid(c2)
        time.sleep(1.5)  # past the start-time slack: the live group started before its segment last changed
        pp = plan_places(Layout(f"{base}/root"), Policy(grace=0.0), gather_facts(), kubelet_dir=f"{base}/kubelet")
        decided = {}
        for plan in pp.plans:
            if plan.plan is not None and plan.place.path in (dead_vol, live_vol):
                for c, d in plan.plan.entries():
                    decided[plan.place.path] = [c.name, str(d.state), str(d.reason), list(d.pids)]
    finally:
        c2.kill()
        c2.wait()
    return {"dead": dead, "live": live, "decided": {"dead": decided.get(dead_vol), "live": decided.get(live_vol)}}


def replace(base: str) -> dict:
    """Scenario "replace": judged on one filesystem, acted on after another took its place: nothing removed."""
    from kvcached.node.base.layout import Layout
    from kvcached.node.clean.decide import Policy
    from kvcached.node.clean.facts import gather_facts
    from kvcached.node.ops.rounds import act
    from kvcached.node.places.run import plan_places

    os.makedirs(f"{base}/root/tmp")
    os.makedirs(f"{base}/root/dev/shm")
    vol = _volume(f"{base}/kubelet", str(uuid.uuid4()), "dshm", "sglang-2")
    names = [_plant(vol, f"sgl_shm_mm_9_{secrets.token_hex(4)}"), _plant(vol, "nccl-RePlAc")]
    facts = gather_facts()
    pp = plan_places(Layout(f"{base}/root"), Policy(grace=60), facts, kvcached=False, engines=True,
                     kubelet_dir=f"{base}/kubelet")
    judged = {c.name: str(d.state) for plan in pp.plans if plan.engines for c, d in plan.engines.entries()}
    subprocess.run(["umount", vol], check=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777", "kvctest", vol], check=True)
    for n in names:
        _plant(vol, n)
    results = [act(plan, dry_run=False) for plan in pp.plans]
    actions = {e.candidate.name: [str(e.action), e.note] for r in results if r.report for e in r.report.entries}
    # Every entry outside the host carries its place in its origin.
    tagged = all(e.origin.place == r.place for r in results if r.report for e in r.report.entries)
    return {"judged": judged, "actions": actions, "left": sorted(os.listdir(vol)), "names": names,
            "tagged": tagged}


if __name__ == "__main__":
    base_dir, kvctl_path, scenario = sys.argv[1], sys.argv[2], sys.argv[3]
    scenarios = {"node": lambda: node(base_dir, kvctl_path), "pgid": lambda: pgid(base_dir),
                 "replace": lambda: replace(base_dir), "events": lambda: events(base_dir, kvctl_path),
                 "restart": lambda: restart(base_dir)}
    result = scenarios[scenario]()
    print(json.dumps(result))
