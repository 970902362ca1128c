"""Segments and leases on real files."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap

import pytest

from kvcached.node.base.errors import NotASegment, SegmentMissing
from kvcached.node.state.lease import SegmentLease, read_proc_locks, segment_lease_held
from kvcached.node.state.segment import SEGMENT_SIZE, SegmentInfo, create_segment, read_segment, write_segment


def test_create_read_write_roundtrip(layout) -> None:
    p = layout.segment_path("seg1")
    assert create_segment(p, 1 << 30) == SegmentInfo(total=1 << 30, used=0, prealloc=0)
    assert os.stat(p).st_size == SEGMENT_SIZE
    assert write_segment(p, used=4096, prealloc=8192) == SegmentInfo(total=1 << 30, used=4096, prealloc=8192)
    assert read_segment(p) == SegmentInfo(total=1 << 30, used=4096, prealloc=8192)
    with open(p, "rb") as f:  # the native 3×int64 layout upstream readers expect
        assert int.from_bytes(f.read(8), sys.byteorder, signed=True) == 1 << 30
    with pytest.raises(FileExistsError):
        create_segment(p, 1)
    with pytest.raises(ValueError):
        write_segment(p, total=-1)


def test_writer_waits_for_upstream_style_reader_lock(layout) -> None:
    p = layout.segment_path("seg2")
    create_segment(p, 100)
    fd = os.open(p, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_SH)  # an upstream reader inside its critical section
    code = f"from kvcached.node.state.segment import write_segment; write_segment({p!r}, total=5)"
    child = subprocess.Popen([sys.executable, "-c", code])
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.5)  # blocked on LOCK_EX while we hold LOCK_SH
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    assert child.wait(10) == 0
    assert read_segment(p).total == 5


def test_refuses_links_and_non_segments(layout, tmp_path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"\0" * 24)
    os.symlink(victim, layout.segment_path("sym"))
    os.link(victim, layout.segment_path("hard"))
    with open(layout.segment_path("big"), "wb") as f:
        f.write(b"\0" * 4096)
    for name, why in (("sym", "symbolic link"), ("hard", "hard links"), ("big", "4096 bytes")):
        with pytest.raises(NotASegment, match=why):
            write_segment(layout.segment_path(name), total=1)
    assert victim.read_bytes() == b"\0" * 24
    with pytest.raises(SegmentMissing):
        read_segment(layout.segment_path("absent"))


def test_lease_is_seen_from_another_process_without_side_effects(layout) -> None:
    p = layout.segment_path("seg3")
    create_segment(p, 1)
    assert segment_lease_held(p) is False
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from kvcached.node.state.lease import SegmentLease
        l = SegmentLease({p!r}); l.acquire(); print("held", flush=True); sys.stdin.read()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = os.stat(p)
        for _ in range(3):
            assert segment_lease_held(p) is True
        st = os.stat(p)
        assert (st.st_mtime_ns, st.st_size) == (before.st_mtime_ns, before.st_size)
        assert any(e.kind == "OFDLCK" for e in read_proc_locks()[(st.st_dev, st.st_ino)])
        # The lease byte lies past the data: upstream's whole-file flock still works.
        assert write_segment(p, used=1).used == 1
    finally:
        holder.stdin.close()
        holder.wait(10)
    assert segment_lease_held(p) is False  # released with the holder's open file


def test_lease_in_process_roundtrip(layout) -> None:
    p = layout.segment_path("seg4")
    create_segment(p, 1)
    with SegmentLease(p) as lease:
        assert lease.identity == (os.stat(p).st_dev, os.stat(p).st_ino)
        assert segment_lease_held(p) is True
    assert segment_lease_held(p) is False


def test_readers_do_not_hang_on_a_stuck_writer(layout) -> None:
    from kvcached.node.base.errors import SegmentBusy

    p = layout.segment_path("seg5")
    create_segment(p, 1)
    fd = os.open(p, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a writer stuck inside its critical section
    try:
        with pytest.raises(SegmentBusy, match="locked by another process"):
            read_segment(p, timeout=0.1)
    finally:
        os.close(fd)
    assert read_segment(p).total == 1


def test_forked_child_does_not_inherit_the_lease(layout) -> None:
    p = layout.segment_path("seg6")
    create_segment(p, 1)
    lease = SegmentLease(p)
    lease.acquire()
    r, w = os.pipe()
    up_r, up_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child outlives its parent's lease, like an LMCache helper process
        os.close(w)
        os.write(up_w, b"u")  # fork hooks have run by the time os.fork returns here
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    assert os.read(up_r, 1) == b"u"
    try:
        lease.release()
        assert segment_lease_held(p) is False  # the child's copy was dropped at fork
    finally:
        os.write(w, b"x")
        os.close(w)
        os.waitpid(pid, 0)
