"""SGLang 0.5.23's own ZMQ IPC endpoints, made and bound by its code in a child, then the child SIGKILLed.

PortArgs.init_new names five endpoints with tempfile.NamedTemporaryFile(delete=False)
in tempfile.gettempdir(): the child's TMPDIR points it at a private --root's
/tmp, so kvctl gc --engines sees exactly them. Three are bound through SGLang's
get_zmq_socket, as its processes bind theirs; two stay the empty files
NamedTemporaryFile left, which no zmq socket replaced.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest

from kvcached.node.layout import Layout

from ..cli.conftest import invoke
from ..fs.engine_plant import backdate
from .cpu_env import child_env

pytestmark = pytest.mark.sglang

PORT_ARGS = r"""
import json, sys
import zmq
from sglang.srt.server_args import PortArgs, ServerArgs
from sglang.srt.utils.network import get_zmq_socket

args = PortArgs.init_new(ServerArgs(model_path="unused"))
names = [args.tokenizer_ipc_name, args.scheduler_input_ipc_name, args.detokenizer_ipc_name, args.rpc_ipc_name,
         args.metrics_ipc_name]
ctx = zmq.Context()
bound = [get_zmq_socket(ctx, zmq.PULL, endpoint, True) for endpoint in names[:3]]
print(json.dumps([n.removeprefix("ipc://") for n in names]), flush=True)
sys.stdin.read()
"""


def _first_line(p: subprocess.Popen[str], timeout: float) -> str:
    assert p.stdout is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([p.stdout], [], [], 1.0)[0]:
            return p.stdout.readline()
        if p.poll() is not None:
            break
    raise AssertionError(f"the SGLang child said nothing within {timeout:g}s (exit {p.poll()})")


def _entries(layout: Layout, *args: str) -> dict[str, dict]:
    r = invoke("--root", layout.root, "gc", *args, "--json")
    assert r.code in (0, 3), r.stdout
    return {e["path"]: e for e in r.json("gc")["entries"]}


def test_sglangs_own_endpoints_kept_while_bound_removed_after_sigkill(layout: Layout, sgl_scratch: str) -> None:
    p = subprocess.Popen([sys.executable, "-c", PORT_ARGS], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True, cwd=sgl_scratch,
                         env=child_env(sgl_scratch, {"TMPDIR": layout.tmp_dir}))
    try:
        paths = json.loads(_first_line(p, 400))
        assert [os.path.dirname(x) for x in paths] == [layout.tmp_dir] * 5  # TMPDIR decides where they go
        bound, files = paths[:3], paths[3:]
        for x in paths:
            backdate(x, 3600)
        seen = _entries(layout, "--engines", "--dry-run")
        assert {x: (seen[x]["kind"], seen[x]["engine"], seen[x]["state"], seen[x]["reason"]) for x in bound} == {
            x: ("sglang-ipc", "sglang", "live", "listening") for x in bound}
        assert all(seen[x]["pids"] == [p.pid] for x in bound)
        assert not set(files) & set(seen)  # regular files: never candidates
        os.kill(p.pid, signal.SIGKILL)  # as SGLang's kill_process_tree stops its processes
        p.wait(timeout=30)
        assert all(os.path.lexists(x) for x in paths)  # nothing unlinks them
        done = _entries(layout, "--engines", "--yes")
        assert {x: (done[x]["reason"], done[x]["action"]) for x in bound} == {
            x: ("not_listening", "removed") for x in bound}
        assert [os.path.lexists(x) for x in paths] == [False, False, False, True, True]
        assert all(os.stat(x).st_size == 0 for x in files)
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
