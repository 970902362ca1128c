"""The scan's fast paths give what the plain ones give, on real nodes.

`socket_candidate` against `candidate_from_stat`, `BindProbe` against
`bound()` (one socket reused across nodes, a bound datagram socket between
them), `handle_reader()` against `file_handle`.
"""

from __future__ import annotations

import os
import socket

from kvcached.node.base.enums import Kind
from kvcached.node.base.ident import file_handle, handle_reader
from kvcached.node.clean.scan import candidate_from_stat, socket_candidate
from kvcached.node.state.sockdiag import Bind, BindProbe, bound

from .helpers import live_socket, stale_socket


def test_socket_candidate_builds_what_candidate_from_stat_builds(layout, uniq) -> None:
    path = layout.socket_path(uniq, 3)
    stale_socket(path)
    d = os.path.dirname(path)
    name = os.path.basename(path)
    st = os.lstat(path)
    for lease, bind, err in ((None, Bind.UNBOUND, "ECONNREFUSED"), (True, None, None)):
        fast = socket_candidate(path, name, uniq, st, 3, 0, b"h", 1000, lease, bind, err)
        plain = candidate_from_stat(Kind.SOCKET, path, name, st, deployment=uniq, rank=3, stage=0,
                                    parent_uid=1000, handle=b"h", lease=lease, bind=bind, bind_errno=err)
        assert fast == plain and type(fast) is type(plain)
        assert fast.children == () and fast.hash_ok and not fast.cross_mount
    assert os.path.isdir(d)


def test_bind_probe_answers_as_bound_does_whatever_came_before(layout, uniq) -> None:
    d = layout.socket_dir(uniq)
    os.makedirs(d)
    stale = os.path.join(d, "w0.sock")
    stale_socket(stale)
    listener = live_socket(os.path.join(d, "w1.sock"))
    dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    dgram.bind(os.path.join(d, "w2.sock"))
    with open(os.path.join(d, "w3.sock"), "w"):
        pass
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    probe = BindProbe()
    try:
        # The datagram socket (a successful connect) sits between other nodes: the
        # answers after it must not depend on it.
        order = ["w0.sock", "w2.sock", "w0.sock", "w1.sock", "w2.sock", "w9.sock", "w3.sock", "w0.sock"]
        for name in order:
            assert probe.test(fd, name) == bound(os.path.join(d, name), fd), name
        assert probe.test(fd, "w0.sock") == (Bind.UNBOUND, "ECONNREFUSED")
        assert probe.test(fd, "w2.sock")[0] is Bind.BOUND
        assert probe.test(fd, "w9.sock")[0] is Bind.GONE
    finally:
        probe.close()
        os.close(fd)
        listener.close()
        dgram.close()


def test_handle_reader_reads_what_file_handle_reads(layout, uniq) -> None:
    path = layout.socket_path(uniq, 0)
    stale_socket(path)
    d = os.path.dirname(path)
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        handle_of = handle_reader()
        with open(os.path.join(d, "é-ß"), "w"):
            pass
        for name in ("w0.sock", "absent", "é-ß"):
            assert handle_of(name, fd) == file_handle(name, fd), name
        os.symlink("w0.sock", os.path.join(d, "link"))
        # Not followed: the link's own handle, or none, never the target's.
        assert handle_of("link", fd) == file_handle("link", fd)
        got = handle_of("w0.sock", fd)
        assert got is None or handle_of("link", fd) != got
    finally:
        os.close(fd)
