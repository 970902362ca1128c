"""SGLang 0.5.23's own ZMQ IPC endpoints, made and bound by its code in a child, then the child SIGKILLed.

The child is `python -c` forked from the zygote (tests/sglang/zygote.py), which imported SGLang once.

PortArgs.init_new names five endpoints with tempfile.NamedTemporaryFile(delete=False)
in tempfile.gettempdir(): the child's TMPDIR points it at a private --root's
/tmp, so kvctl gc --engines sees exactly them. Three are bound through SGLang's
get_zmq_socket, as its processes bind theirs; two stay the empty files
NamedTemporaryFile left, which no zmq socket replaced.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from kvcached.node.base.layout import Layout
from tests.waiting import wait_for

from ..cli.conftest import invoke
from ..fs.engine_plant import backdate
from .serves import Forked

pytestmark = pytest.mark.sglang

PORT_ARGS = r"""
import json, signal
import zmq
from sglang.srt.server_args import PortArgs, ServerArgs
from sglang.srt.utils.network import get_zmq_socket

args = PortArgs.init_new(ServerArgs(model_path="unused"))
names = [args.tokenizer_ipc_name, args.scheduler_input_ipc_name, args.detokenizer_ipc_name, args.rpc_ipc_name,
         args.metrics_ipc_name]
ctx = zmq.Context()
bound = [get_zmq_socket(ctx, zmq.PULL, endpoint, True) for endpoint in names[:3]]
print(json.dumps([n.removeprefix("ipc://") for n in names]), flush=True)
signal.pause()  # bound until the test SIGKILLs it
"""


def _first_line(p: Forked, timeout: float) -> str:
    wait_for(lambda: "\n" in p.stdout() or p.zygote.status(p.key, 0) is not None, timeout=timeout, interval=0.05)
    out = p.stdout()
    assert "\n" in out, f"the SGLang child said nothing (exit {p.zygote.status(p.key, 0)}): {p.err_path.read_text()}"
    return out.splitlines()[0]


def _entries(layout: Layout, *args: str) -> dict[str, dict]:
    r = invoke("--root", layout.root, "gc", *args, "--json")
    assert r.code in (0, 3), r.stdout
    return {e["path"]: e for e in r.json("gc")["entries"]}


def test_sglangs_own_endpoints_kept_while_bound_removed_after_sigkill(layout: Layout, sgl_scratch: str,
                                                                     zygote) -> None:
    p = Forked(zygote, PORT_ARGS, sgl_scratch, extra={"TMPDIR": layout.tmp_dir})
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
        assert p.wait(30) == -signal.SIGKILL
        assert all(os.path.lexists(x) for x in paths)  # nothing unlinks them
        done = _entries(layout, "--engines", "--yes")
        assert {x: (done[x]["reason"], done[x]["action"]) for x in bound} == {
            x: ("not_listening", "removed") for x in bound}
        assert [os.path.lexists(x) for x in paths] == [False, False, False, True, True]
        assert all(os.stat(x).st_size == 0 for x in files)
    finally:
        p.close()
