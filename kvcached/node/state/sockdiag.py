"""Which Unix socket files have a socket bound to them: by the file's identity, never by path string.

Two tools, both passive (a listener never sees either):

- `bound(path)`: connect a *datagram* socket to the node. The kernel looks the
  node up by its inode, in every network namespace at once, before it checks
  the socket type: no socket bound to the inode gives ECONNREFUSED, a stream
  listener (ours or upstream's) gives EPROTOTYPE and no connection is made, so
  nothing reaches the listener's accept queue. A bare connect-and-close, by
  contrast, kills upstream's listener thread (docs/NODE.md §3).
- `listening_sockets()`: sock_diag (NETLINK_SOCK_DIAG) dumps of the listening
  Unix sockets of a network namespace with `UNIX_DIAG_VFS`, the device and
  inode of the file each one is bound to. Matching those against a node's
  lstat identity names the PIDs that serve it, whatever path the node is seen
  through (a pod's /tmp bind-mounted elsewhere, a symlinked --root,
  /proc/PID/root) and whatever string the listener bound.

The first decides liveness; the second only says who serves.
"""

from __future__ import annotations

import errno
import os
import struct
import threading
from collections import defaultdict
from typing import TYPE_CHECKING

from ..base.enums import StrEnum
from ..base.layout import SUN_PATH_MAX

if TYPE_CHECKING:
    import socket

# `socket` is imported by the functions that make one: every kvctl run imports this
# module (decide and scan name Bind), and on an idle node none is made; the module
# is a visible share of a cold `kvctl gc` (bench/bench_cli_start.py; bench/README.md).

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300
NLMSG_ERROR = 2
NLMSG_DONE = 3
TCP_LISTEN = 10
UDIAG_SHOW_VFS = 0x2
UNIX_DIAG_VFS = 1
CLONE_NEWNET = 0x40000000

_NLMSGHDR = struct.Struct("=IHHII")        # len, type, flags, seq, pid
_UNIX_DIAG_REQ = struct.Struct("=BBHIIIII")  # family, protocol, pad, states, ino, show, cookie[2]
_UNIX_DIAG_MSG = struct.Struct("=BBBBIII")   # family, type, state, pad, ino, cookie[2]
_RTATTR = struct.Struct("=HH")              # len, type
_UNIX_DIAG_VFS = struct.Struct("=II")       # vfs inode, vfs dev (the kernel's dev_t encoding)


class Bind(StrEnum):
    """What a passive bind test found at a socket node."""

    BOUND = "bound"        # a socket is bound to this file: a listener, or one about to listen
    UNBOUND = "unbound"    # ECONNREFUSED: no socket is bound to it, in any namespace; it can never serve again
    DENIED = "denied"      # EACCES/EPERM: we may not look
    GONE = "gone"          # ENOENT: removed meanwhile
    ERROR = "error"        # anything else


def bound(path: str, dir_fd: int | None = None) -> tuple[Bind, str | None]:
    """Whether a socket is bound to the node at `path` (or `path` inside `dir_fd`), without connecting to it."""
    target = path
    own_fd = -1
    if dir_fd is not None:
        target = f"/proc/self/fd/{dir_fd}/{os.path.basename(path)}"
    elif len(os.fsencode(path)) >= SUN_PATH_MAX:
        # Too long for sun_path: reach it through our own fd of its directory.
        try:
            own_fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            return Bind.ERROR, errno.errorcode.get(e.errno or 0, str(e.errno))
        target = f"/proc/self/fd/{own_fd}/{os.path.basename(path)}"
    import socket

    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    try:
        s.connect(target)
        # Only a datagram socket accepts a datagram connect, and that sends nothing.
        return Bind.BOUND, None
    except OSError as e:
        return _bind_of(e.errno) if e.errno else (Bind.ERROR, "0")
    finally:
        s.close()
        if own_fd >= 0:
            os.close(own_fd)


def _bind_of(code: int) -> tuple[Bind, str | None]:
    """What a datagram connect's errno says about the node (0: it connected)."""
    if code == 0 or code == errno.EPROTOTYPE:
        return Bind.BOUND, None
    name = errno.errorcode.get(code, str(code))
    if code == errno.ECONNREFUSED:
        return Bind.UNBOUND, name
    if code in (errno.EACCES, errno.EPERM):
        return Bind.DENIED, name
    if code == errno.ENOENT:
        return Bind.GONE, name
    return Bind.ERROR, name


_UNBOUND = (Bind.UNBOUND, errno.errorcode[errno.ECONNREFUSED])


class BindProbe:
    """`bound()` for many nodes of one scan: the same test through one datagram socket, reconnected per node.

    A datagram connect that fails changes nothing in the socket (the kernel
    looks the node up, and fails, before it touches the socket's peer), so
    the answer for one node never depends on the nodes tested before it; a
    connect that succeeds (a datagram socket is bound there) connects it, so
    the socket is replaced before the next test. Making and closing a socket
    per node cost two syscalls and a Python object each, a large share of a
    full node's scan (bench/bench_gc.py; bench/README.md). Use from one thread; close() when done.
    """

    def __init__(self) -> None:
        self._sock: socket.socket | None = None

    def test(self, dir_fd: int, name: str) -> tuple[Bind, str | None]:
        """Whether a socket is bound to `name` in `dir_fd`, without connecting to any listener."""
        s = self._sock
        if s is None:
            import socket

            s = self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        try:
            code = s.connect_ex(f"/proc/self/fd/{dir_fd}/{name}")
        except OSError as e:  # an address the socket layer refuses before any lookup (too long)
            return _bind_of(e.errno) if e.errno else (Bind.ERROR, "0")
        if code == errno.ECONNREFUSED:
            return _UNBOUND  # the usual answer on a node full of dead deployments
        if code == 0:
            self.close()
        return _bind_of(code)

    def close(self) -> None:
        """Close the socket (a later test makes a new one)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _kernel_dev(dev: int) -> int:
    # UNIX_DIAG_VFS carries the superblock's s_dev in the kernel's own encoding
    # (major << 20 | minor), not the one stat(2) returns.
    return os.makedev(dev >> 20, dev & 0xFFFFF)


def _dump(sock: socket.socket) -> dict[tuple[int, int], set[int]]:
    import socket

    req = _UNIX_DIAG_REQ.pack(socket.AF_UNIX, 0, 0, 1 << TCP_LISTEN, 0, UDIAG_SHOW_VFS, 0xFFFFFFFF, 0xFFFFFFFF)
    sock.send(_NLMSGHDR.pack(_NLMSGHDR.size + len(req), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, 1, 0) + req)
    out: dict[tuple[int, int], set[int]] = defaultdict(set)
    while True:
        data = sock.recv(1 << 16)
        if not data:
            return dict(out)
        at = 0
        while at + _NLMSGHDR.size <= len(data):
            length, kind, _flags, _seq, _pid = _NLMSGHDR.unpack_from(data, at)
            if length < _NLMSGHDR.size:
                return dict(out)
            if kind == NLMSG_DONE:
                return dict(out)
            if kind == NLMSG_ERROR:
                (code,) = struct.unpack_from("=i", data, at + _NLMSGHDR.size)
                raise OSError(-code, os.strerror(-code))
            body = at + _NLMSGHDR.size
            _fam, _typ, state, _pad, ino, _c0, _c1 = _UNIX_DIAG_MSG.unpack_from(data, body)
            attr = body + _UNIX_DIAG_MSG.size
            end = at + length
            while attr + _RTATTR.size <= end:
                alen, atype = _RTATTR.unpack_from(data, attr)
                if alen < _RTATTR.size:
                    break
                if atype == UNIX_DIAG_VFS and state == TCP_LISTEN:
                    vino, vdev = _UNIX_DIAG_VFS.unpack_from(data, attr + _RTATTR.size)
                    out[(_kernel_dev(vdev), vino)].add(ino)
                attr += (alen + 3) & ~3
            at += (length + 3) & ~3


def _diag_socket() -> socket.socket:
    import socket

    return socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_SOCK_DIAG)


def _socket_in(netns_path: str) -> socket.socket:
    """A sock_diag socket created inside the network namespace at `netns_path` (needs CAP_SYS_ADMIN).

    A socket belongs to the namespace it was created in; only the creating
    thread changes namespace, and it is a throwaway thread, so nothing else of
    this process ever runs in the other namespace.
    """
    import ctypes

    setns = ctypes.CDLL(None, use_errno=True).setns
    result: list[socket.socket | OSError] = []

    def enter() -> None:
        try:
            fd = os.open(netns_path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                if setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, os.strerror(err), netns_path)
            finally:
                os.close(fd)
            result.append(_diag_socket())
        except OSError as e:
            result.append(e)

    t = threading.Thread(target=enter, name="kvcached-netns")
    t.start()
    t.join()
    got = result[0]
    if isinstance(got, OSError):
        raise got
    return got


def listening_sockets(netns_path: str | None = None) -> dict[tuple[int, int], set[int]]:
    """(st_dev, st_ino) of each bound file -> inodes of the listening sockets bound to it.

    `netns_path` (e.g. /proc/PID/ns/net) selects another network namespace;
    None means ours. Raises OSError when the namespace cannot be entered or
    sock_diag is unavailable.
    """
    sock = _diag_socket() if netns_path is None else _socket_in(netns_path)
    with sock:
        sock.settimeout(5.0)
        return _dump(sock)
