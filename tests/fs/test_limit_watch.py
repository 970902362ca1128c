"""LimitWatch: the segment's limit read every scheduler step, following kvctl limit and a replaced file."""

from __future__ import annotations

import os

import pytest

from kvcached.node.base.errors import NotASegment, SegmentMissing
from kvcached.node.state.segment import LimitWatch, create_segment, write_segment


def test_follows_the_limit_and_a_replaced_segment(tmp_path) -> None:
    path = str(tmp_path / "seg")
    create_segment(path, 1000)
    watch = LimitWatch(path, recheck=0.0)
    assert watch.read() == 1000
    write_segment(path, total=4096, used=10)  # what kvctl limit does, from anywhere
    assert watch.read() == 4096
    os.unlink(path)                           # a relaunch replaced it under the same name
    create_segment(path, 77)
    assert watch.read() == 77
    os.unlink(path)
    with pytest.raises(SegmentMissing):
        watch.read()
    with open(path, "wb") as f:
        f.write(b"\0" * 8)                    # not a segment
    with pytest.raises(NotASegment):
        watch.read()
    watch.close()
    watch.close()


def test_reads_without_reopening_between_rechecks(tmp_path) -> None:
    path = str(tmp_path / "seg")
    create_segment(path, 5)
    watch = LimitWatch(path, recheck=3600.0)
    assert watch.read() == 5
    fd = watch._fd
    write_segment(path, total=6)
    assert watch.read() == 6 and watch._fd == fd  # the same open file: one pread per step
    watch.close()


def _fds_on(*files: tuple[int, int]) -> list[str]:
    """This process's descriptors open on any of `files` (st_dev, st_ino).

    By identity, not by counting descriptors: another test's thread or the
    garbage collector may close one of its own at any moment (seen under a
    full suite), and a leaked one may then reuse its number.
    """
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed since the listing, or the listing's own descriptor
        if (st.st_dev, st.st_ino) in files:
            found.append(fd)
    return found


def test_sglang_rank0_source_waits_for_the_segment_and_survives_a_planted_file(tmp_path, caplog) -> None:
    # elastic_ranks imports no SGLang: rank 0's source is tested here, where no SGLang install is needed.
    from kvcached.integration.sglang.elastic_ranks import limit_source

    path = str(tmp_path / "seg")
    source = limit_source(path)
    with caplog.at_level("WARNING", logger="kvcached.integration.sglang.elastic_ranks"):
        assert source.read() is None and source.read() is None  # no segment yet: SGLang's capacity alone
    assert len([r for r in caplog.records if "no limit segment" in r.getMessage()]) == 1  # warned once
    create_segment(path, 4096)
    assert source.read() == 4096
    write_segment(path, total=8192)
    assert source.read() == 8192  # kvctl limit, seen at the next step
    st = os.stat(path)
    segment = (st.st_dev, st.st_ino)
    source.close()
    assert _fds_on(segment) == []
    os.unlink(path)
    os.mkfifo(path)  # planted where the segment was: opened without blocking, refused, and closed again
    planted = limit_source(path)
    assert planted.read() is None and planted.read() is None
    st = os.stat(path)
    assert _fds_on((st.st_dev, st.st_ino)) == []
    source.close()
    planted.close()


def _mapper():
    try:
        from kvcached.runtime._kvpages import MappedWord
    except ImportError:
        pytest.skip("kvcached.runtime._kvpages is not built (pip install -e . compiles it from csrc/)")
    return MappedWord


def test_a_mapped_watch_follows_the_limit_a_truncation_and_a_replacement(tmp_path) -> None:
    path = str(tmp_path / "seg")
    create_segment(path, 1000)
    watch = LimitWatch(path, recheck=0.0, mapper=_mapper())
    assert watch.read() == 1000 and watch.mapped
    write_segment(path, total=2048)
    assert watch.read() == 2048 and watch.mapped      # kvctl limit, seen through the mapping
    os.truncate(path, 0)                                # under the mapping: caught, then pread decides
    with pytest.raises(NotASegment):
        watch.read()
    assert not watch.mapped
    os.truncate(path, 24)
    write_segment(path, total=64)
    assert watch.read() == 64 and watch.mapped          # mapped again at the next recheck
    os.unlink(path)
    create_segment(path, 77)
    assert watch.read() == 77 and watch.mapped          # the new inode, mapped
    watch.close()
    assert not watch.mapped


def test_the_engines_map_their_limit_when_the_extension_is_built(tmp_path) -> None:
    from kvcached.integration.limits import limit_mapper
    from kvcached.integration.sglang.elastic_ranks import limit_source

    assert limit_mapper() is _mapper()
    path = str(tmp_path / "seg")
    create_segment(path, 4096)
    source = limit_source(path)
    assert source.read() == 4096
    assert source._watch is not None and source._watch.mapped
    source.close()
