"""Owner-side cleanup objects (what the engine owner runs after its engines exit)."""

from __future__ import annotations

import os
import signal
import threading

from kvcached.node.in_engine.captured import SegmentCleanup, WorkerSocketCleanup
from kvcached.node.state.segment import create_segment
from kvcached.runtime.harness import start_deployment
from kvcached.runtime.ipc.client import ping

from .helpers import live_socket, stale_socket, stop_one_kill_rest


def test_sigkilled_workers_leave_nothing_after_owner_cleanup(layout, uniq, deployments) -> None:
    dep = start_deployment(uniq, tp=2, pp=2, layout=layout)
    deployments.append(dep)
    socks, seg = WorkerSocketCleanup(layout, uniq, 2, 2), SegmentCleanup(layout, uniq)
    assert socks.capture() == 4 and seg.capture()
    dep.kill()
    r = socks.cleanup()
    assert r.complete and len(r.removed) == 6  # 4 nodes, pp1 and the root directory
    assert seg.cleanup().removed == (layout.segment_path(uniq),)
    assert os.listdir(layout.tmp_dir) == [] and os.listdir(layout.shm_dir) == []
    assert socks.cleanup().removed == () and seg.cleanup().removed == ()


def test_stopped_worker_keeps_its_socket_until_it_exits_then_retry_removes(layout, uniq, deployments) -> None:
    dep = start_deployment(uniq, tp=2, layout=layout)
    deployments.append(dep)
    socks = WorkerSocketCleanup(layout, uniq, 2)
    socks.capture()
    stopped = stop_one_kill_rest(dep)
    r = socks.cleanup()
    assert not r.complete
    assert r.removed == (layout.socket_path(uniq, 0),)
    assert [p for p, _ in r.kept] == [layout.socket_path(uniq, 1)]
    assert os.path.exists(layout.socket_dir(uniq))
    os.kill(stopped, signal.SIGCONT)
    assert ping(layout.socket_path(uniq, 1))["pid"] == stopped  # untouched and still answering
    os.kill(stopped, signal.SIGKILL)
    dep.wait()
    r = socks.cleanup()
    assert r.complete and r.removed == (layout.socket_path(uniq, 1), layout.socket_dir(uniq))


def test_node_recreated_after_capture_is_never_claimed(layout, uniq) -> None:
    path = layout.socket_path(uniq, 0)
    stale_socket(path)
    socks = WorkerSocketCleanup(layout, uniq, 1)
    assert socks.capture() == 1
    os.unlink(path)
    stale_socket(path)  # a same-name successor's node, dead or alive: not ours
    r = socks.cleanup()
    assert r.removed == () and r.complete
    assert os.path.exists(path)


def test_live_replacement_node_stays(layout, uniq) -> None:
    path = layout.socket_path(uniq, 0)
    stale_socket(path)
    socks = WorkerSocketCleanup(layout, uniq, 1)
    socks.capture()
    os.unlink(path)
    s = live_socket(path)
    try:
        assert socks.cleanup().removed == ()
        assert os.path.exists(path)
    finally:
        s.close()


def test_nodes_absent_at_capture_are_never_claimed(layout, uniq) -> None:
    socks = WorkerSocketCleanup(layout, uniq, 2)
    assert socks.capture() == 0
    stale_socket(layout.socket_path(uniq, 0))
    stale_socket(layout.socket_path(uniq, 1))
    assert socks.cleanup().removed == ()
    assert len(os.listdir(layout.socket_dir(uniq))) == 2


def test_repeated_cleanup_leaves_a_successors_directory(layout, uniq) -> None:
    stale_socket(layout.socket_path(uniq, 0))
    socks = WorkerSocketCleanup(layout, uniq, 1)
    socks.capture()
    assert socks.cleanup().complete
    assert not os.path.exists(layout.socket_dir(uniq))
    os.makedirs(layout.socket_dir(uniq))  # a successor between its makedirs and its bind
    for _ in range(3):
        assert socks.cleanup().removed == ()
    assert os.path.isdir(layout.socket_dir(uniq))


def test_partial_cleanup_removes_directory_only_in_the_call_that_empties_it(layout, uniq) -> None:
    stale_socket(layout.socket_path(uniq, 0))
    keeper = live_socket(layout.socket_path(uniq, 1))
    socks = WorkerSocketCleanup(layout, uniq, 2)
    socks.capture()
    r1 = socks.cleanup()
    assert r1.removed == (layout.socket_path(uniq, 0),)
    keeper.close()  # its listener goes away; the node is now stale
    r2 = socks.cleanup()
    assert r2.removed == (layout.socket_path(uniq, 1), layout.socket_dir(uniq))


def test_cleanup_is_thread_safe(layout, uniq) -> None:
    for r in range(8):
        stale_socket(layout.socket_path(uniq, r))
    socks = WorkerSocketCleanup(layout, uniq, 8)
    socks.capture()
    results = []
    threads = [threading.Thread(target=lambda: results.append(socks.cleanup())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    removed = [p for r in results for p in r.removed]
    assert len(removed) == len(set(removed)) == 9
    assert not os.path.exists(layout.socket_dir(uniq))


def test_cleanup_never_raises(layout, uniq) -> None:
    socks = WorkerSocketCleanup(layout, uniq, 1)
    assert socks.cleanup().removed == ()  # never captured
    stale_socket(layout.socket_path(uniq, 0))
    socks.capture()
    os.unlink(layout.socket_path(uniq, 0))
    os.rmdir(layout.socket_dir(uniq))
    with open(layout.socket_dir(uniq), "w") as f:  # a file where its directory was
        f.write("x")
    r = socks.cleanup()
    assert r.removed == () and r.complete
    assert os.path.isfile(layout.socket_dir(uniq))


def test_segment_cleanup_pins_inode(layout, uniq) -> None:
    path = layout.segment_path(uniq)
    create_segment(path, 1)
    seg = SegmentCleanup(layout, uniq)
    assert seg.capture()
    os.unlink(path)
    create_segment(path, 2)  # a successor's segment under the same name
    r = seg.cleanup()
    assert r.removed == () and r.complete
    assert os.path.exists(path)
    assert not SegmentCleanup(layout, "absent").capture()


def test_segment_cleanup_keeps_a_segment_a_successor_leased(layout, uniq) -> None:
    from kvcached.node.state.lease import SegmentLease

    path = layout.segment_path(uniq)
    create_segment(path, 1)
    seg = SegmentCleanup(layout, uniq)
    seg.capture()
    with SegmentLease(path):
        r = seg.cleanup()
    assert r.removed == () and os.path.exists(path)


def test_directory_left_by_workers_that_removed_their_own_nodes_is_removed(layout, uniq) -> None:
    # Workers stopping together each see the other's lease and leave the directory;
    # the owner, seeing its captured nodes gone, removes the directory it captured.
    for r in range(2):
        stale_socket(layout.socket_path(uniq, r, 1))
    socks = WorkerSocketCleanup(layout, uniq, 2, 2)
    assert socks.capture() == 2
    for r in range(2):
        os.unlink(layout.socket_path(uniq, r, 1))
    r = socks.cleanup()
    assert r.complete and r.removed == (layout.stage_dir(uniq, 1), layout.socket_dir(uniq))
    assert not os.path.exists(layout.socket_dir(uniq))


def test_a_successors_recreated_directory_is_kept_when_nodes_vanished(layout, uniq) -> None:
    stale_socket(layout.socket_path(uniq, 0))
    socks = WorkerSocketCleanup(layout, uniq, 1)
    socks.capture()
    os.unlink(layout.socket_path(uniq, 0))
    os.rmdir(layout.socket_dir(uniq))
    os.makedirs(layout.socket_dir(uniq))  # a successor, between its makedirs and its bind
    r = socks.cleanup()
    assert r.complete and r.removed == ()
    assert os.path.isdir(layout.socket_dir(uniq))
