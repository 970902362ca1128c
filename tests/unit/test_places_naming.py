"""How a place is named without the API server, and the mount table it is found from: real files on tmp_path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvcached import settings
from kvcached.node.base.layout import Layout
from kvcached.node.base.mounts import read_mountinfo
from kvcached.node.clean.facts import Facts, ProcessInfo
from kvcached.node.places.discover import HOST, Place, PlaceKind, Seen, _cgroup_ids, discover, pod_of_kubelet_dir

UID = "0c1d2e3f-4a5b-4c6d-8e7f-901234567890"
CID = "a" * 64


def _proc(tmp_path: Path, pid: int, **files: str) -> str:
    base = tmp_path / "proc" / str(pid)
    base.mkdir(parents=True)
    for name, text in files.items():
        (base / name).write_text(text)
    return str(tmp_path / "proc")


@pytest.mark.parametrize("cgroup", [
    # systemd driver, cgroup v2: the pod's slice spells the UID with underscores
    f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice/"
    f"cri-containerd-{CID}.scope\n",
    # cgroupfs driver, cgroup v1
    f"12:memory:/kubepods/burstable/pod{UID}/{CID}\n11:cpu:/kubepods/burstable/pod{UID}/{CID}\n",
    f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/crio-{CID}.scope\n",
])
def test_pod_uid_and_container_from_the_cgroup(tmp_path: Path, cgroup: str) -> None:
    assert _cgroup_ids(_proc(tmp_path, 7, cgroup=cgroup), 7) == (UID, CID)


def test_no_pod_in_a_plain_cgroup(tmp_path: Path) -> None:
    assert _cgroup_ids(_proc(tmp_path, 7, cgroup="0::/user.slice/session-3.scope\n"), 7) == (None, None)
    assert _cgroup_ids(str(tmp_path / "proc"), 8) == (None, None)  # gone: nothing, no error


def test_pod_name_and_namespace_from_the_kubelets_pod_directory(tmp_path: Path) -> None:
    pod = tmp_path / "pods" / UID
    (pod / "volumes" / "kubernetes.io~projected" / "kube-api-access-x2v9q").mkdir(parents=True)
    (pod / "etc-hosts").write_text("# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n"
                                   "::1\tlocalhost ip6-localhost\n10.244.1.7\tsglang-0\n")
    assert pod_of_kubelet_dir(str(tmp_path), UID) == ("sglang-0", None)
    (pod / "volumes" / "kubernetes.io~projected" / "kube-api-access-x2v9q" / "namespace").write_text("serving")
    assert pod_of_kubelet_dir(str(tmp_path), UID) == ("sglang-0", "serving")


def test_a_subdomain_names_the_namespace(tmp_path: Path) -> None:
    pod = tmp_path / "pods" / UID
    pod.mkdir(parents=True)
    (pod / "etc-hosts").write_text("10.244.1.7\tsglang-0.workers.serving.svc.cluster.local\tsglang-0\n")
    assert pod_of_kubelet_dir(str(tmp_path), UID) == ("sglang-0", "serving")
    assert pod_of_kubelet_dir(str(tmp_path), "00000000-0000-4000-8000-000000000000") == (None, None)


def test_the_mount_table_gives_each_mounts_device(tmp_path: Path) -> None:
    proc = _proc(tmp_path, 9, mountinfo=(
        "25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=64k\n"
        "40 27 0:51 / /var/lib/kubelet/pods/x/volumes/kubernetes.io~empty-dir/my\\040vol rw - tmpfs tmpfs rw\n"
        "41 27 259:3 / /data rw - ext4 /dev/nvme0n1p3 rw\n"))
    mounts = read_mountinfo(proc, 9)
    assert mounts is not None
    assert [(m.point, m.dev) for m in mounts] == [
        ("/dev/shm", os.makedev(0, 23)),
        ("/var/lib/kubelet/pods/x/volumes/kubernetes.io~empty-dir/my vol", os.makedev(0, 51)),
        ("/data", os.makedev(259, 3))]
    assert read_mountinfo(proc, 10) is None


def test_a_place_judges_only_its_own_directory() -> None:
    shm = Place(PlaceKind.POD_VOLUME, "/k/pods/u/volumes/kubernetes.io~empty-dir/v", Seen.SHM, 5)
    tmp = Place(PlaceKind.MOUNT_NAMESPACE, "/proc/9/root/tmp", Seen.TMP, 6, path_inside="/tmp")
    host = Layout("/r")
    assert (shm.layout(host).shm_dir, shm.layout(host).tmp_dir) == (shm.path, "")
    assert (tmp.layout(host).shm_dir, tmp.layout(host).tmp_dir) == ("", tmp.path)
    assert HOST.layout(host) is host
    assert HOST.to_dict()["kind"] == "host" and shm.to_dict()["device"] == "0:5"


def test_the_sandbox_table_is_one_per_runtime_path() -> None:
    runtimes = {r for r, _, _ in settings.SANDBOX_SHM}
    assert runtimes == {"containerd", "cri-o", "docker"}
    assert all(d.startswith("/") and not below.startswith("/") for _, d, below in settings.SANDBOX_SHM)


def _process(pid: int, mnt_ns: str) -> ProcessInfo:
    return ProcessInfo(pid, 0.0, 1, pid, 0, "python", ("python",), None, frozenset(), frozenset(), mnt_ns, None,
                       frozenset())


def test_a_namespace_whose_mount_table_cannot_be_read_sees_every_place(tmp_path: Path) -> None:
    """Unknown is not proof of absence: its processes stay creator candidates of every place's files."""
    kubelet = tmp_path / "kubelet"
    vol = kubelet / "pods" / UID / "volumes" / "kubernetes.io~empty-dir" / "dshm"
    vol.mkdir(parents=True)
    dev = os.stat(vol).st_dev
    proc = _proc(tmp_path, 8, mountinfo="")  # PID 8: a namespace that mounts nothing of ours
    os.makedirs(f"{proc}/self")
    (Path(proc) / "self" / "mountinfo").write_text(
        f"40 27 {os.major(dev)}:{os.minor(dev)} / {vol} rw - tmpfs tmpfs rw\n")
    os.makedirs(f"{proc}/7")  # PID 7: its mount table is not there to read
    facts = Facts(proc_root=proc, my_mnt_ns="mnt:[1]", my_net_ns=None,
                  processes={7: _process(7, "mnt:[7]"), 8: _process(8, "mnt:[8]")})
    found = discover(facts, Layout(str(tmp_path / "root")), kubelet_dir=str(kubelet))
    [place] = found.others
    assert place.kind is PlaceKind.POD_VOLUME and place.pids == (7,)
    assert any("could not be read" in e for e in found.errors)


def test_a_namespace_is_read_through_its_next_process_when_the_lowest_is_gone(tmp_path: Path) -> None:
    """The lowest PID exited after the /proc pass: its neighbour in the namespace still shows what it sees.

    PIDs 7 and 9 share one namespace that does not mount the pod's volume; 7's mount table is gone. Read
    through 9, the namespace is known, and neither process is taken to see the volume.
    """
    kubelet = tmp_path / "kubelet"
    vol = kubelet / "pods" / UID / "volumes" / "kubernetes.io~empty-dir" / "dshm"
    vol.mkdir(parents=True)
    dev = os.stat(vol).st_dev
    proc = _proc(tmp_path, 9, mountinfo="")
    os.makedirs(f"{proc}/self")
    (Path(proc) / "self" / "mountinfo").write_text(
        f"40 27 {os.major(dev)}:{os.minor(dev)} / {vol} rw - tmpfs tmpfs rw\n")
    os.makedirs(f"{proc}/7")
    facts = Facts(proc_root=proc, my_mnt_ns="mnt:[1]", my_net_ns=None,
                  processes={9: _process(9, "mnt:[7]"), 7: _process(7, "mnt:[7]")})
    found = discover(facts, Layout(str(tmp_path / "root")), kubelet_dir=str(kubelet))
    [place] = found.others
    assert place.kind is PlaceKind.POD_VOLUME and place.pids == ()
    assert not any("could not be read" in e for e in found.errors), found.errors
