"""The /proc pass reads a process's files whole, however long they are.

facts._read stops at the first short read (one read per file on almost every
process); a cmdline or environ longer than its buffer must still come back
entire, with what sits at its very end (the IPC name a launcher appended).
"""

from __future__ import annotations

import os
import subprocess
import sys

from kvcached.node.facts import gather_facts


def test_a_long_environ_and_cmdline_are_read_to_their_end() -> None:
    filler = "x" * 100_000  # more than the pass's 64 KiB buffer, under the kernel's 128 KiB per string
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "FILLER": filler, "KVCACHED_IPC_NAME": "long-env-tail"}
    args = [sys.executable, "-c", "import sys; sys.stdin.read()", *(["y" * 30_000] * 3)]
    child = subprocess.Popen(args, env=env, stdin=subprocess.PIPE)
    try:
        # Popen returns once the exec succeeded: the new cmdline and environ are in place.
        info = gather_facts().processes[child.pid]
        assert len("\0".join(args)) > 65536
        assert info.cmdline == tuple(args)
        assert info.ipc_name == "long-env-tail"
    finally:
        child.stdin.close()  # type: ignore[union-attr]
        child.wait(timeout=30)
