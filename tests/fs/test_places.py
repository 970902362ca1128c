"""kvctl -A on a node with pods, from real mount and PID namespaces and real tmpfs mounts (root only).

tests/fs/places_node.py builds the node inside a private mount namespace (nothing of the machine's mount
table changes; the mounts go with it) and runs the installed kvctl there: the scenarios are in its docstring.

-A looks at every mount namespace of the machine, so two of these nodes built at once would judge each
other's containers: the module's tests share one node (a module fixture), and `make test`'s
`--dist loadfile` keeps the file on one worker. Every planted file is backdated an hour and kvctl keeps the
default grace age, so another test's fresh files in a namespace of its own are young to it, never removed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ..schemas import validate

NODE = str(Path(__file__).with_name("places_node.py"))
KVCTL = str(Path(sys.executable).with_name("kvctl"))

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="mount and PID namespaces and tmpfs mounts need root and unshare(1)")


def _run(tmp_path: Path, scenario: str) -> dict[str, Any]:
    base = tmp_path / "node"
    base.mkdir()
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, NODE, str(base), KVCTL,
                        scenario], capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run(tmp_path_factory.mktemp("places"), "node")


def _by_place(doc: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for e in doc["entries"]:
        out.setdefault(e["place"]["path"], []).append(e)
    return out


def _place(doc: dict[str, Any], **match: Any) -> dict[str, Any]:
    found = [p for p in doc["places"] if all(p.get(k) == v for k, v in match.items())]
    assert len(found) == 1, (match, doc["places"])
    return found[0]


def test_the_pod_gc_removes_exactly_the_dead_containers_files(node: dict[str, Any]) -> None:
    gc = node["gc"]["doc"]
    validate(gc, "gc")
    pod = _place(gc, kind="pod_volume", pod_uid=node["uid_a"])
    assert pod["pod"] == "sglang-0" and pod["volume"] == "dshm" and pod["path_inside"] == "/dev/shm"
    assert node["c2"]["host_pid"] in pod["pids"]
    left = set(node["left"]["a"])
    assert not left & set(node["c1"]["names"]), "container 1's files must be gone"
    assert set(node["c2"]["names"]) <= left, "container 2's files are in use"
    entries = {e["path"].rsplit("/", 1)[1]: e for e in _by_place(gc)[pod["path"]]}
    c1_sgl, c2_sgl = node["c1"]["names"][0], node["c2"]["names"][0]
    # Both names carry PID 1 (each container's first process), and so does the host's init: only container 2's
    # PID 1, which sees the volume and started before its own file, is any file's creator.
    assert c1_sgl.split("_")[3] == c2_sgl.split("_")[3] == "1"
    assert entries[c1_sgl]["action"] == "removed" and entries[c1_sgl]["reason"] == "pid_reused"
    assert entries[c2_sgl]["reason"] == "creator_alive" and entries[c2_sgl]["pids"] == [node["c2"]["host_pid"]]
    assert entries[node["c2"]["names"][1]]["reason"] == "mapped"
    assert entries[node["c2"]["names"][2]]["reason"] == "held_open"
    assert all(e["place"]["kind"] == "pod_volume" for e in entries.values())
    assert gc["summary"]["entries"] == len(gc["entries"])
    # Off a terminal (cron), each place's summary goes to stderr, named.
    assert "kvctl gc -A [pod sglang-0, volume dshm at /dev/shm" in node["gc"]["stderr"]


def test_links_and_bind_mounts_in_a_pod_volume_touch_nothing_outside(node: dict[str, Any]) -> None:
    planted = node["planted"]
    assert planted["link"] in node["left"]["a"] and planted["bind"] in node["left"]["a"]
    assert sorted(planted["host_files"]) == node["left"]["outside"]
    entries = {e["path"].rsplit("/", 1)[1]: e for e in node["gc"]["doc"]["entries"]}
    assert entries[planted["link"]]["state"] == "foreign" and entries[planted["link"]]["reason"] == "symlink"
    assert entries[planted["bind"]]["state"] == "foreign" and entries[planted["bind"]]["reason"] == "mount_point"


def test_a_pod_with_no_process_left_loses_its_dead_files(node: dict[str, Any]) -> None:
    gc = node["gc"]["doc"]
    pod = _place(gc, kind="pod_volume", pod_uid=node["uid_b"])
    # A process listed here sees the volume, or is in a namespace kvctl could not read (its errors say which).
    assert pod["pids"] == [], (pod["pids"], gc["errors"], pod["errors"])
    assert pod["path_inside"] is None and pod["pod"] == "sglang-1"
    assert node["left"]["b"] == []
    reasons = {e["reason"] for e in _by_place(gc)[pod["path"]]}
    assert reasons == {"creator_gone", "unused"}


def test_a_container_of_its_own_is_one_place_however_many_processes(node: dict[str, Any]) -> None:
    gc = node["gc"]["doc"]
    host_pid = node["c3"]["host_pid"]
    mine = [p for p in gc["places"] if p["kind"] == "mount_namespace" and host_pid in p["pids"]
            and p["path_inside"] == "/dev/shm"]
    assert len(mine) == 1, gc["places"]
    place = mine[0]
    # Reached through one of them (the lowest PID: here unshare(1) itself, in the namespace it made).
    assert place["path"] == f"/proc/{min(place['pids'])}/root/dev/shm" and place["path_inside"] == "/dev/shm"
    assert len(place["pids"]) >= 3  # unshare, the container's PID 1 and its child
    sgl, psm, nccl = node["c3"]["names"]
    assert node["left"]["c3"] == sorted([sgl, nccl])  # its creator alive; held open; the buffer nobody uses: gone


def test_kvcached_state_inside_a_container_live_kept_dead_removed(node: dict[str, Any]) -> None:
    c4 = node["c4"]
    assert c4["live"] in node["left"]["c4_shm"] and c4["dead"] not in node["left"]["c4_shm"]
    tmp = " ".join(node["left"]["c4_tmp"])
    assert f"kvcached-tp-{c4['live']}-" in tmp and f"kvcached-tp-{c4['dead']}-" not in tmp


def test_a_sandbox_shm_is_a_place(node: dict[str, Any]) -> None:
    gc = node["gc"]["doc"]
    place = _place(gc, kind="sandbox")
    assert place["runtime"] == "containerd" and place["path"] == node["sandbox"]["path"]
    assert node["left"]["sandbox"] == []


def test_the_dry_run_and_inspect_show_the_same_places(node: dict[str, Any]) -> None:
    dry, inspect = node["dry"]["doc"], node["inspect"]["doc"]
    validate(dry, "gc")
    validate(inspect, "inspect")
    assert inspect["places"][0]["kind"] == "host" and dry["places"][0]["kind"] == "host"
    assert {p["path"] for p in dry["places"]} >= {p["path"] for p in node["gc"]["doc"]["places"]} - {"/"}
    pod = _place(inspect, kind="pod_volume", pod_uid=node["uid_a"])
    assert pod["stale_bytes"] >= 3 * 65536  # container 1's three files, what the volume gets back
    assert any(d["place"]["kind"] == "mount_namespace" and d["name"] == node["c4"]["live"]
               for d in inspect["deployments"])


def test_replaced_filesystem_nothing_removed(tmp_path: Path) -> None:
    out = _run(tmp_path, "replace")
    assert set(out["judged"].values()) == {"stale"}
    assert out["left"] == sorted(out["names"])
    assert all(action == "kept" for action, _ in out["actions"].values()), out["actions"]
    assert out["tagged"]


def test_doctor_pods_names_the_pod_its_bytes_and_the_fix(node: dict[str, Any]) -> None:
    doc = node["doctor"]["doc"]
    validate(doc, "doctor")
    warned = [c for c in doc["checks"] if c["name"] == "pods" and c["status"] == "warn"]
    pod = next(c for c in warned if c["details"]["place"]["pod_uid"] == node["uid_a"])
    assert "sglang-0" in pod["summary"] and pod["details"]["stale_bytes"] >= 3 * 65536
    assert "gc -A --engines --yes" in pod["fix"]
    assert any(c["details"]["place"]["pod_uid"] == node["uid_b"] for c in warned)


def test_text_groups_by_place_and_metrics_count_by_place_kind(node: dict[str, Any]) -> None:
    text = node["inspect_text"]["doc"]
    assert text.index("== host") < text.index("== pod sglang-0, volume dshm at /dev/shm")
    assert "gc -A --engines --yes removes the stale" in text
    dry = node["dry_text"]["doc"]
    assert "== pod sglang-1, volume cache" in dry and "== sandbox, container " in dry
    samples = dict(line.rsplit(" ", 1) for line in node["metrics"].splitlines() if line and not line.startswith("#"))
    assert samples['kvctl_gc_places{place_kind="pod_volume"}'] == "2"
    assert samples['kvctl_gc_places{place_kind="sandbox"}'] == "1"
    # A dry run leaves every stale entry: pod A's three files are the worst place's.
    assert int(samples["kvctl_gc_engine_stale_bytes_max_place"]) >= 3 * 65536
    assert int(samples['kvctl_gc_place_stale_bytes{place_kind="pod_volume"}']) >= 3 * 65536 + 2 * 4096


def test_a_default_name_is_the_group_its_own_namespace_numbers(tmp_path: Path) -> None:
    """kvcached_proc_1 in a pod is PGID 1 of the pod's PID namespace, not the host's init's group."""
    out = _run(tmp_path, "pgid")
    assert out["dead"]["name"] == out["live"]["name"] == "kvcached_proc_1"
    assert out["decided"]["dead"][1:3] == ["stale", "no_owner"]
    assert out["decided"]["live"][1:] == ["live", "group_alive", [out["live"]["host_pid"]]]


def test_a_private_tmp_on_the_hosts_filesystem_is_a_place(node: dict[str, Any]) -> None:
    gc = node["gc"]["doc"]
    c5 = node["c5"]
    place = next(p for p in gc["places"] if c5["pid"] in p["pids"] and p["path_inside"] == "/tmp")
    assert place["kind"] == "mount_namespace" and place["path"] == f"/proc/{c5['pid']}/root/tmp"
    assert node["left"]["privtmp"] == [c5["live"]]
    entries = {e["path"].rsplit("/", 1)[1]: e for e in _by_place(gc)[place["path"]]}
    assert entries[c5["dead"]]["reason"] == "not_listening" and entries[c5["live"]]["reason"] == "listening"


def test_names_with_A_match_in_any_place(node: dict[str, Any]) -> None:
    named = node["named"]["doc"]
    assert named["entries"] and {e["deployment"] for e in named["entries"]} == {node["c4"]["live"]}
    assert all(e["place"]["kind"] == "mount_namespace" for e in named["entries"])
    assert node["nomatch"] == 6


def test_the_event_path_reclaims_a_dead_pods_fresh_files_before_the_next_round(tmp_path: Path) -> None:
    out = _run(tmp_path, "events")
    # Pod A's only container was SIGKILLed: its fresh files went at once, not at the next round (10 min later).
    assert not set(out["a"]["names"]) & set(out["left"]["a"]), out
    assert out["reclaim_s"] < 30, out
    ev = out["event"]
    validate(ev, "gc_event")
    assert ev["exited"] >= 1 and [p["pod"] for p in ev["places"]] == ["crashloop-0"]
    assert {os.path.basename(e["path"]) for e in ev["entries"] if e["action"] == "removed"} == set(out["a"]["names"])
    # Pod B's live container keeps its fresh files, and opens them again by name afterwards.
    assert set(out["b"]["names"]) <= set(out["left"]["b"]) and out["b_reopened"] == "reopened"
    # The host's fresh dead file: a round keeps it young (the host's rules), and no event judges the host.
    assert out["host_file"] in out["left"]["host"]
    assert out["round"]["schema"] == "kvctl.gc/1" and out["loop_exit"] in (0, 3), out["loop_stderr"]
    # SIGTERM during a judgement: the place in hand is finished, the other waits for the next run.
    assert out["stopped"] == {"keys": 2, "judged": 1, "left": [0, 1]} or \
        out["stopped"] == {"keys": 2, "judged": 1, "left": [1, 0]}, out["stopped"]


def test_a_container_restarted_between_the_judgement_and_the_act_defers_the_removal(tmp_path: Path) -> None:
    out = _run(tmp_path, "restart")
    names = set(out["dead"]["names"])
    # Fresh files, but the volume was seen by no live process: judged without a grace age, stale.
    assert {out["judged"][n] for n in names} == {"stale"}, out["judged"]
    assert {out["given"][n] for n in names} == {"young"}, out["given"]  # --min-age given: it holds everywhere
    # The new container saw the volume before the act: nothing removed, and why is said.
    assert names <= set(out["left"]), out
    assert all(out["acted"][n][0] == "kept" and "started since the judgement" in out["acted"][n][1] for n in names)
    # With the new container gone too, the next judgement removes the dead one's files (and the new one's).
    assert names <= set(out["removed"]), out
