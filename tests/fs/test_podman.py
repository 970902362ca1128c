"""kvctl -A on real podman pods: the infra keeps the pod's /dev/shm, app containers die in it (root, podman).

tests/fs/podman_pods.py says how the pods run on this machine kind. Podman's
layout is CRI-O's: the pod's shm under the storage root, the infra's PID in
`userdata/pidfile` under the run root. Each app container's main process is
PID 1 of its own PID namespace, and so is the infra: a killed app's
`sgl_shm_*_1_*` names PID 1, which the infra still is. The runtime's pidfile
says the infra is the sandbox's holder, so it is no creator candidate
(kvcached/node/places/sandbox.py).

-A judges every mount namespace of the machine: this module shares an xdist
unit with tests/fs/test_places.py (tests/conftest.py, PLACES_TESTS), so
neither judges the other's pods mid-test.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from ..schemas import validate
from .podman_pods import Pod, PodmanNode, missing

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or bool(missing()),
                                reason=f"podman pods need root and {', '.join(missing()) or 'nothing'}")


@pytest.fixture(scope="module")
def node() -> Iterator[PodmanNode]:
    n = PodmanNode()
    try:
        yield n
    finally:
        n.close()


def _dead_then_live(node: PodmanNode, pod: Pod) -> tuple[dict[str, Any], dict[str, Any]]:
    """An app that makes its files and is SIGKILLed, then a live one started after (as the kubelet restarts)."""
    dead = node.app(pod, f"{pod.name}-dead")
    node.kill(f"{pod.name}-dead")
    # A creator must have started no later than the file last changed (with a second's slack): the live app
    # starts after the dead one's files, so its PID 1 is not theirs.
    time.sleep(1.5)
    live = node.app(pod, f"{pod.name}-live")
    return dead, live


@pytest.fixture(scope="module")
def pod(node: PodmanNode) -> tuple[Pod, dict[str, Any], dict[str, Any]]:
    p = node.pod("kvp-main")
    dead, live = _dead_then_live(node, p)
    return p, dead, live


def _doc(node: PodmanNode, *args: str) -> dict[str, Any]:
    r = node.kvctl(*args)
    assert r.returncode in (0, 3), (r.returncode, r.stderr)
    return json.loads(r.stdout)


def _in(shm_entries: list[dict[str, Any]], pod: Pod) -> dict[str, dict[str, Any]]:
    return {os.path.basename(e["path"]): e for e in shm_entries if e["path"].startswith(pod.shm + "/")}


def _files(pod: Pod) -> set[str]:
    # The pod's tmpfs is mounted in the node's namespace only; the infra's root shows it from anywhere.
    return set(os.listdir(f"/proc/{pod.infra_pid}/root/dev/shm"))


def test_inspect_names_the_pods_place_by_its_infra_container(node: PodmanNode, pod: Any) -> None:
    p, _, live = pod
    doc = _doc(node, "inspect", "-A")
    validate(doc, "inspect")
    [place] = [pl for pl in doc["places"] if pl["path"] == p.shm]
    assert place["kind"] == "sandbox" and place["runtime"] == "cri-o"
    assert place["container"] == p.infra_id
    assert p.infra_id[:12] in place["label"]
    assert place["holder"] == p.infra_pid and place["holder_note"] is None
    assert p.infra_pid in place["pids"] and live["host_pid"] in place["pids"]
    # The infra's image has no /tmp: nothing to judge there, and nothing to report as unreadable.
    assert not any(f"/proc/{p.infra_pid}/root/tmp" in e for pl in doc["places"] for e in pl["errors"])


def test_gc_removes_a_killed_apps_files_and_keeps_the_live_apps(node: PodmanNode, pod: Any) -> None:
    p, dead, live = pod
    dry = _doc(node, "gc", "-A", "--engines", "--dry-run")
    validate(dry, "gc")
    seen = _in(dry["entries"], p)
    for role in ("closed", "mapped", "held"):
        e = seen[dead[role]]
        assert (e["state"], e["action"]) == ("stale", "would_remove"), e
        assert p.infra_pid not in e["pids"], e
    assert (seen[live["closed"]]["state"], seen[live["closed"]]["reason"]) == ("live", "creator_alive")
    assert seen[live["closed"]]["pids"] == [live["host_pid"]]
    assert (seen[live["mapped"]]["state"], seen[live["mapped"]]["reason"]) == ("live", "mapped")
    assert (seen[live["held"]]["state"], seen[live["held"]]["reason"]) == ("live", "held_open")

    done = _doc(node, "gc", "-A", "--engines", "--yes")
    removed = {os.path.basename(e["path"]) for e in done["entries"] if e["action"] == "removed"}
    assert removed >= {dead["closed"], dead["mapped"], dead["held"]}
    left = _files(p)
    assert not left & {dead["closed"], dead["mapped"], dead["held"]}
    assert {live["closed"], live["mapped"], live["held"]} <= left


def test_a_sandbox_whose_runtime_state_cannot_be_read_keeps_todays_rule(node: PodmanNode) -> None:
    p = node.pod("kvp-blind")
    dead = node.app(p, "kvp-blind-dead")
    node.kill("kvp-blind-dead")
    pidfile = f"{node.base}/run/containers/storage/overlay-containers/{p.infra_id}/userdata/pidfile"
    os.rename(pidfile, pidfile + ".away")
    try:
        doc = _doc(node, "gc", "-A", "--engines", "--dry-run")
    finally:
        os.rename(pidfile + ".away", pidfile)
    [place] = [pl for pl in doc["places"] if pl["path"] == p.shm]
    assert place["holder"] is None and "pidfile" in place["holder_note"]
    e = _in(doc["entries"], p)[dead["closed"]]
    # The infra is PID 1 and started before the file: without the runtime's word it may be the creator.
    assert (e["state"], e["reason"]) == ("live", "creator_alive") and e["pids"] == [p.infra_pid]
    assert "sandbox's own holder" in e["detail"] and "pidfile" in e["detail"]
    assert dead["closed"] in _files(p)


def test_the_agent_reclaims_a_pods_last_apps_fresh_files_when_it_is_killed(node: PodmanNode) -> None:
    p = node.pod("kvp-event")
    app = node.app(p, "kvp-event-app", old=0)  # fresh files: only the event path's rule removes them now
    names = {app[r] for r in ("closed", "mapped", "held")}
    agent = node.agent()
    try:
        assert agent.stdout is not None
        first = json.loads(agent.stdout.readline())
        assert first["schema"] == "kvctl.gc/1"
        # The live app's files are young to the round: the pod's shm is seen by the app, not only its infra.
        assert names <= _files(p)
        killed = time.monotonic()
        node.kill("kvp-event-app")
        while names & _files(p) and time.monotonic() - killed < 60:
            time.sleep(0.05)
        assert not names & _files(p), "the dead app's files are still there a minute after its SIGKILL"
        ev = json.loads(agent.stdout.readline())
        validate(ev, "gc_event")
        assert [pl["path"] for pl in ev["places"]] == [p.shm] and ev["places"][0]["holder"] == p.infra_pid
        assert {os.path.basename(e["path"]) for e in ev["entries"] if e["action"] == "removed"} == names
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(60) in (0, 3), agent.stderr.read() if agent.stderr else ""
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
