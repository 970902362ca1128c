"""Can this kvctl see what it judges? Its privileges, the /proc it reads, and what one /proc pass could not read.

A cleaner that cannot read every process's fds, maps and status keeps what
those processes might own as unknown, which is safe, and quiet: a DaemonSet
deployed without hostPID, or behind a security profile, would keep every
leftover forever and look healthy. This module names each cause, with its
fix, so that `doctor sight` fails and gc says it is blind (docs/CLEANER.md §7).

A run is *blind* when at least one of these holds:

- `proc`: the /proc directory could not be listed;
- `pid_namespace`: /proc shows a PID namespace other than the node's initial one
  (a container without hostPID sees its own processes only);
- `no_ptrace`: kvctl has no CAP_SYS_PTRACE in its effective set (a user other
  than root, or root in a container without it): the kernel lets it read the
  fds, maps and environment of its own user's processes only;
- `hidepid`: /proc is mounted with hidepid (other users' processes denied or
  hidden) and kvctl can see past neither by CAP_SYS_PTRACE nor by the mount's gid=;
- `subset_pid`: /proc is mounted with subset=pid (no /proc/locks, no /proc/stat);
- `unreadable`: the run's /proc pass was refused (permission) a process's fds,
  maps, environment or namespaces, where that process is another user's or
  engine-like, although kvctl holds CAP_SYS_PTRACE: a Linux security module
  (AppArmor, SELinux) denies the read.

A process of kvctl's own user that is not engine-like and cannot be read does
not make a run blind: it cannot own a deployment kvctl judges (a sandbox's
init that keeps capabilities kvctl lacks is one).

Only the standard library and the mount table: the /proc pass (facts.py)
imports this module, never the other way round, and gc imports it on its idle
path too, so its types are NamedTuples (a frozen dataclass costs more to define).
"""

# No `from __future__ import annotations`: a NamedTuple's string annotations are each compiled at
# class creation (typing.ForwardRef), a cost every kvctl start pays (bench/bench_cli_start.py).
import os
from typing import TYPE_CHECKING, NamedTuple

from ..base.enums import StrEnum
from ..base.mounts import read_mountinfo

if TYPE_CHECKING:
    from typing import Protocol

    class PassView(Protocol):
        """What `assess` reads of one /proc pass (kvcached.node.clean.facts.Facts)."""

        proc_root: str
        errors: list[str]
        unreadable_pids: dict[int, frozenset[str]]

        def uid_of(self, pid: int) -> int | None: ...

        def engine_like(self, pid: int) -> bool: ...

# The initial PID namespace has this fixed inode (PROC_PID_INIT_INO, Linux >= 3.8). In any other one,
# processes of the parent and sibling namespaces (another container sharing this /dev/shm) are invisible.
INITIAL_PID_NS = "pid:[4026531836]"
CAP_SYS_PTRACE = 19
_PF_KTHREAD = 0x00200000
# What a run's pass records as unread (facts.ProcessInfo.unreadable, Facts.unreadable_pids).
_READS = frozenset({"fd", "maps", "environ", "ns/mnt", "ns/net"})


class Cause(StrEnum):
    PROC = "proc"
    PID_NAMESPACE = "pid_namespace"
    NO_PTRACE = "no_ptrace"
    HIDEPID = "hidepid"
    SUBSET_PID = "subset_pid"
    UNREADABLE = "unreadable"


class BlindReason(NamedTuple):
    """One cause of blindness: what, why it matters, the fix, and a few processes it hid (when known)."""

    cause: Cause
    detail: str
    fix: str
    pids: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, object]:
        return {"cause": str(self.cause), "detail": self.detail, "fix": self.fix, "pids": list(self.pids)}


class Credentials(NamedTuple):
    """Who this kvctl is, as the kernel's ptrace-read check sees it."""

    uid: int
    groups: frozenset[int]
    ptrace: bool  # CAP_SYS_PTRACE in the effective set
    lsm: str | None  # the security label of this process (an AppArmor profile), when the kernel names one


class ProcMount(NamedTuple):
    """The options of the /proc mount that matter for sight (`hidepid` 0 when absent)."""

    hidepid: str  # "0"/"off", "1"/"noaccess", "2"/"invisible", "4"/"ptraceable"
    gid: int | None
    subset_pid: bool

    @property
    def hides(self) -> bool:
        return self.hidepid not in ("0", "off")


class Sight(NamedTuple):
    """Whether a run saw every process it judged, and each reason it did not."""

    reasons: tuple[BlindReason, ...] = ()
    credentials: Credentials | None = None

    @property
    def blind(self) -> bool:
        return bool(self.reasons)

    def to_dict(self) -> dict[str, object] | None:
        """The `blind` object of gc's JSON document; None when the run saw everything."""
        return {"reasons": [r.to_dict() for r in self.reasons]} if self.reasons else None

    def summary(self) -> str:
        return "; ".join(r.detail for r in self.reasons)


def _read_text(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(65536).decode(errors="replace")
    except OSError:
        return None


def read_credentials(proc_root: str = "/proc") -> Credentials:
    """This process's uid, groups, CAP_SYS_PTRACE and security label, from /proc/self (getters as fallback)."""
    status = _read_text(f"{proc_root}/self/status") or ""
    cap_eff = None
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            try:
                cap_eff = int(line.split()[1], 16)
            except (IndexError, ValueError):
                pass
    uid = os.geteuid()
    ptrace = bool(cap_eff >> CAP_SYS_PTRACE & 1) if cap_eff is not None else uid == 0
    label = None
    # The LSM-specific file first: on a kernel stacking several modules the generic one names only the first.
    for path in (f"{proc_root}/self/attr/apparmor/current", f"{proc_root}/self/attr/current"):
        text = _read_text(path)
        if text and text.strip("\0\n "):
            label = text.strip("\0\n ")
            break
    return Credentials(uid=uid, groups=frozenset((os.getegid(), *os.getgroups())), ptrace=ptrace, lsm=label)


def proc_mount(proc_root: str = "/proc") -> ProcMount:
    """The hidepid=, gid= and subset= options of the procfs mounted at `proc_root` (the last mount there wins)."""
    found = ProcMount("0", None, False)
    for m in read_mountinfo(proc_root) or ():
        if m.point != proc_root or m.fstype != "proc":
            continue
        opts = dict(o.partition("=")[::2] for o in m.options.split(","))
        gid = opts.get("gid")
        found = ProcMount(opts.get("hidepid", "0") or "0", int(gid) if gid and gid.isdigit() else None,
                          opts.get("subset") == "pid")
    return found


def is_kernel_thread(pid: int, proc_root: str = "/proc") -> bool:
    """Whether `pid` is a kernel thread in this procfs (they live only in the initial PID namespace)."""
    try:
        with open(f"{proc_root}/{pid}/stat", "rb") as f:
            raw = f.read()
        return bool(int(raw[raw.rindex(b")") + 2:].split()[6]) & _PF_KTHREAD)
    except (OSError, ValueError, IndexError):
        return False


def pid_view_gap(proc_root: str) -> str | None:
    """Why this /proc cannot show every process on the node (None: it can).

    A procfs shows the processes of the PID namespace it was mounted for, and
    PID 1 there is that namespace's init, so /proc/1/ns/pid names it. Where
    that link may not be read (not root; or from inside a child namespace),
    kthreadd tells: kernel threads are seen only in the initial namespace's
    procfs, and kthreadd is always PID 2. Comparing /proc/1/ns/pid with
    /proc/self/ns/pid would not do: a container without hostPID sees its own
    init as PID 1, in its own namespace, just as the host does.
    """
    ns: str | None
    try:
        ns = os.readlink(f"{proc_root}/1/ns/pid")
    except PermissionError:
        ns = INITIAL_PID_NS if is_kernel_thread(2, proc_root) else None
    except OSError as e:
        return f"the PID namespace of {proc_root} could not be read ({e.strerror})"
    if ns == INITIAL_PID_NS:
        return None
    return (f"{proc_root} shows a PID namespace of its own (a container without hostPID): processes of other "
            "containers that share this directory cannot be seen")


def sees_past_hidepid(mount: ProcMount, creds: Credentials) -> bool:
    """Whether hidepid hides nothing from us: CAP_SYS_PTRACE, or membership of the mount's gid= group."""
    return creds.ptrace or (mount.gid is not None and mount.gid in creds.groups)


def hides_other_users(proc_root: str = "/proc", creds: Credentials | None = None) -> bool:
    """Whether processes of users other than ours may be missing from a listing of `proc_root` (hidepid)."""
    mount = proc_mount(proc_root)
    if not mount.hides:
        return False
    return not sees_past_hidepid(mount, creds or read_credentials(proc_root))


def _unreadable(view: "PassView", creds: Credentials) -> list[int]:
    """Processes the pass was refused that could matter: another user's, or engine-like."""
    out = []
    for pid, what in sorted(view.unreadable_pids.items()):
        if not what & _READS:
            continue
        uid = view.uid_of(pid)
        if uid is None:
            continue  # gone since the pass
        if uid != creds.uid or view.engine_like(pid):
            out.append(pid)
    return out


def assess(proc_root: str = "/proc", view: "PassView | None" = None, *, creds: Credentials | None = None,
           mount: ProcMount | None = None) -> Sight:
    """Every reason a run over `proc_root` is blind; `view`: that run's /proc pass, when it made one."""
    creds = creds or read_credentials(proc_root)
    mount = mount or proc_mount(proc_root)
    reasons: list[BlindReason] = []
    if view is not None and view.errors:
        reasons.append(BlindReason(Cause.PROC, f"/proc could not be read: {view.errors[0]}",
                                   "run kvctl where the node's /proc is mounted (hostPID: true in Kubernetes)"))
    gap = pid_view_gap(proc_root)
    if gap is not None:
        reasons.append(BlindReason(Cause.PID_NAMESPACE, gap,
                                   "run kvctl in the host's PID namespace (Kubernetes: hostPID: true; "
                                   "docker/podman: --pid=host)"))
    pids = _unreadable(view, creds) if view is not None else []
    if not creds.ptrace:
        who = f"uid {creds.uid}" if creds.uid else "root without CAP_SYS_PTRACE"
        seen = f" ({len(pids)} process(es) could not be read this run)" if pids else ""
        reasons.append(BlindReason(
            Cause.NO_PTRACE, f"kvctl runs as {who}: other users' fds, maps and environments cannot be read{seen}",
            "run kvctl as root with CAP_SYS_PTRACE (sudo; Kubernetes: runAsUser: 0 and "
            "securityContext.capabilities.add: [SYS_PTRACE])", tuple(pids[:8])))
    if mount.hides and not sees_past_hidepid(mount, creds):
        gid = f"add kvctl's user to group {mount.gid} (the mount's gid=)" if mount.gid is not None else \
            "or mount it with gid=<a group of kvctl's user>"
        reasons.append(BlindReason(
            Cause.HIDEPID, f"{proc_root} is mounted with hidepid={mount.hidepid}: other users' processes are "
            "hidden from kvctl", f"remount /proc without hidepid (mount -o remount,hidepid=0 /proc), {gid}, "
            "or run kvctl with CAP_SYS_PTRACE"))
    if mount.subset_pid:
        reasons.append(BlindReason(
            Cause.SUBSET_PID, f"{proc_root} is mounted with subset=pid: /proc/locks and /proc/stat are hidden",
            "mount /proc without subset=pid for kvctl (Kubernetes: procMount: Default)"))
    if pids and creds.ptrace:
        label = f" (this process runs under {creds.lsm!r})" if creds.lsm else ""
        reasons.append(BlindReason(
            Cause.UNREADABLE, f"{len(pids)} process(es) could not be read although kvctl holds "
            f"CAP_SYS_PTRACE (e.g. PID {pids[0]}): a security module denies it{label}",
            "run kvctl unconfined (Kubernetes: securityContext.appArmorProfile: {type: Unconfined}; "
            "SELinux: a type allowed to read other domains' /proc)", tuple(pids[:8])))
    return Sight(tuple(reasons), creds)
