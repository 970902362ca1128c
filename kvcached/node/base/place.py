"""A place of the node: one directory someone uses as /dev/shm or /tmp, and what the node shows of whose it is.

The data type alone (no I/O): every candidate carries the place it was found
in (`Candidate.place`, `EngineCandidate.place`, `report.Origin.place`; None is
this node's own /tmp and /dev/shm), so the type sits below the cleaner that
tags it. Finding the places is kvcached/node/places/discover.py's.
"""

# No `from __future__ import annotations`: a NamedTuple's string annotations are each compiled at
# class creation (typing.ForwardRef), a cost every kvctl start pays (bench/bench_cli_start.py).
import os
from typing import NamedTuple

from .enums import StrEnum
from .layout import Layout


class PlaceKind(StrEnum):
    """What kind of place a filesystem is (the `kind` of an entry's `place` in JSON)."""

    HOST = "host"                        # the node's own /dev/shm and /tmp
    MOUNT_NAMESPACE = "mount_namespace"  # another mount namespace's /dev/shm or /tmp
    POD_VOLUME = "pod_volume"            # a memory-backed emptyDir under the kubelet's pod directory
    SANDBOX = "sandbox"                  # a container runtime's per-sandbox /dev/shm


class Seen(StrEnum):
    """Which directory a place is judged as: /dev/shm (segments, engine buffers) or /tmp (sockets)."""

    SHM = "shm"
    TMP = "tmp"


class Place(NamedTuple):
    """One filesystem where state can live, and what the node shows of whose it is.

    A NamedTuple, immutable, rather than a frozen dataclass: every gc builds
    the host's, and a dataclass costs a cold start its generated methods
    (bench/bench_cli_start.py).
    """

    kind: PlaceKind
    path: str                      # the directory as kvctl reaches it
    seen: Seen
    dev: int | None = None         # its st_dev; None for the host, whose two directories the layout names
    ino: int | None = None         # its directory's st_ino: with dev, what the act must find again
    path_inside: str | None = None  # the directory as the pod or container sees it, when a process shows it
    pod_uid: str | None = None
    pod: str | None = None
    namespace: str | None = None
    container: str | None = None   # a container id from a process's cgroup, or the sandbox's id
    runtime: str | None = None     # containerd, cri-o, docker: whose sandbox
    volume: str | None = None      # the emptyDir's name
    pids: tuple[int, ...] = ()     # processes that see it in their own mount namespace
    errors: tuple[str, ...] = ()   # what could not be read about it
    holder: int | None = None      # a sandbox's pause/infra process, named by the runtime's state (places/sandbox.py)
    holder_note: str | None = None  # a sandbox's: why no holder is known (then every viewer may be a creator)

    @property
    def is_host(self) -> bool:
        return self.kind is PlaceKind.HOST

    @property
    def label(self) -> str:
        """How a report names the place: its pod and volume or container, else its path."""
        if self.is_host:
            return "host"
        who = f"pod {self.namespace + '/' if self.namespace else ''}{self.pod or self.pod_uid}" \
            if (self.pod or self.pod_uid) else f"{self.kind.value.replace('_', ' ')}"
        what = f"volume {self.volume}" if self.volume else (f"container {self.container[:12]}" if self.container
                                                            else "")
        inside = f" at {self.path_inside}" if self.path_inside else ""
        return f"{who}{', ' + what if what else ''}{inside} ({self.path})"

    def layout(self, host: Layout) -> Layout:
        """The layout that judges this place alone: its one directory, the other one absent."""
        if self.is_host:
            return host
        return Layout(root=self.path, shm=self.path if self.seen is Seen.SHM else "",
                      tmp=self.path if self.seen is Seen.TMP else "")

    def to_dict(self) -> dict[str, object]:
        """The `place` of an entry, a deployment and the document's list of places (kvctl/schemas)."""
        return {"kind": str(self.kind), "pod_uid": self.pod_uid, "pod": self.pod, "namespace": self.namespace,
                "container": self.container, "path": self.path, "path_inside": self.path_inside,
                "volume": self.volume, "runtime": self.runtime, "device": dev_text(self.dev),
                "pids": list(self.pids), "holder": self.holder, "holder_note": self.holder_note}


def dev_text(dev: int | None) -> str | None:
    return None if dev is None else f"{os.major(dev)}:{os.minor(dev)}"


HOST = Place(PlaceKind.HOST, "/", Seen.SHM)
HOST_PLACE = HOST  # its name on the node layer's face, where HOST alone would not say what it is
