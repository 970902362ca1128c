"""fd_stat against os.stat, through real descriptors of every kind the /proc pass meets."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys

import pytest

from kvcached.node.base import fdstat
from kvcached.node.base.fdstat import fd_stat
from kvcached.node.clean.facts import gather_facts


def _same(dir_fd: int, fd: int) -> None:
    st = os.stat(str(fd), dir_fd=dir_fd)
    got = fd_stat(dir_fd, str(fd))
    assert got == (st.st_mode, st.st_ino, st.st_dev, st.st_rdev)


@pytest.fixture(params=["statx", "os.stat"])
def way(request, monkeypatch):
    """Both ways fd_stat reads: statx, and the fallback where statx is absent (emulated: this kernel has it)."""
    if request.param == "os.stat":
        monkeypatch.setitem(fdstat._api, "fn", None)
    else:
        assert fdstat._load() is not None, "statx should answer on this kernel and libc"
    return request.param


def test_every_kind_of_descriptor_reads_as_os_stat_says(tmp_path, way) -> None:
    r, w = os.pipe()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = tmp_path / "held"
    path.write_bytes(b"x")
    f = os.open(path, os.O_RDONLY)
    null = os.open(os.devnull, os.O_RDONLY)
    d = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    os.unlink(path)  # deleted but held: still its identity
    dir_fd = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
    try:
        for fd in (r, w, sock.fileno(), f, null, d):
            _same(dir_fd, fd)
        assert stat.S_ISSOCK(fd_stat(dir_fd, str(sock.fileno())).mode)
        assert fd_stat(dir_fd, str(null)).rdev == os.stat(os.devnull).st_rdev
        assert fd_stat(dir_fd, "999999") is None  # closed (never open): not an error
    finally:
        for fd in (r, w, f, null, d, dir_fd):
            os.close(fd)
        sock.close()


def test_a_file_held_through_any_path_is_held_by_identity(tmp_path) -> None:
    """The pass records every held file by identity: a /dev/shm file opened through another path
    (here a symlinked directory: the kernel's path shows no /dev/shm/) is found by what it is."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "alias").symlink_to(real)
    target = real / "psm_0000beef"
    target.write_bytes(b"\0" * 64)
    child = subprocess.Popen([sys.executable, "-c", "import os,sys,time; fd=os.open(sys.argv[1], os.O_RDONLY); "
                              "null=os.open(os.devnull, os.O_RDONLY); "
                              "print(flush=True); time.sleep(60)", str(tmp_path / "alias" / "psm_0000beef")],
                             stdout=subprocess.PIPE)
    try:
        child.stdout.readline()
        st = os.stat(target)
        facts = gather_facts()
        assert (st.st_dev, st.st_ino) in facts.processes[child.pid].held_files
        assert [p.pid for p in facts.holders_of_file((st.st_dev, st.st_ino))] == [child.pid]
        null = os.stat(os.devnull)
        assert any(rdev == null.st_rdev for _, rdev, _, _ in facts.processes[child.pid].char_devices)
        assert facts.processes[child.pid].proc_state in ("S", "R")
    finally:
        child.kill()
        child.wait()
