"""Worker IPC: the listener survives hostile peers and guards its path and directory."""

from __future__ import annotations

import os
import socket
import stat
import struct
import subprocess
import sys
import textwrap

import pytest

from kvcached.node.base.errors import IpcError, SocketInUse, UnsafeDirectory
from kvcached.runtime.ipc.client import Client, ping
from kvcached.runtime.ipc.listener import WorkerListener
from kvcached.runtime.ipc.protocol import MAX_BODY, VERSION

from ..waiting import wait_for
from .helpers import run_as, stale_socket


@pytest.fixture
def listener(layout, uniq):
    w = WorkerListener(layout, uniq, 1, 2, timeout=0.5).start()
    yield w
    w.stop()


def raw(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    s.connect(path)
    return s


def test_ping_and_registry(listener) -> None:
    info = ping(listener.path)
    assert info == {"pid": os.getpid(), "rank": 1, "stage": 2, "version": VERSION, "name": listener.name}
    listener.register("echo", lambda args: {"got": args})
    assert Client(listener.path).call("echo", offsets=[1, 2], group_id=0) == {"got": {"offsets": [1, 2], "group_id": 0}}
    with pytest.raises(IpcError, match="unknown command"):
        Client(listener.path).call("nope")
    listener.register("boom", lambda args: 1 / 0)
    with pytest.raises(IpcError, match="ZeroDivisionError"):
        Client(listener.path).call("boom")
    assert ping(listener.path)["pid"] == os.getpid()


def test_private_directory_and_node(listener, layout, uniq) -> None:
    for d in (layout.socket_dir(uniq), layout.stage_dir(uniq, 2)):
        st = os.lstat(d)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
    assert stat.S_IMODE(os.lstat(listener.path).st_mode) == 0o600


def test_survives_bare_connects_half_oversized_and_garbage_frames(listener) -> None:
    for _ in range(20):
        raw(listener.path).close()  # what kills an upstream listener
    s = raw(listener.path)
    s.sendall(b"KV\x01")  # half a header, then silence: the slow-peer timeout ends it
    s2 = raw(listener.path)
    s2.sendall(struct.pack(">2sBBI", b"KV", VERSION, 1, MAX_BODY + 1))  # over the cap
    assert b"exceeds" in s2.recv(4096)
    s3 = raw(listener.path)
    s3.sendall(b"\x00\x00\x00\x10" + b"\x80\x04pickle!!" * 2)  # an upstream pickle frame
    assert b"bad magic" in s3.recv(4096)
    s4 = raw(listener.path)
    s4.sendall(struct.pack(">2sBBI", b"KV", VERSION, 1, 5) + b"[1,2]")
    assert b"not a JSON object" in s4.recv(4096)
    s5 = raw(listener.path)
    s5.sendall(struct.pack(">2sBBI", b"KV", 99, 1, 2) + b"{}")
    assert b"version 99 not supported" in s5.recv(4096)
    assert ping(listener.path)["rank"] == 1  # answered while the slow peer still hangs
    s.settimeout(30)  # the listener's own timeout (0.5 s) closes it long before: no sleep to guess
    assert s.recv(16) == b""  # the slow peer was timed out, not served forever
    for x in (s, s2, s3, s4, s5):
        x.close()
    assert ping(listener.path)["rank"] == 1


def test_sixteen_slow_peers_are_served_and_the_rest_shed_at_once(layout, uniq) -> None:
    # A timeout far beyond the test keeps every slow peer in its slot: nothing frees one but us.
    w = WorkerListener(layout, uniq, 1, 2, timeout=120).start()
    hogs = [raw(w.path) for _ in range(16)]
    extra = [raw(w.path) for _ in range(8)]
    try:
        # The listener accepts in connection order: the 16 hogs took every slot, so each
        # later peer is closed at once (shed), never queued behind them.
        for s in extra:
            s.settimeout(30)
            try:
                assert s.recv(16) == b"", "a peer past the cap was answered instead of shed"
            except TimeoutError:
                raise AssertionError("a peer past the cap was neither shed nor answered in 30 s: queued") from None
        for h in hogs:
            h.setblocking(False)
            with pytest.raises(BlockingIOError):  # open and waiting for our request: served, not shed
                h.recv(16)
        with pytest.raises(IpcError, match="Broken pipe|Connection reset|closed after 0 of"):  # shed too
            ping(w.path, timeout=30)
        hogs.pop().close()  # one slot frees as its handler sees the close
        wait_for(lambda: _answers(w.path), timeout=30, explain=lambda: "no slot freed after a peer left")
    finally:
        for x in hogs + extra:
            x.close()
        w.stop()


def _answers(path: str) -> bool:
    try:
        return ping(path, timeout=30)["rank"] == 1
    except IpcError:
        return False  # shed: its slot is not free yet


def test_refuses_a_live_conflict_naming_its_pid(layout, uniq) -> None:
    path = layout.socket_path(uniq, 0)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import socket, os, sys
        os.makedirs(os.path.dirname({path!r}), mode=0o700, exist_ok=True)
        s = socket.socket(socket.AF_UNIX); s.bind({path!r}); s.listen(1)
        print("up", flush=True); sys.stdin.read()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "up"
        with pytest.raises(SocketInUse) as e:
            WorkerListener(layout, uniq, 0).start()
        assert e.value.pids == (holder.pid,) and str(holder.pid) in str(e.value)
        assert os.path.exists(path)
    finally:
        holder.kill()
        holder.wait()


def test_replaces_a_stale_node_and_stop_cleans_up(layout, uniq) -> None:
    path = layout.socket_path(uniq, 0, 1)
    os.makedirs(layout.socket_dir(uniq), mode=0o700)
    os.makedirs(os.path.dirname(path), mode=0o700)
    stale_socket(path)
    w = WorkerListener(layout, uniq, 0, 1).start()
    assert ping(path)["pid"] == os.getpid()
    w.stop()
    assert not os.path.exists(layout.socket_dir(uniq))


def test_a_sigterm_handler_stopping_it_during_start_does_not_deadlock(layout, uniq) -> None:
    """A handler that calls stop() runs on the main thread, possibly inside the main thread's start().

    start() holds the listener's lock there; stop() used to wait for that lock
    for ever (a worker SIGTERMed right as it began serving hung, 10 of 60 times
    on a busy machine). Now the stop waits for start() to return, which stops.
    Run in a child, so that a deadlock shows as a timeout, not a hung suite.
    """
    code = textwrap.dedent(f"""
        import os, signal
        from kvcached.node.base.layout import Layout
        from kvcached.runtime.ipc.listener import WorkerListener

        w = WorkerListener(Layout({layout.root!r}), {uniq!r}, 0)
        signal.signal(signal.SIGTERM, lambda *_: w.stop())
        clear = w._clear_path

        def clear_then_sigterm():  # inside start(), with its lock held
            clear()
            os.kill(os.getpid(), signal.SIGTERM)

        w._clear_path = clear_then_sigterm
        w.start()
        print("serving" if os.path.exists(w.path) else "stopped", os.path.exists({layout.socket_dir(uniq)!r}))
    """)
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("stop() from a signal handler during start() deadlocked")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["stopped", "False"], r.stdout + r.stderr


def test_stop_leaves_directory_while_a_peer_holds_the_lease(layout, uniq) -> None:
    a = WorkerListener(layout, uniq, 0).start()
    b = WorkerListener(layout, uniq, 1).start()
    a.stop()
    assert sorted(os.listdir(layout.socket_dir(uniq))) == ["w1.sock"]
    b.stop()
    assert not os.path.exists(layout.socket_dir(uniq))


def test_refuses_foreign_things_at_its_path(layout, uniq) -> None:
    path = layout.socket_path(uniq, 0)
    os.makedirs(layout.socket_dir(uniq), mode=0o700)
    os.mkfifo(path)
    with pytest.raises(SocketInUse, match="not a socket"):
        WorkerListener(layout, uniq, 0).start()
    assert stat.S_ISFIFO(os.lstat(path).st_mode)


def test_refuses_unsafe_directories(layout, uniq, tmp_path, unpriv_user) -> None:
    d = layout.socket_dir(uniq)
    os.symlink(tmp_path, d)
    with pytest.raises(UnsafeDirectory, match="symbolic link"):
        WorkerListener(layout, uniq, 0).start()
    os.unlink(d)
    os.makedirs(d, mode=0o777)
    os.chmod(d, 0o777)
    with pytest.raises(UnsafeDirectory, match="lets others write"):
        WorkerListener(layout, uniq, 0).start()
    os.chmod(d, 0o700)
    os.chown(d, unpriv_user.pw_uid, unpriv_user.pw_gid)
    with pytest.raises(UnsafeDirectory, match="owned by uid"):
        WorkerListener(layout, uniq, 0).start()
    assert os.listdir(d) == [] and os.listdir(tmp_path) == []


def test_peer_credentials_are_checked(layout, uniq, unpriv_user) -> None:

    w = WorkerListener(layout, uniq, 0).start()
    try:
        # Let the other user reach the node, so that only SO_PEERCRED stands in the way.
        os.chmod(layout.socket_dir(uniq), 0o755)
        os.chmod(w.path, 0o666)
        code = textwrap.dedent("""
            import sys
            from kvcached.runtime.ipc.client import ping
            try:
                ping(sys.argv[1]); print("served")
            except Exception as e:
                print("refused", e)
        """)
        out = run_as(unpriv_user, code, w.path)
        assert out.stdout.startswith("refused"), (out.stdout, out.stderr)
        assert ping(w.path)["pid"] == os.getpid()
    finally:
        os.chmod(layout.socket_dir(uniq), 0o700)
        w.stop()
