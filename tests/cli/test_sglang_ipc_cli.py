"""SGLang's ZMQ IPC sockets (`sglang-ipc`) and `kvctl gc --engines`: real sockets under a private --root.

SGLang names its endpoints with tempfile.NamedTemporaryFile(delete=False):
tmp + 8 of tempfile's characters, in tempfile.gettempdir(). zmq binds a
socket there; a killed serve leaves the node. A socket something is bound to
is kept; one nothing is bound to goes once older than --min-age; the empty
file of a name zmq never bound, and names one character off the shape, are
never looked at.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import jsonschema
import pytest

from kvcached.node.base.layout import Layout
from kvcached.node.clean.present import engine_leftover_count

from ..fs.engine_plant import LISTENER, SCHEMA, Children, Node, backdate
from .conftest import Run, invoke, kvctl

HOUR = 3600.0
LOOKALIKES = ("tmpab12cd_", "tmpab12cd_99", "tmpAB12CD_9", "tmpab12cD_9", "TMPab12cd_9")


@pytest.fixture(params=["cli-runner", "subprocess"])
def run(request: pytest.FixtureRequest) -> Callable[..., Run]:
    """kvctl in process, or the installed program."""
    return invoke if request.param == "cli-runner" else kvctl


def _plant(layout: Layout, kids: Children) -> tuple[Node, dict[str, str], int]:
    """SGLang's sockets live, dead and young, its never-bound file, lookalikes; (node, path by role, listener PID)."""
    n = Node(layout)
    live = os.path.join(n.tmp, "tmpab12cd_9")
    n.planted.append(live)
    listener = kids.spawn(LISTENER, live)
    backdate(live, HOUR)
    paths = {
        "live": live,
        "dead": n.socket("tmpq7x_0k2m", age=HOUR),   # the listener closed (or was killed) without unlinking
        "young": n.socket("tmpyoung_01", age=0),
        "file": n.file("tmpzz99yy88", age=HOUR, nbytes=0, directory=n.tmp),  # what zmq never bound
    }
    for i, name in enumerate(LOOKALIKES):
        paths[f"lookalike{i}"] = n.socket(name, age=HOUR)
    return n, paths, listener.pid


def _mine(doc: dict, paths: dict[str, str]) -> dict[str, dict]:
    planted = set(paths.values())
    return {e["path"]: e for e in doc["entries"] if e["path"] in planted}


def test_gc_engines_removes_the_dead_socket_and_keeps_the_bound_one(layout: Layout, children: Children,
                                                                    run: Callable[..., Run]) -> None:
    n, paths, pid = _plant(layout, children)
    try:
        dry = run("--root", layout.root, "gc", "--engines", "--dry-run", "--json")
        assert dry.code == 3, dry.stderr
        seen = _mine(dry.json("gc"), paths)
        assert set(seen) == {paths["live"], paths["dead"], paths["young"]}
        for e in seen.values():
            jsonschema.validate(e, SCHEMA)
            assert (e["kind"], e["engine"], e["type"]) == ("sglang-ipc", "sglang", "socket")
            assert e["deployment"] is None and e["creator_pid"] is None
        live, dead, young = seen[paths["live"]], seen[paths["dead"]], seen[paths["young"]]
        assert (live["state"], live["reason"], live["action"], live["pids"]) == ("live", "listening", "kept", [pid])
        assert (dead["state"], dead["reason"], dead["action"]) == ("stale", "not_listening", "would_remove")
        assert (young["state"], young["reason"], young["action"]) == ("young", "younger_than_grace", "kept")
        assert all(os.path.lexists(p) for p in paths.values())

        other = run("--root", layout.root, "gc", "--kind", "vllm-ipc", "--yes", "--json")
        assert other.code == 0 and not _mine(other.json("gc"), paths)
        assert all(os.path.lexists(p) for p in paths.values())

        done = run("--root", layout.root, "gc", "--engines", "--yes", "--json")
        assert done.code == 0, done.stdout
        assert {p: e["action"] for p, e in _mine(done.json("gc"), paths).items()} == {
            paths["live"]: "kept", paths["dead"]: "removed", paths["young"]: "kept"}
        assert {k for k, p in paths.items() if not os.path.lexists(p)} == {"dead"}
        assert os.stat(paths["file"]).st_size == 0  # the never-bound file: untouched
    finally:
        n.cleanup()


def test_a_sigkilled_listener_leaves_a_socket_that_kind_sglang_ipc_removes(layout: Layout,
                                                                           children: Children) -> None:
    """The live socket of a serve that is SIGKILLed (SGLang's kill_process_tree) is stale at the next run."""
    n, paths, pid = _plant(layout, children)
    try:
        r = invoke("--root", layout.root, "gc", "--kind", "sglang-ipc", "--yes", "--json")
        assert r.code == 0 and os.path.lexists(paths["live"]) and not os.path.lexists(paths["dead"])
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        assert os.path.lexists(paths["live"])  # nobody unlinks it
        r = invoke("--root", layout.root, "gc", "--kind", "sglang-ipc", "--yes", "--json")
        assert r.code == 0, r.stdout
        gone = _mine(r.json("gc"), paths)
        assert (gone[paths["live"]]["reason"], gone[paths["live"]]["action"]) == ("not_listening", "removed")
        assert {k for k, p in paths.items() if not os.path.lexists(p)} == {"live", "dead"}
        assert {e["kind"] for e in r.json("gc")["entries"]} <= {"sglang-ipc"}
    finally:
        n.cleanup()


def test_plain_gc_counts_the_sockets_by_name_and_never_the_file(layout: Layout, children: Children) -> None:
    """The hint plain gc prints on a terminal counts socket nodes of the shape, live or dead; no file, no lookalike."""
    n, paths, _ = _plant(layout, children)
    try:
        assert engine_leftover_count(layout.root) == 3  # live, dead, young
        r = invoke("--root", layout.root, "gc", "--yes", "--json")
        assert r.code == 0 and not _mine(r.json("gc"), paths)
        assert all(os.path.lexists(p) for p in paths.values())
    finally:
        n.cleanup()
