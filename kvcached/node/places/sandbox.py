"""A runtime sandbox's own holder: the pause/infra process that keeps a pod's /dev/shm, named by the runtime's state.

In a CRI-O, containerd or podman sandbox, the pod's /dev/shm is a tmpfs the
runtime mounts for the sandbox; its infra process (pause, catatonit) sees it
for the pod's whole life and creates nothing in it. It is PID 1 of its own
PID namespace, as almost every container's main process is, so a file named
by a dead main process's PID (SGLang's `sgl_shm_mm_1_*`) would have the infra
as a live creator for as long as the pod lives. The runtime's own state beside
the shm names that process; checked by PID and start time, it is no creator
candidate (places/evidence.py). It is still a user: what it maps or holds
keeps a file, as any process's does.

Where the state lives, each read without following a link (docs/PLACES.md §3):

- containerd: the CRI plugin's `sandboxes/<id>/shm` is a sandbox's by
  construction; its task's `init.pid` (`io.containerd.runtime.v2.task/k8s.io/<id>/init.pid`)
  names the pause process.
- CRI-O: `userdata/pidfile` under the run root (`/run/containers/storage/overlay-containers/<id>/`),
  beside `conmon.pid`; the container is a sandbox when its `config.json` (under the storage root)
  carries `io.kubernetes.cri-o.ContainerType: sandbox`, or when another container of the runtime names it
  as its `io.kubernetes.cri-o.SandboxID` (podman's pods: its infra carries no type).
- Docker: `config.v2.json`'s `State.Pid`, only for a container labelled
  `io.kubernetes.docker.type: podsandbox` (cri-dockerd's sandboxes). Any other
  container's /dev/shm is its own, and its main process is its engine: a
  creator like any other.

Anything else (a file that cannot be read, a process that is gone or started
after the runtime wrote its PID, one that is not PID 1 of its own PID
namespace, one that does not see the place) names no holder, and the
decision says why: today's rule then holds, and every viewer counts as a
creator candidate.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass

from ..clean.facts import START_SLACK, Facts

# The state files are small; a larger one is not the runtime's.
_LIMIT = 1 << 20

_CRIO_RUN = "run/containers/storage/overlay-containers"
_CRIO_STORAGE = "var/lib/containers/storage/overlay-containers"
_CONTAINERD_TASKS = "run/containerd/io.containerd.runtime.v2.task/k8s.io"
_DOCKER = "var/lib/docker/containers"


@dataclass(frozen=True)
class Holder:
    """What the runtime's state says of a sandbox: its holder's host PID, or why none is known."""

    pid: int | None
    source: str          # the file that named it (or was to)
    why: str | None = None  # None when pid is the holder
    pod: str | None = None
    namespace: str | None = None
    pod_uid: str | None = None


def _read_state(path: str) -> tuple[bytes, os.stat_result] | str:
    """The bytes of one runtime state file and its stat, or why it is not the runtime's.

    Opened without following a link or blocking; only a regular file owned by
    root (or by us) that nobody else may write names anything: a holder lets
    kvctl disregard a live process as a creator, so a planted file must not
    name one.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        return f"{path}: {e.strerror}"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return f"{path}: not a regular file"
        if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
            return f"{path}: owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):o}; not the runtime's"
        data = os.read(fd, _LIMIT)
        return data, st
    except OSError as e:
        return f"{path}: {e.strerror}"
    finally:
        os.close(fd)


def _pid_file(path: str) -> int | str:
    got = _read_state(path)
    if isinstance(got, str):
        return got
    data = got[0]
    try:
        pid = int(data.strip() or b"0")
    except ValueError:
        return f"{path}: not a PID"
    if pid <= 0:
        return f"{path}: names no process"
    return pid


def _json(path: str) -> dict[str, object] | str:
    got = _read_state(path)
    if isinstance(got, str):
        return got
    try:
        doc = json.loads(got[0])
    except ValueError:
        return f"{path}: not JSON"
    return doc if isinstance(doc, dict) else f"{path}: not a JSON object"


def _annotations(doc: dict[str, object]) -> dict[str, str]:
    ann = doc.get("annotations")
    return {str(k): str(v) for k, v in ann.items()} if isinstance(ann, dict) else {}


def _named_as_sandbox(storage: str, sandbox_id: str) -> bool:
    """Whether another container of a CRI-O/podman storage root names `sandbox_id` as its sandbox."""
    try:
        ids = os.listdir(storage)
    except OSError:
        return False
    needle = sandbox_id.encode()
    for cid in ids:
        if cid == sandbox_id:
            continue
        got = _read_state(os.path.join(storage, cid, "userdata", "config.json"))
        # The id is 64 hex digits: a cheap search before parsing only the configs that may name it.
        if isinstance(got, str) or needle not in got[0]:
            continue
        try:
            doc = json.loads(got[0])
        except ValueError:
            continue
        if isinstance(doc, dict) and _annotations(doc).get("io.kubernetes.cri-o.SandboxID") == sandbox_id:
            return True
    return False


def _crio(root: str, sandbox_id: str) -> Holder:
    pidfile = os.path.join(root, _CRIO_RUN, sandbox_id, "userdata", "pidfile")
    storage = os.path.join(root, _CRIO_STORAGE)
    config = _json(os.path.join(storage, sandbox_id, "userdata", "config.json"))
    ann = _annotations(config) if isinstance(config, dict) else {}
    meta = {"pod": ann.get("io.kubernetes.pod.name"), "namespace": ann.get("io.kubernetes.pod.namespace"),
            "pod_uid": ann.get("io.kubernetes.pod.uid")}
    kind = ann.get("io.kubernetes.cri-o.ContainerType")
    if kind is not None and kind != "sandbox":
        return Holder(None, pidfile, f"the runtime calls container {sandbox_id[:12]} a {kind}, not a sandbox", **meta)
    if kind is None and not _named_as_sandbox(storage, sandbox_id):
        why = config if isinstance(config, str) else \
            f"no container of {storage} names {sandbox_id[:12]} as its sandbox"
        return Holder(None, pidfile, why, **meta)
    got = _pid_file(pidfile)
    return Holder(None, pidfile, got, **meta) if isinstance(got, str) else Holder(got, pidfile, None, **meta)


def _containerd(root: str, sandbox_id: str) -> Holder:
    path = os.path.join(root, _CONTAINERD_TASKS, sandbox_id, "init.pid")
    got = _pid_file(path)
    return Holder(None, path, got) if isinstance(got, str) else Holder(got, path)


def _docker(root: str, sandbox_id: str) -> Holder:
    path = os.path.join(root, _DOCKER, sandbox_id, "config.v2.json")
    doc = _json(path)
    if isinstance(doc, str):
        return Holder(None, path, doc)
    config, state = doc.get("Config"), doc.get("State")
    labels = config.get("Labels") if isinstance(config, dict) else None
    labels = labels if isinstance(labels, dict) else {}
    meta = {"pod": labels.get("io.kubernetes.pod.name"), "namespace": labels.get("io.kubernetes.pod.namespace"),
            "pod_uid": labels.get("io.kubernetes.pod.uid")}
    if labels.get("io.kubernetes.docker.type") != "podsandbox":
        return Holder(None, path, f"container {sandbox_id[:12]} is no pod sandbox: its main process is its own",
                      **meta)
    pid = state.get("Pid") if isinstance(state, dict) else None
    if not isinstance(pid, int) or pid <= 0:
        return Holder(None, path, f"{path}: names no running process", **meta)
    return Holder(pid, path, None, **meta)


_BY_RUNTIME = {"containerd": _containerd, "cri-o": _crio, "docker": _docker}


def holder_of(runtime: str | None, sandbox_id: str | None, facts: Facts, viewers: tuple[int, ...],
              sandbox_root: str = "/") -> Holder | None:
    """The sandbox's holder as the runtime's state names it, checked against this pass; None: not a sandbox.

    The process must be alive with a start time no later than the state file's
    last change (a PID the runtime wrote before a reuse names someone else), be
    PID 1 of its own PID namespace (a sandbox's init), and see the place.
    """
    if runtime is None or sandbox_id is None or runtime not in _BY_RUNTIME:
        return None
    said = _BY_RUNTIME[runtime](sandbox_root, sandbox_id)
    if said.pid is None:
        return said
    why = _disqualified(said, facts, viewers)
    return said if why is None else Holder(None, said.source, why, said.pod, said.namespace, said.pod_uid)


def _disqualified(h: Holder, facts: Facts, viewers: tuple[int, ...]) -> str | None:
    assert h.pid is not None
    info = facts.processes.get(h.pid)
    if info is None:
        return f"{h.source} names PID {h.pid}, which is not alive"
    try:
        written = os.stat(h.source, follow_symlinks=False).st_mtime
    except OSError as e:
        return f"{h.source}: {e.strerror}"
    if info.start_time > written + START_SLACK:
        return f"PID {h.pid} started after {h.source} was written: another process"
    if facts.namespace_pids().get(h.pid, (h.pid,))[-1] != 1:
        return f"PID {h.pid}, named by {h.source}, is not PID 1 of its own PID namespace: no sandbox's init"
    if h.pid not in viewers:
        return f"PID {h.pid}, named by {h.source}, does not see this place"
    return None
