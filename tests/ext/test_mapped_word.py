"""MappedWord: the per-step limit read as a load from a shared mapping, behind the extension's SIGBUS guard.

Real files in /dev/shm (tmpfs, where segments live), real truncation, real
SIGBUS: the faults that must kill a process are raised in child processes.
"""

from __future__ import annotations

import errno
import os
import signal
import struct
import subprocess
import sys
import textwrap
import uuid

import pytest

kvpages = pytest.importorskip(
    "kvcached.runtime._kvpages",
    reason="kvcached.runtime._kvpages is not built (pip install -e . compiles it from csrc/)",
)

pytestmark = pytest.mark.ext


@pytest.fixture
def shm_file():
    """A 24-byte file in /dev/shm, open read-write; removed afterwards."""
    path = f"/dev/shm/kvtest-mw-{uuid.uuid4().hex[:12]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    os.pwrite(fd, struct.pack("=qqq", 4096, 0, 0), 0)
    yield path, fd
    os.close(fd)
    os.unlink(path)


def _reads_so_far() -> int:
    """read-class system calls this thread has made (/proc/thread-self/io: syscr)."""
    with open("/proc/thread-self/io") as f:
        for line in f:
            if line.startswith("syscr:"):
                return int(line.split()[1])
    raise AssertionError("no syscr in /proc/thread-self/io")


def _child(code: str, path: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), path],
                          capture_output=True, text=True, timeout=60)


def test_reads_what_the_writer_wrote_without_a_system_call(shm_file) -> None:
    path, fd = shm_file
    word = kvpages.MappedWord(fd)
    assert word.read() == 4096 and word.guarded
    os.pwrite(fd, struct.pack("=q", 1 << 40), 0)  # kvctl limit, through the page cache
    assert word.read() == 1 << 40
    before = _reads_so_far()
    for _ in range(1000):
        assert word.read() == 1 << 40
    after = _reads_so_far()
    # Reading /proc/thread-self/io itself counts; a pread per call would add 1,000.
    assert after - before < 10
    word.close()
    assert word.closed and not word.guarded
    with pytest.raises(ValueError):
        word.read()


def test_a_file_truncated_under_the_mapping_answers_none_and_the_process_lives(shm_file) -> None:
    path, fd = shm_file
    word = kvpages.MappedWord(fd)
    assert word.read() == 4096
    os.ftruncate(fd, 0)
    assert word.read() is None  # SIGBUS, caught: this test process is still here
    assert word.read() is None
    os.ftruncate(fd, 24)
    assert word.read() == 0  # the page is back, zero-filled
    word.close()


def test_refuses_what_it_cannot_map(tmp_path) -> None:
    short = tmp_path / "short"
    short.write_bytes(b"1234")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for p in (short, fifo):
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
        try:
            with pytest.raises(OSError) as e:
                kvpages.MappedWord(fd)
            assert e.value.errno == errno.EINVAL
        finally:
            os.close(fd)
    with pytest.raises(OSError):
        kvpages.MappedWord(9999)  # no such descriptor


@pytest.mark.parametrize("faulthandler", [False, True])
def test_a_fault_that_is_not_ours_still_kills_the_process(shm_file, faulthandler) -> None:
    # Someone else's SIGBUS (here: Python's own mmap of a truncated file) must go to the handler
    # installed before ours: the default action, or faulthandler's traceback and then the default.
    path, _ = shm_file
    proc = _child(f"""
        import faulthandler, mmap, os, sys
        if {faulthandler}:
            faulthandler.enable()
        from kvcached.runtime._kvpages import MappedWord
        fd = os.open(sys.argv[1], os.O_RDWR)
        word = MappedWord(fd)
        other = mmap.mmap(fd, 24)
        os.ftruncate(fd, 0)
        print("ours:", word.read(), flush=True)
        other[0]
        print("survived", flush=True)
    """, path)
    assert proc.returncode == -signal.SIGBUS, proc.stderr
    assert "ours: None" in proc.stdout and "survived" not in proc.stdout
    assert ("Fatal Python error: Bus error" in proc.stderr) == faulthandler


def test_a_sent_sigbus_still_kills_the_process(shm_file) -> None:
    path, _ = shm_file
    proc = _child("""
        import os, signal, sys
        from kvcached.runtime._kvpages import MappedWord
        word = MappedWord(os.open(sys.argv[1], os.O_RDONLY))
        os.kill(os.getpid(), signal.SIGBUS)
        print("survived", flush=True)
    """, path)
    assert proc.returncode == -signal.SIGBUS and "survived" not in proc.stdout, proc.stderr


def test_a_later_handler_turns_the_guard_off_and_limit_watch_falls_back_to_pread(shm_file) -> None:
    # A handler installed after ours may call ours as its previous one; ours never re-installs
    # itself, so from then on nothing maps, and LimitWatch reads with pread.
    path, _ = shm_file
    proc = _child("""
        import errno, os, signal, sys
        from kvcached.runtime._kvpages import MappedWord
        from kvcached.node.state.segment import LimitWatch, write_segment
        watch = LimitWatch(sys.argv[1], recheck=0.0, mapper=MappedWord)
        assert watch.read() == 4096 and watch.mapped
        signal.signal(signal.SIGBUS, lambda *a: None)
        write_segment(sys.argv[1], total=8192)
        assert watch.read() == 8192 and not watch.mapped
        try:
            MappedWord(os.open(sys.argv[1], os.O_RDONLY))
        except OSError as e:
            assert e.errno == errno.EBUSY, e
        else:
            raise AssertionError("mapped behind a replaced guard")
        os.truncate(sys.argv[1], 0)
        try:
            watch.read()
        except Exception as e:
            print("refused:", type(e).__name__, flush=True)
    """, path)
    assert proc.returncode == 0, proc.stderr
    assert "refused: NotASegment" in proc.stdout


def test_a_forked_child_reads_through_the_inherited_mapping(shm_file) -> None:
    path, fd = shm_file
    word = kvpages.MappedWord(fd)
    assert word.read() == 4096
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status only
        code = 1
        try:
            os.pwrite(fd, struct.pack("=q", 123), 0)
            if word.read() == 123:
                os.ftruncate(fd, 0)
                code = 0 if word.read() is None else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert word.read() is None  # the parent's view of the same file: truncated
    word.close()
