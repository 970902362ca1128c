"""Every place on the node where kvcached state or engine leftovers can live, found from one /proc pass.

A place is one directory that someone uses as /dev/shm or /tmp, on its own filesystem or not:

- the host's own /dev/shm and /tmp (the layout's; `HOST`);
- a memory-backed emptyDir, a tmpfs mounted at
  `<kubelet dir>/pods/<uid>/volumes/kubernetes.io~empty-dir/<volume>`: it stays
  mounted while the pod's containers crash-loop, with no process of the pod left;
- a container runtime's per-sandbox /dev/shm (settings.SANDBOX_SHM);
- any other filesystem that some process sees at /dev/shm or /tmp in its own
  mount namespace (a container, a PrivateTmp= service), reached through
  /proc/<pid>/root of one of its processes.

One place per directory (its st_dev and st_ino), however many processes,
namespaces or mounts share it: a PrivateTmp= service's /tmp is a directory of
the host's root filesystem, and two containers may each get a subdirectory of
one tmpfs. A directory found twice keeps the first, most stable way in (the
kubelet's or the runtime's path before a process's root, which dies with the
process).
Each mount namespace's mount table is read once, from one of its processes,
so the pass costs namespaces + processes, never places × processes.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from ... import settings
from ..base.layout import Layout
from ..base.mounts import Mount, read_mountinfo
from ..base.place import HOST, HOST_PLACE, Place, PlaceKind, Seen
from ..clean.facts import Facts
from .sandbox import holder_of

__all__ = ["HOST", "HOST_PLACE", "Place", "PlaceKind", "Places", "Seen", "discover"]

_INSIDE = {Seen.SHM: "/dev/shm", Seen.TMP: "/tmp"}




@dataclass
class Places:
    """Every place one pass found, host first, and which processes see each place's filesystem."""

    host: Place
    others: list[Place]
    # device -> PIDs whose mount namespace mounts it (not at the kubelet's or a runtime's bookkeeping path)
    viewers: dict[int, tuple[int, ...]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def all(self) -> list[Place]:
        return [self.host, *self.others]


_UID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
# The systemd cgroup driver spells the pod's UID with underscores (kubepods-burstable-pod<uid>.slice).
_CGROUP_POD = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
# The last component of a container's cgroup: cri-containerd-<id>.scope, crio-<id>.scope, docker-<id>.scope,
# or the bare id (cgroupfs driver).
_CGROUP_CONTAINER = re.compile(r"(?:^|[-/])([0-9a-f]{64})(?:\.scope)?$")


def _emptydir_re(kubelet_dir: str) -> re.Pattern[str]:
    base = re.escape(kubelet_dir.rstrip("/"))
    return re.compile(rf"{base}/pods/({_UID})/volumes/kubernetes\.io~empty-dir/([^/]+)")


def _sandbox_res(root: str) -> list[tuple[str, re.Pattern[str]]]:
    out = []
    for runtime, directory, below in settings.SANDBOX_SHM:
        base = os.path.normpath(os.path.join(root, directory.lstrip("/")))
        out.append((runtime, re.compile(rf"{re.escape(base)}/([^/]+)/{re.escape(below)}")))
    return out


def _bookkeeping(kubelet_dir: str, sandbox_root: str) -> tuple[str, ...]:
    """Where the kubelet and the runtimes keep their copies of pod mounts: a mount there is no one's /dev/shm."""
    dirs = [os.path.normpath(kubelet_dir)]
    dirs += [os.path.normpath(os.path.join(sandbox_root, d.lstrip("/"))) for _, d, _ in settings.SANDBOX_SHM]
    return tuple(d.rstrip("/") + "/" for d in dirs)


def _read_text(path: str, limit: int = 65536) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return os.read(fd, limit).decode(errors="replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def pod_of_kubelet_dir(kubelet_dir: str, uid: str) -> tuple[str | None, str | None]:
    """(pod name, namespace) as the kubelet's pod directory shows them, without the API server.

    The kubelet writes the pod's /etc/hosts there, its last line the pod's IP
    and hostname (the pod's name unless spec.hostname says otherwise, with the
    namespace in the FQDN when the pod has a subdomain); the service account
    token's projected volume holds a `namespace` file.
    """
    base = os.path.join(kubelet_dir, "pods", uid)
    pod = namespace = None
    hosts = _read_text(os.path.join(base, "etc-hosts"))
    if hosts:
        rows = [line.split() for line in hosts.splitlines() if line.strip() and not line.lstrip().startswith("#")]
        if rows and len(rows[-1]) >= 2:
            names = rows[-1][1:]
            pod = names[-1]
            fqdn = next((n for n in names if ".svc." in n), None)
            if fqdn is not None and len(fqdn.split(".")) > 3:
                namespace = fqdn.split(".")[2]
    projected = os.path.join(base, "volumes", "kubernetes.io~projected")
    try:
        volumes = sorted(os.listdir(projected))
    except OSError:
        volumes = []
    for v in volumes:
        text = _read_text(os.path.join(projected, v, "namespace"), 256)
        if text and text.strip():
            namespace = text.strip()
            break
    return pod, namespace


def _cgroup_ids(proc_root: str, pid: int) -> tuple[str | None, str | None]:
    """(pod UID, container id) from /proc/<pid>/cgroup, where the kubelet's and the runtime's cgroup names show them."""
    text = _read_text(f"{proc_root}/{pid}/cgroup")
    if not text:
        return None, None
    pod = container = None
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        if pod is None and (m := _CGROUP_POD.search(path)):
            pod = m.group(1).replace("_", "-")
        if container is None and (c := _CGROUP_CONTAINER.search(path.rstrip("/"))):
            container = c.group(1)
    return pod, container


def _hostname(proc_root: str, pid: int) -> str | None:
    """HOSTNAME from a process's environment: a pod's name, as the container runtime sets it."""
    try:
        with open(f"{proc_root}/{pid}/environ", "rb") as f:
            raw = f.read(1 << 20)
    except OSError:
        return None
    for item in raw.split(b"\0"):
        if item.startswith(b"HOSTNAME="):
            return item[9:].decode(errors="replace") or None
    return None


def _covering(mounts: list[Mount], path: str) -> Mount | None:
    """The mount `path` is on in this table (the last mount at the longest point above it: mounts stack)."""
    best: Mount | None = None
    for m in mounts:
        point = m.point
        if path == point or path.startswith(point.rstrip("/") + "/"):
            if best is None or len(point) >= len(best.point):
                best = m
    return best


def open_inside(root: str, rel: str) -> int:
    """An O_PATH-free directory fd of `root`/`rel`, each component opened without following a link.

    Through /proc/<pid>/root an absolute symbolic link inside the container
    (its /dev pointing at /etc) would resolve in *our* root: a link followed
    out of the place. Raises OSError (ELOOP for a link) as the open did.
    """
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    fd = os.open(root, flags)
    try:
        for part in [p for p in rel.split("/") if p]:
            nxt = os.open(part, flags | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _identity_of(root: str, rel: str, *, missing_ok: bool = False) -> tuple[int, int] | str | None:
    """(st_dev, st_ino) of `root`/`rel` reached without following a link, or why it could not be reached.

    `missing_ok`: None when it does not exist (a container whose image has no /tmp has no /tmp place).
    """
    try:
        fd = open_inside(root, rel)
    except OSError as e:
        if missing_ok and e.errno == errno.ENOENT:
            return None
        why = "a symbolic link; not followed" if e.errno == errno.ELOOP else e.strerror
        return f"{os.path.join(root, rel.lstrip('/'))}: {why}"
    try:
        st = os.fstat(fd)
        return st.st_dev, st.st_ino
    finally:
        os.close(fd)


class _Finder:
    """One discovery: the places found so far by directory identity, and what to read once per namespace.

    A place is keyed by its directory's (st_dev, st_ino), not its device
    alone: a PrivateTmp= service's /tmp is a directory of the host's root
    filesystem, and two containers may each get a subdirectory of one tmpfs.
    The same directory reached twice (a volume at the kubelet's path and at a
    container's /dev/shm) is one place.
    """

    def __init__(self, facts: Facts, host: Layout, kubelet_dir: str, sandbox_root: str) -> None:
        self.facts = facts
        self.proc_root = facts.proc_root
        self.kubelet_dir = kubelet_dir
        self.sandbox_root = sandbox_root
        self.bookkeeping = _bookkeeping(kubelet_dir, sandbox_root)
        self.by_id: dict[tuple[int, int], Place] = {}
        self.errors: list[str] = []
        self.host_ids: set[tuple[int, int]] = set()
        # kvctl's own /dev/shm and /tmp are the host's too, also under --root (which re-bases where the host
        # place is judged): judged as another place by stricter evidence, they would be the node's own.
        for d in (host.shm_dir, host.tmp_dir, "/dev/shm", "/tmp"):
            try:
                st = os.stat(d)
            except OSError:
                continue
            self.host_ids.add((st.st_dev, st.st_ino))
        self.sees: dict[str | None, frozenset[int]] = {}
        self.unread: set[str] = set()  # namespaces whose mount table could not be read

    def add(self, ident: tuple[int, int], place: Place) -> None:
        if ident not in self.host_ids and ident not in self.by_id:
            self.by_id[ident] = place._replace(ino=ident[1])

    def visible(self, mounts: Iterable[Mount]) -> frozenset[int]:
        """The devices a namespace's processes can use: its mounts, less the kubelet's and runtimes' copies."""
        return frozenset(m.dev for m in mounts if m.dev and not (m.point.rstrip("/") + "/").startswith(
            self.bookkeeping))

    def _mounted(self, m: Mount) -> tuple[int, int] | None:
        """The identity of a mount point of kvctl's own table, when it is the filesystem the table says."""
        ident = _identity_of(m.point, "")
        if ident is None or isinstance(ident, str) or ident[0] != m.dev:
            self.errors.append(ident if isinstance(ident, str) else f"{m.point}: not the mounted filesystem")
            return None
        return ident

    def own_mounts(self, mounts: list[Mount]) -> None:
        """Memory-backed emptyDirs and sandbox shm mounts, from kvctl's own mount table."""
        empty = _emptydir_re(self.kubelet_dir)
        sandboxes = _sandbox_res(self.sandbox_root)
        pods: dict[str, tuple[str | None, str | None]] = {}
        for m in mounts:
            if m.fstype != "tmpfs" or not m.dev:
                continue
            if (e := empty.fullmatch(m.point)) is not None:
                uid, volume = e.group(1), e.group(2)
                if (ident := self._mounted(m)) is None:
                    continue
                if uid not in pods:
                    pods[uid] = pod_of_kubelet_dir(self.kubelet_dir, uid)
                pod, ns = pods[uid]
                self.add(ident, Place(PlaceKind.POD_VOLUME, m.point, Seen.SHM, m.dev, pod_uid=uid, pod=pod,
                                      namespace=ns, volume=volume))
                continue
            for runtime, pattern in sandboxes:
                if (sb := pattern.fullmatch(m.point)) is not None:
                    if (ident := self._mounted(m)) is not None:
                        self.add(ident, Place(PlaceKind.SANDBOX, m.point, Seen.SHM, m.dev, path_inside="/dev/shm",
                                              container=sb.group(1), runtime=runtime))
                    break

    def namespace(self, ns: str, members: list[int]) -> None:
        """One other mount namespace, read through one of its processes: what it sees at /dev/shm and /tmp.

        `members` are its processes, lowest PID first. The lowest is tried first (the longest-lived, as a
        container's PID 1), then the next: one that exited since the /proc pass must not make a whole
        namespace unread.
        """
        mounts, rep = None, members[0]
        for rep in members:
            if (mounts := read_mountinfo(self.proc_root, rep)) is not None:
                break
        if mounts is None:
            # What it sees is unknown, so its processes may have made any place's files: they count as seeing
            # every place (a PID in a name then proves the file alive more often, never less).
            self.errors.append(f"{self.proc_root}/{members[0]}/mountinfo: could not be read, nor that of any "
                               f"other of its {len(members)} processes (mount namespace {ns}); "
                               "its processes are taken to see every place")
            self.unread.add(ns)
            return
        self.sees[ns] = self.visible(mounts)
        root = f"{self.proc_root}/{rep}/root"
        ids: tuple[str | None, str | None, str | None] | None = None  # pod UID, container, HOSTNAME
        for seen, inside in _INSIDE.items():
            m = _covering(mounts, inside)
            if m is None or not m.dev:
                continue
            ident = _identity_of(root, inside, missing_ok=True)
            if ident is None:
                continue
            if isinstance(ident, str):
                self.errors.append(ident)
                continue
            if ident[0] != m.dev:
                self.errors.append(f"{root}{inside}: not the filesystem its mount table shows there; not judged")
                continue
            known = self.by_id.get(ident)
            if ident in self.host_ids or (known is not None and known.path_inside is not None):
                continue
            if ids is None:  # read once per namespace, and only for a namespace with a place of its own
                pod_uid, container = _cgroup_ids(self.proc_root, rep)
                ids = (pod_uid, container, _hostname(self.proc_root, rep) if pod_uid else None)
            pod_uid, container, hostname = ids
            if known is not None:  # a pod volume or sandbox shm: now we know where the pod sees it
                self.by_id[ident] = known._replace(path_inside=inside, container=known.container or container,
                                                   pod_uid=known.pod_uid or pod_uid, pod=known.pod or hostname)
                continue
            self.add(ident, Place(PlaceKind.MOUNT_NAMESPACE, f"{root}{inside}", seen, m.dev, path_inside=inside,
                                  pod_uid=pod_uid, pod=hostname, container=container))


def _with_holder(pl: Place, facts: Facts, sandbox_root: str) -> Place:
    """A sandbox's place with its holder (or why none is known), and the pod the runtime's state names."""
    if pl.kind is not PlaceKind.SANDBOX:
        return pl
    h = holder_of(pl.runtime, pl.container, facts, pl.pids, sandbox_root)
    if h is None:
        return pl
    return pl._replace(holder=h.pid, holder_note=h.why, pod=pl.pod or h.pod, namespace=pl.namespace or h.namespace,
                       pod_uid=pl.pod_uid or h.pod_uid)


def discover(facts: Facts, host: Layout, *, kubelet_dir: str | None = None,
             sandbox_root: str | None = None) -> Places:
    """Every place on the node, host first, from the facts' one /proc pass (no process is read twice)."""
    kube = os.path.normpath(kubelet_dir or settings.KVCTL_KUBELET_DIR.get())
    finder = _Finder(facts, host, kube, sandbox_root or settings.KVCTL_SANDBOX_ROOT.get())
    mine = read_mountinfo(facts.proc_root)
    if mine is None:
        finder.errors.append(f"{facts.proc_root}/self/mountinfo: could not be read")
        mine = []
    finder.own_mounts(mine)
    finder.sees[facts.my_mnt_ns] = finder.visible(mine)
    members: dict[str, list[int]] = {}
    for pid in sorted(facts.processes):
        ns = facts.processes[pid].mnt_ns
        if ns is not None and ns != facts.my_mnt_ns:
            members.setdefault(ns, []).append(pid)
    for ns in sorted(members, key=lambda n: members[n][0]):
        finder.namespace(ns, members[ns])
    places = list(finder.by_id.values())
    wanted = frozenset(pl.dev for pl in places if pl.dev is not None)
    per_ns = {ns: devs & wanted for ns, devs in finder.sees.items()}
    per_ns.update({ns: wanted for ns in finder.unread})
    viewers: dict[int, list[int]] = {}
    for pid, p in facts.processes.items():
        for dev in per_ns.get(p.mnt_ns, ()):
            viewers.setdefault(dev, []).append(pid)
    final = [_with_holder(pl._replace(pids=tuple(sorted(viewers.get(pl.dev, ())))), facts, finder.sandbox_root)
             for pl in places if pl.dev is not None]
    return Places(HOST._replace(path=host.root), final, {d: tuple(sorted(v)) for d, v in viewers.items()},
                  finder.errors)
