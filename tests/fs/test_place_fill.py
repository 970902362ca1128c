"""Every place's fill (docs/PLACES.md §6): statvfs of real filesystems, what fills them, the metrics and doctor.

The node of tests/fs/fill_node.py is built in a private mount namespace with real small tmpfs mounts (the
host's /dev/shm of 64 MiB, a pod's 8 MiB memory-backed volume) and a live process mapping one buffer; the
installed kvctl runs there. The rest measures tmp_path's own filesystem, whose statvfs is the real one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvcached.node.base.place import HOST, Place, PlaceKind, Seen
from kvcached.node.ops.metrics import render_place_fill
from kvcached.node.ops.rounds import PlaceResult
from kvcached.node.places.fill import Fill, measure
from kvcached.node.places.run import PlacePlan

from ..schemas import validate

NODE = str(Path(__file__).with_name("fill_node.py"))
KVCTL = str(Path(sys.executable).with_name("kvctl"))
MIB = 1 << 20

root_only = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                               reason="tmpfs mounts in a private mount namespace need root and unshare(1)")


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("fill")
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", sys.executable, NODE, str(base), KVCTL],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def _place(doc: dict[str, Any], kind: str) -> dict[str, Any]:
    found = [p for p in doc["places"] if p["kind"] == kind]
    assert len(found) == 1, doc["places"]
    return found[0]


@root_only
def test_inspect_gives_every_place_its_size_use_and_what_fills_it(node: dict[str, Any]) -> None:
    doc = node["inspect"]
    validate(doc, "inspect")
    host, pod = _place(doc, "host"), _place(doc, "pod_volume")
    assert host["capacity_bytes"] == 64 * MIB and pod["capacity_bytes"] == 8 * MIB
    # tmpfs counts the pages written: each file's bytes, nothing of its own.
    assert host["used_bytes"] == 61 * MIB and host["used_percent"] == pytest.approx(95.31, abs=0.01)
    assert pod["used_bytes"] == 3 * MIB + 7 * MIB // 2 + MIB // 2
    assert pod["fills"]["by_kind"] == [{"kind": "vllm-shm", "entries": 2, "live_bytes": 3 * MIB,
                                        "stale_bytes": 7 * MIB // 2, "kept_bytes": 0}]
    assert pod["fills"]["unattributed_bytes"] == MIB // 2  # notours.bin: counted in the use, matched by no family
    largest = pod["fills"]["largest"]
    assert [(h["path"], h["state"]) for h in largest] == [(node["dead_pod"], "stale"), (node["live"], "live")]
    assert largest[1]["pids"] == [node["holder"]]
    assert (pod["pod"], pod["namespace"], pod["volume"]) == ("vllm-0", "serving", "dshm")
    text = node["inspect_text"]
    assert "fill: 95% of 64M used (61M): vllm-shm (stale 61M)" in text
    assert "fill: 88% of 8M used (7M): vllm-shm (live 3M, stale 3.5M); 512K in files no family names" in text
    assert f"{node['live']} 3M (live, PID {node['holder']})" in text


@root_only
def test_doctor_capacity_fails_at_95_and_warns_at_85_naming_the_pod_and_what_fills_it(node: dict[str, Any]) -> None:
    validate(node["doctor"], "doctor")
    assert node["doctor_rc"] == 8  # unhealthy: a failure
    # Only this node's two places: another suite's container, as full, would be a line of its own.
    checks = {c["details"]["place"]["kind"]: c for c in node["doctor"]["checks"]
              if c["details"].get("place", {}).get("path") in (node["root"], node["vol"])}
    assert set(checks) == {"host", "pod_volume"}
    host, pod = checks["host"], checks["pod_volume"]
    assert host["status"] == "fail" and host["summary"].startswith("host is 95% full (61M of 64M): vllm-shm")
    assert "gc --engines --yes frees the 61M the dead hold" in host["fix"]
    assert pod["status"] == "warn" and pod["summary"].startswith("pod serving/vllm-0, volume dshm")
    assert "88% full" in pod["summary"] and "live 3M, stale 3.5M" in pod["summary"]
    assert "gc -A --engines --yes frees the 3.5M" in pod["fix"] and "sizeLimit" in pod["fix"]


@root_only
def test_top_and_watch_show_every_places_fill_and_the_host_s_alone_without_a(node: dict[str, Any]) -> None:
    pod = "pod serving/vllm-0, volume dshm"
    for text in (node["top"], node["watch"]):
        rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith(("host ", "pod "))}
        assert rows["host"][1:5] == ["95%", "61M", "64M", "##########"], text
        [row] = [line for line in text.splitlines() if line.startswith(pod)]
        assert " 88% " in row and " 7M " in row and " 8M " in row and "#########." in row, row
    assert "host " in node["top_host"] and pod not in node["top_host"]


def _series(prom: str, name: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf"^{name}\{{(.*)\}} (\S+)$", prom, re.M)}


@root_only
def test_the_metrics_give_each_place_its_series_and_drop_a_place_that_is_gone(node: dict[str, Any]) -> None:
    assert node["gc_rc"] == 0 and not os.path.exists(node["dead_host"]) and not os.path.exists(node["dead_pod"])
    pod = ('kind="pod_volume",pod_uid="7f3c0000-1111-4222-8333-444455556666",pod="vllm-0",namespace="serving",'
           'volume="dshm",device="')
    # -A sees every mount namespace of the machine: other suites' containers are places too, so only this node's
    # two are looked at.
    def ours(name: str, prom: str = node["prom"]) -> dict[str, float]:
        return {k: v for k, v in _series(prom, name).items() if k.startswith((pod, 'kind="host"'))}

    cap, used, stale = (ours(f"kvctl_place_{m}_bytes") for m in ("capacity", "used", "stale"))
    [pod_key] = [k for k in cap if k.startswith(pod)]
    [host_key] = [k for k in cap if k.startswith('kind="host"')]
    assert cap == {host_key: 64 * MIB, pod_key: 8 * MIB}
    # Measured after the act: the dead buffers are gone, the live one and the file no family names stay.
    assert used == {host_key: 0, pod_key: 3 * MIB + MIB // 2} and stale == {host_key: 0, pod_key: 0}
    after = ours("kvctl_place_capacity_bytes", node["prom_after"])
    assert after == {host_key: 64 * MIB}, "the gone pod's series are not written again"


def test_measure_is_the_filesystems_statvfs(tmp_path: Path) -> None:
    st = os.stat(tmp_path)
    fill = measure(Place(PlaceKind.MOUNT_NAMESPACE, str(tmp_path), Seen.SHM, st.st_dev))
    vfs = os.statvfs(tmp_path)
    assert fill.error is None and fill.capacity_bytes == vfs.f_blocks * vfs.f_frsize
    assert fill.used_bytes is not None and 0 <= fill.used_bytes <= fill.capacity_bytes
    assert fill.device == f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def test_a_place_no_longer_on_its_filesystem_is_not_measured(tmp_path: Path) -> None:
    st = os.stat(tmp_path)
    moved = measure(Place(PlaceKind.POD_VOLUME, str(tmp_path), Seen.SHM, st.st_dev + 1))
    assert moved.capacity_bytes is None and moved.used_bytes is None
    assert moved.error is not None and "no longer the filesystem found there" in moved.error
    (tmp_path / "link").symlink_to(tmp_path)
    linked = measure(Place(PlaceKind.POD_VOLUME, str(tmp_path / "link"), Seen.SHM, st.st_dev))
    assert linked.capacity_bytes is None and linked.error is not None  # a link at the place is not followed
    gone = measure(Place(PlaceKind.POD_VOLUME, str(tmp_path / "absent"), Seen.SHM, st.st_dev))
    assert gone.error is not None and gone.percent is None


def test_one_series_per_place_and_one_for_places_that_are_one_filesystem_under_the_same_labels() -> None:
    def result(place: Place, fill: Fill) -> PlaceResult:
        return PlaceResult(PlacePlan(place), fill=fill)

    a = Place(PlaceKind.MOUNT_NAMESPACE, "/proc/10/root/tmp", Seen.TMP, 5, 11)
    b = a._replace(path="/proc/20/root/tmp", ino=12)  # two PrivateTmp= directories of one filesystem
    v1 = Place(PlaceKind.POD_VOLUME, "/k/pods/u/volumes/kubernetes.io~empty-dir/a", Seen.SHM, 7, 1, pod_uid="u",
               pod="p", volume="a")
    v2 = v1._replace(path="/k/pods/u/volumes/kubernetes.io~empty-dir/b", dev=8, volume="b")
    no_size = Place(PlaceKind.SANDBOX, "/run/x/shm", Seen.SHM, 9, 1, container="c")
    text = render_place_fill([result(HOST, Fill(100, 10, "0:1")), result(a, Fill(50, 5, "0:5")),
                              result(b, Fill(50, 5, "0:5")), result(v1, Fill(64, 60, "0:7")),
                              result(v2, Fill(64, 1, "0:8")), result(no_size, Fill(None, None, "0:9", "no size"))])
    cap = _series(text, "kvctl_place_capacity_bytes")
    assert cap == {'kind="host",device="0:1"': 100, 'kind="mount_namespace",device="0:5"': 50,
                   'kind="pod_volume",pod_uid="u",pod="p",volume="a",device="0:7"': 64,
                   'kind="pod_volume",pod_uid="u",pod="p",volume="b",device="0:8"': 64}
    # A place without a size writes no size and no use; a run that judged no leftovers writes no stale bytes.
    assert 'kind="sandbox",container="c",device="0:9"' not in _series(text, "kvctl_place_used_bytes")
    assert "kvctl_place_stale_bytes" not in text
