"""The /proc pass reads a process's files whole, however long they are.

facts._read stops at the first short read (one read per file on almost every
process); a cmdline or environ longer than its buffer must still come back
entire, with what sits at its very end (the IPC name a launcher appended). And the
uid it records is the effective one, read from the owner of /proc/<pid>, also
for a process that is not dumpable (whose files there turn root's).
"""

from __future__ import annotations

import os
import subprocess
import sys

from kvcached.node.clean.facts import gather_facts


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


def test_a_mapping_past_the_first_page_of_maps_is_seen(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """/proc/<pid>/maps comes about a page per read, each read short: the pass must read on to the end.

    maps lists mappings by address, and mmap hands out addresses top down: the
    child maps the file the test looks for first, then 300 more below it, so
    that the one it looks for comes after many pages of them.
    """
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    target = os.path.join(shm, f"kvtest-late-map-{os.getpid()}")
    code = (
        "import mmap, os, sys, tempfile\n"
        "d = tempfile.mkdtemp(dir=sys.argv[2]); keep = []\n"
        "f = open(sys.argv[1], 'r+b'); keep.append(mmap.mmap(f.fileno(), 4096)); f.close()\n"
        "for i in range(300):\n"
        "    p = os.path.join(d, str(i)); open(p, 'wb').write(b'x' * 4096)\n"
        "    f = open(p, 'r+b'); keep.append(mmap.mmap(f.fileno(), 4096)); f.close()\n"
        "maps = open(f'/proc/{os.getpid()}/maps', 'rb').read()\n"
        "print(maps.find(os.path.basename(sys.argv[1]).encode()), flush=True)\n"
        "sys.stdin.read()\n"
        "import shutil; shutil.rmtree(d)\n")
    with open(target, "wb") as f:
        f.write(b"k" * 4096)
    st = os.stat(target)
    child = subprocess.Popen([sys.executable, "-c", code, target, str(tmp_path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        at = int(child.stdout.readline())  # type: ignore[union-attr]
        assert at > 8 * 4096  # many reads' worth of maps before it
        facts = gather_facts()
        assert child.pid in facts.map_users({st.st_dev}).get((st.st_dev, st.st_ino), [])
        if shm == "/dev/shm":
            assert child.pid in facts.mapped().get((st.st_dev, st.st_ino), [])
    finally:
        child.stdin.close()  # type: ignore[union-attr]
        child.wait(timeout=30)
        os.unlink(target)


def test_the_uid_is_the_effective_one_also_for_a_process_that_is_not_dumpable() -> None:
    """The pass takes the uid from /proc/<pid>'s owner, not from status: the two must agree where they could not.

    As root, the child keeps real uid 0 and takes effective uid 65534 (which
    makes it non-dumpable): a real uid, or the root-owned files inside its
    directory, would say 0. As a user, it drops dumpable by prctl: its files
    turn root's, its directory stays the user's.
    """
    if os.geteuid() == 0:
        code, expected = "import os; os.setresuid(0, 65534, 0)", 65534
    else:
        code, expected = "import ctypes; ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)", os.geteuid()  # PR_SET_DUMPABLE
    child = subprocess.Popen([sys.executable, "-c", f"{code}\nimport sys; print(flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        child.stdout.readline()  # type: ignore[union-attr]
        assert os.stat(f"/proc/{child.pid}/status").st_uid == 0  # not dumpable: its files are root's
        with open(f"/proc/{child.pid}/status", "rb") as f:
            effective = int(next(x for x in f if x.startswith(b"Uid:")).split()[2])
        assert gather_facts().processes[child.pid].uid == effective == expected
    finally:
        child.stdin.close()  # type: ignore[union-attr]
        child.wait(timeout=30)
