"""What engine processes publish about kvcached (kvcached.integration.publish) and how kvctl reads it back
(kvcached.node.ops.serves), with real processes, real memfds and the real /proc (issue 38).

The processes here stand in for engine processes the way the other tests' do: titled as vLLM's and SGLang's
(comm, as setproctitle leaves it), publishing through the very function the plugins call, with a registry
double that has the two things publish reads of the real one (its engine's name, what it applied). The
engines' own serves are in tests/vllm/test_published.py and tests/sglang/test_published.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from kvcached.node.base.published import PUBLISHED_MEMFD, Published, RecordError
from kvcached.node.clean.facts import gather_facts
from kvcached.node.ops.serves import Serve, find_serves, read_record, serve_lines

from ..conftest import KVCTL
from ..waiting import wait_until

# One stand-in process: its title, then (optionally) a record, then its children (the same script, exec'd, so
# that nothing of this process's is inherited), then it waits. argv[1] is a JSON spec.
STANDIN = textwrap.dedent(r"""
    import ctypes, json, os, signal, subprocess, sys
    spec = json.loads(sys.argv[1])
    ctypes.CDLL(None).prctl(15, spec["title"].encode(), 0, 0, 0)
    if spec.get("publish"):
        from kvcached.integration.publish import publish

        class Registry:
            engine = spec["engine"]
            def applied(self):
                return tuple(spec.get("applied", ()))

        for statuses in spec.get("updates", [{}]):
            publish(Registry(), statuses)
    if spec.get("garbage"):
        fd = os.memfd_create("kvcached-published", os.MFD_CLOEXEC)
        os.write(fd, b"{not json")
    if spec.get("fork"):
        if os.fork() == 0:
            signal.pause()
            os._exit(0)
    kids = [subprocess.Popen([sys.executable, __file__, json.dumps(k)], stdout=subprocess.DEVNULL,
                             env={**os.environ, **k.get("env", {})}) for k in spec.get("children", [])]
    print(json.dumps([os.getpid(), *[k.pid for k in kids]]), flush=True)
    signal.pause()
""")


class Tree:
    """A stand-in serve: its processes (top first) and their PIDs."""

    def __init__(self, proc: subprocess.Popen[str], pids: list[int]) -> None:
        self.proc, self.pids = proc, pids

    def kill(self) -> None:
        for pid in reversed(self.pids):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        self.proc.wait(30)


@pytest.fixture
def trees(tmp_path) -> Iterator:
    script = tmp_path / "standin.py"
    script.write_text(STANDIN)
    started: list[Tree] = []

    def start(spec: dict, env: dict[str, str] | None = None) -> Tree:
        full = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHED_", "ENABLE_KVCACHED",
                                                                          "VLLM_PLUGINS", "SGLANG_PLUGINS"))}
        # A session of its own: an sglang:: process in the test's process group would make pytest its "main".
        p = subprocess.Popen([sys.executable, str(script), json.dumps(spec)], stdout=subprocess.PIPE, text=True,
                             start_new_session=True,
                             env={**full, **(env or {})})
        assert p.stdout is not None
        tree = Tree(p, json.loads(p.stdout.readline()))
        started.append(tree)
        # The children are exec'd after the top printed its line: wait until each has titled itself and published.
        specs = [spec, *spec.get("children", [])]

        def ready() -> bool:
            return all(_comm(pid).startswith(("VLLM", "sglang")) and (not s.get("publish") or read_record(pid)[0])
                       for pid, s in zip(tree.pids, specs))

        wait_until(ready, timeout=30)
        return tree

    yield start
    for t in started:
        t.kill()


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _mine(serves: list[Serve], tree: Tree) -> Serve:
    (serve,) = [s for s in serves if s.pid == tree.pids[0]]
    return serve


def test_a_process_publishes_a_sealed_record_kvctl_reads_through_proc(trees, layout) -> None:
    before = sorted(os.listdir(layout.shm_dir)) + sorted(os.listdir(layout.tmp_dir))
    t = trees({"title": "VLLM::EngineCor", "engine": "vLLM", "publish": True, "applied": ["engine-state"],
               "updates": [{"engine-state": "applied"}, {"lmcache-shutdown": "not_needed"}]},
              {"KVCACHED_ROOT": layout.root})
    pid = t.pids[0]
    record, why = read_record(pid, own_pid=pid)
    assert why is None and record is not None
    assert (record.pid, record.engine, record.label, record.root) == (pid, "vllm", "vLLM", layout.root)
    assert record.applied == ("engine-state",) and record.seq == 2  # two updates: the second is what is held
    assert record.statuses == {"engine-state": "applied", "lmcache-shutdown": "not_needed"}
    links = [os.readlink(f"/proc/{pid}/fd/{n}") for n in os.listdir(f"/proc/{pid}/fd")]
    assert links.count(f"/memfd:{PUBLISHED_MEMFD} (deleted)") == 1, links  # the first record's memfd let go
    (n,) = [n for n in os.listdir(f"/proc/{pid}/fd") if os.readlink(f"/proc/{pid}/fd/{n}").startswith("/memfd:")]
    with pytest.raises(PermissionError):  # sealed: not even root writes it (EPERM, F_SEAL_WRITE)
        fd = os.open(f"/proc/{pid}/fd/{n}", os.O_WRONLY)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
    # Nothing on the node: the record lives in the process, and goes with it.
    assert sorted(os.listdir(layout.shm_dir)) + sorted(os.listdir(layout.tmp_dir)) == before
    t.kill()
    assert read_record(pid) == (None, "its descriptors cannot be read (No such file or directory)")


def test_a_forked_child_publishes_its_own_record(trees, layout) -> None:
    t = trees({"title": "VLLM::Worker_TP", "engine": "vLLM", "publish": True, "applied": ["worker-listener"],
               "fork": True}, {"KVCACHED_ROOT": layout.root})
    parent = t.pids[0]
    kids = [int(p) for p in open(f"/proc/{parent}/task/{parent}/children").read().split()]
    (child,) = [k for k in kids if _comm(k) == "VLLM::Worker_TP"]
    t.pids.append(child)
    wait_until(lambda: read_record(child, own_pid=child)[0] is not None, timeout=30)  # its at-fork publication
    mine, theirs = read_record(parent, own_pid=parent)[0], read_record(child, own_pid=child)[0]
    assert mine is not None and theirs is not None
    assert (mine.pid, theirs.pid) == (parent, child) and theirs.applied == mine.applied == ("worker-listener",)
    # Read as the parent's, the child's descriptors hold no record of the parent: the inherited one was replaced.
    assert read_record(child, own_pid=parent) == (None, None)


def test_a_record_of_another_schema_is_no_record() -> None:
    with pytest.raises(RecordError):
        Published.decode(b'{"schema": "kvcached.published/2"}')
    with pytest.raises(RecordError):
        Published.decode(b'{"schema": "kvcached.published/1", "pid": "1"}')
    r = Published(pid=7, engine="vllm", label="vLLM", engine_version=None, kvcached_version="0.1.0", root="/")
    assert Published.decode(r.encode()) == r


def test_doctor_names_the_serve_active_in_each_process_with_what_each_applied(trees, layout) -> None:
    env = {"KVCACHED_ROOT": layout.root}
    worker = {"title": "VLLM::Worker_TP", "engine": "vLLM", "publish": True, "applied": ["worker-listener"],
              "env": env}
    t = trees({"title": "VLLM::EngineCor", "engine": "vLLM", "publish": True, "applied": ["engine-state"],
               "updates": [{"engine-state": "applied", "elastic-kv": "unknown_shape"}],
               "children": [worker, worker]}, env)
    serve = _mine(find_serves(gather_facts(), root=layout.root), t)
    assert serve.engine == "vllm" and [p.pid for p in serve.processes] == sorted(t.pids)
    assert serve.applied() == ["engine-state", "worker-listener"]
    assert serve.stood_aside() == {"elastic-kv": {"unknown_shape": [t.pids[0]]}}
    line, aside = serve_lines([serve], kvctl="kvctl --root R")
    assert (line.name, line.status) == ("vllm-serve", "ok"), line
    assert line.summary.endswith("(VLLM::EngineCor, 3 processes): kvcached active in every process; patches "
                                 "applied: engine-state, worker-listener"), line.summary
    assert aside.status == "warn" and aside.under == "vllm-serve" and "elastic-kv stands aside (unknown_shape)" in \
        aside.summary
    assert aside.fix is not None and aside.fix.endswith("kvctl --root R gc --yes")
    # Another root's serves are not this root's: the node's `/` does not show a serve that said it is under R.
    assert not [s for s in find_serves(gather_facts(), root="/") if s.pid == t.pids[0]]
    # kvctl itself: the serve's word, in one document, and no shell view (no detect subprocess).
    env_kvctl = {k: v for k, v in os.environ.items() if not k.startswith("KVCACHED_")}
    started = time.monotonic()
    r = subprocess.run([KVCTL, "--root", layout.root, "doctor", "engine", "--json"], capture_output=True, text=True,
                       timeout=120, env=env_kvctl)
    checks = json.loads(r.stdout)["checks"]
    assert [c["name"] for c in checks] == ["vllm-serve", f"vllm-serve:{t.pids[0]}-patch:elastic-kv"], checks
    assert time.monotonic() - started < 60
    # The cleaner finds nothing of it to judge.
    r = subprocess.run([KVCTL, "--root", layout.root, "gc", "--engines", "--dry-run", "--json"], capture_output=True,
                       text=True, timeout=120, env={**env_kvctl, "KVCTL_LOCK": f"{layout.root}/gc.lock"})
    assert json.loads(r.stdout)["entries"] == []


def test_a_process_that_did_not_publish_makes_the_serve_partly_active(trees, layout) -> None:
    env = {"KVCACHED_ROOT": layout.root}
    silent = {"title": "VLLM::Worker_TP", "env": env}
    garbled = {"title": "VLLM::Worker_TP", "garbage": True, "env": env}
    t = trees({"title": "VLLM::EngineCor", "engine": "vLLM", "publish": True, "applied": ["engine-state"],
               "children": [silent, garbled]}, env)
    serve = _mine(find_serves(gather_facts(), root=layout.root), t)
    unread = {p.pid: p.unread for p in serve.processes}
    assert unread[t.pids[1]] is None and "not JSON" in (unread[t.pids[2]] or ""), unread
    (line,) = serve_lines([serve])
    assert line.status == "warn" and "kvcached active in 1 of 3 processes, not in PID" in line.summary, line
    assert line.fix == "export ENABLE_KVCACHED=true in the serve's environment and restart it (both engines' switch)"


@pytest.mark.parametrize(("title", "env", "why", "fix"), [
    ("VLLM::EngineCor", {}, "kvcached was not switched on in its environment",
     "export ENABLE_KVCACHED=true in the serve's environment"),
    ("sglang::schedul", {}, "kvcached was not switched on in its environment",
     "export ENABLE_KVCACHED=true in the serve's environment"),
    ("VLLM::EngineCor", {"ENABLE_KVCACHED": "true", "VLLM_PLUGINS": "lora"},
     "VLLM_PLUGINS='lora' in its environment leaves kvcached's plugin out",
     "export VLLM_PLUGINS=lora,kvcached in the serve's environment"),
    ("sglang::schedul", {"SGLANG_PLUGINS": "other"}, "SGLANG_PLUGINS='other' in its environment leaves",
     "export SGLANG_PLUGINS=other,kvcached ENABLE_KVCACHED=true in the serve's environment"),
], ids=["vllm-off", "sglang-off", "vllm-allow-list", "sglang-allow-list"])
def test_a_serve_that_published_nothing_says_why_with_one_switch_for_both_engines(trees, title, env, why,
                                                                                  fix) -> None:
    """Nothing published: it belongs to the node's `/`; the reason from its environment at start, and the fix."""
    t = trees({"title": title}, env)
    serve = _mine(find_serves(gather_facts(), root="/"), t)
    (line,) = serve_lines([serve])
    assert line.status == "warn" and "kvcached not active" in line.summary and why in line.summary, line
    assert line.fix is not None and line.fix.startswith(fix), line.fix


def test_withdrawn_a_process_and_what_it_forks_publish_nothing() -> None:
    """A process whose patches were reverted withdraws its record: nothing in its descriptors, nor a child's."""
    from kvcached.integration import publish

    class Registry:
        engine = "vLLM"

        def applied(self) -> tuple[str, ...]:
            return ("engine-state",)

    try:
        publish.publish(Registry())
        me = os.getpid()
        assert read_record(me, own_pid=me)[0] is not None
        publish.withdraw()
        assert read_record(me, own_pid=me) == (None, None) and publish.published() is None
        pid = os.fork()
        if pid == 0:
            os._exit(0 if read_record(os.getpid()) == (None, None) else 1)
        assert os.waitpid(pid, 0)[1] == 0
    finally:
        publish.withdraw()
