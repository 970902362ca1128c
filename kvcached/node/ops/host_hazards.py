"""What the host's own configuration does to kvcached's live state: doctor's host hazards (docs/CLEANER.md §8).

- systemd-logind's `RemoveIPC=yes` removes a user's POSIX shared memory at its
  last logout, live segments included (vLLM issue 54259);
- systemd-tmpfiles rules that age /dev/shm or /tmp remove live segments and
  upstream's socket directories (ours survive: they hold a flock, which
  systemd-tmpfiles respects);
- upstream kvcached's in-process revisioned limits and `kvctl limit` both set
  a pool's limit, and neither sees the other's.

Each check reads real configuration files under one root (`HostConfig`, the
real ones by default; systemd-tmpfiles' own `--root` works the same way) and
returns `Finding`s, which `diagnostics` turns into doctor lines.
"""

from __future__ import annotations

import fnmatch
import json
import os
import pwd
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..base.name_rules import socket_dir_name

# logind never removes the IPC objects of system users (uid_is_system: uid <= SYSTEM_UID_MAX, 999 on every
# distribution's build) nor of nobody.
SYSTEM_UID_MAX = 999
NOBODY = 65534
_TRUE = frozenset({"1", "yes", "y", "true", "t", "on"})
_FALSE = frozenset({"0", "no", "n", "false", "f", "off"})
# systemd-tmpfiles honours the age field on these line types only (tmpfiles.d(5), "Age").
_AGING_TYPES = frozenset("dDevqQC")
_EXCLUDE_TYPES = frozenset("xX")
# The kvcached paths whose loss harms a live serve, as globs systemd-tmpfiles' `x` lines accept (fnmatch-style
# shell globs): default-named segments, every socket directory, kvctl gc's node lock.
SEGMENT_GLOB = "/dev/shm/kvcached_*"
SOCKET_DIR_GLOB = "/tmp/kvcached-tp-*"
CONTRIB_FILE = "contrib/tmpfiles.d/kvcached.conf"
UPSTREAM_PR = "ovg-project/kvcached PR 414"


@dataclass(frozen=True)
class HostConfig:
    """Where the host's configuration is read: the real paths, or the same paths under `root` (tests, chroots)."""

    root: str = "/"
    logind_conf: str = "/etc/systemd/logind.conf"
    # Drop-in directories, most important first: a file name in an earlier one masks the same name in later ones.
    logind_dropins: tuple[str, ...] = ("/etc/systemd/logind.conf.d", "/run/systemd/logind.conf.d",
                                       "/usr/local/lib/systemd/logind.conf.d", "/usr/lib/systemd/logind.conf.d")
    linger_dir: str = "/var/lib/systemd/linger"
    tmpfiles_dirs: tuple[str, ...] = ("/etc/tmpfiles.d", "/run/tmpfiles.d", "/usr/local/lib/tmpfiles.d",
                                      "/usr/lib/tmpfiles.d")
    passwd: str = "/etc/passwd"

    def at(self, path: str) -> str:
        """`path` as this machine reaches it (under `root`)."""
        return path if self.root in ("", "/") else os.path.join(self.root, path.lstrip("/"))


class Finding(NamedTuple):
    """One doctor line's content: status ("ok", "warn", "skip"), what, the fix, and its details."""

    status: str
    summary: str
    fix: str | None = None
    details: Mapping[str, Any] = {}


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(1 << 20)
    except OSError:
        return None


def _dropins(cfg: HostConfig, dirs: Sequence[str]) -> list[str]:
    """`*.conf` files of the directories, the first directory's winning by name, in file-name order (systemd's rule).

    A file that is a link to /dev/null masks the name and is read as empty.
    """
    chosen: dict[str, str] = {}
    for d in dirs:
        try:
            names = os.listdir(cfg.at(d))
        except OSError:
            continue
        for n in names:
            if n.endswith(".conf") and n not in chosen:
                chosen[n] = os.path.join(cfg.at(d), n)
    return [chosen[n] for n in sorted(chosen) if os.path.realpath(chosen[n]) != "/dev/null"]


# logind ---------------------------------------------------------------------


def remove_ipc(cfg: HostConfig) -> tuple[bool, str]:
    """logind's effective RemoveIPC= and where it was set (systemd's compiled default, yes, when nowhere)."""
    value, source = True, "systemd's default"
    for path in [cfg.at(cfg.logind_conf), *_dropins(cfg, cfg.logind_dropins)]:
        text = _read(path)
        section = None
        for raw in (text or "").splitlines():
            line = raw.strip()
            if not line or line[0] in "#;":
                continue
            if line.startswith("[") and line.endswith("]"):
                section = line[1:-1]
                continue
            key, sep, val = line.partition("=")
            if section == "Login" and sep and key.strip() == "RemoveIPC":
                word = val.strip().lower()
                if word in _TRUE or word in _FALSE:  # systemd ignores a value it cannot parse, keeping the last one
                    value, source = word in _TRUE, path
    return value, source


def _user_name(cfg: HostConfig, uid: int) -> str | None:
    text = _read(cfg.at(cfg.passwd))
    for line in (text or "").splitlines():
        parts = line.split(":")
        if len(parts) > 2 and parts[2] == str(uid):
            return parts[0]
    if cfg.root in ("", "/"):
        try:
            return pwd.getpwuid(uid).pw_name  # users known through NSS only (LDAP, sssd)
        except KeyError:
            return None
    return None


def check_remove_ipc(cfg: HostConfig, serves: Mapping[int, Sequence[int]]) -> Finding:
    """Warn when logind removes IPC at logout and a serve runs as a regular user without a lingering session.

    `serves`: uid -> PIDs of kvcached deployments' and engines' processes.
    """
    on, source = remove_ipc(cfg)
    if not on:
        return Finding("ok", f"systemd-logind RemoveIPC=no ({source}): a logout leaves users' shared memory alone",
                       details={"remove_ipc": False, "source": source})
    at_risk: dict[str, list[int]] = {}
    for uid, pids in sorted(serves.items()):
        if uid <= SYSTEM_UID_MAX or uid == NOBODY:
            continue
        name = _user_name(cfg, uid)
        if name is not None and os.path.exists(os.path.join(cfg.at(cfg.linger_dir), name)):
            continue  # a lingering user is never logged out of its manager: its IPC stays
        at_risk[name or str(uid)] = sorted(pids)
    details = {"remove_ipc": True, "source": source, "users": at_risk}
    if not at_risk:
        return Finding("ok", f"systemd-logind RemoveIPC=yes ({source}); no serve here runs as a regular user "
                       "without a lingering session", details=details)
    who = "; ".join(f"user {u} (PID {', '.join(map(str, p[:4]))})" for u, p in at_risk.items())
    users = " ".join(at_risk)
    return Finding(
        "warn", f"systemd-logind RemoveIPC=yes ({source}) removes a user's POSIX shared memory at its last logout, "
        f"live kvcached segments and engine buffers included (vLLM issue 54259); serves run as {who} without a "
        "lingering session", f"loginctl enable-linger {users}; or set RemoveIPC=no in a drop-in "
        "(/etc/systemd/logind.conf.d/kvcached.conf: [Login] RemoveIPC=no) and restart systemd-logind; "
        "or run the serve as a system user or a systemd service", details)


# tmpfiles -------------------------------------------------------------------


@dataclass(frozen=True)
class TmpfilesRule:
    """One tmpfiles.d line that matters here: its type letter, path (maybe a glob), age, and where it is."""

    type: str
    path: str
    age: str | None
    source: str
    line: int
    text: str = field(compare=False, default="")


def tmpfiles_rules(cfg: HostConfig) -> list[TmpfilesRule]:
    """Every aging and exclusion line of the tmpfiles.d files systemd-tmpfiles would read, in its order."""
    out = []
    for path in _dropins(cfg, cfg.tmpfiles_dirs):
        for n, raw in enumerate((_read(path) or "").splitlines(), 1):
            fields = raw.split()
            if not fields or fields[0].startswith("#") or len(fields) < 2:
                continue
            letter = fields[0].rstrip("!-=~^+?")[:1]  # modifiers follow the letter (boot-only, ignore errors...)
            if letter not in _AGING_TYPES | _EXCLUDE_TYPES:
                continue
            age = fields[5] if len(fields) > 5 and fields[5] != "-" else None
            out.append(TmpfilesRule(letter, fields[1], age, path, n, raw.strip()))
    return out


def _inside(path: str, glob: str) -> bool:
    """Whether `glob` names `path` or a directory above it (tmpfiles.d globs are shell globs)."""
    p = path
    while True:
        if fnmatch.fnmatchcase(p, glob):
            return True
        if p in ("/", ""):
            return False
        p = os.path.dirname(p)


def _ages(rule: TmpfilesRule, path: str) -> bool:
    """Whether an aging rule would clean `path`: the rule's directory is above it (an age on the path itself
    ages its contents, not the path)."""
    return rule.type in _AGING_TYPES and rule.age is not None and _inside(os.path.dirname(path), rule.path)


def protected_paths(names: Iterable[str] = ()) -> list[str]:
    """The paths kvcached needs kept, as a node with these deployments shows them: a default-named segment and
    socket directory, and each named deployment's."""
    paths = ["/dev/shm/kvcached_vLLM_1", "/tmp/" + socket_dir_name("kvcached_vLLM_1"), "/tmp/kvctl-gc.lock"]
    for n in sorted(set(names)):
        paths += [f"/dev/shm/{n}", "/tmp/" + socket_dir_name(n)]
    return paths


def check_tmpfiles(cfg: HostConfig, names: Iterable[str] = ()) -> Finding:
    """Warn when a tmpfiles.d rule ages /dev/shm or /tmp over a kvcached path no `x` line excludes."""
    rules = tmpfiles_rules(cfg)
    excludes = [r for r in rules if r.type in _EXCLUDE_TYPES]
    exposed: dict[str, list[TmpfilesRule]] = {}
    for path in protected_paths(names):
        agers = [r for r in rules if _ages(r, path)]
        # An X line excludes the directory itself, not what it holds: a segment (a file) it names is excluded.
        if agers and not any(_inside(path, r.path) if r.type == "x" else fnmatch.fnmatchcase(path, r.path)
                             for r in excludes):
            exposed[path] = agers
    agers = sorted({r for rs in exposed.values() for r in rs}, key=lambda r: (r.source, r.line))
    details = {"rules": [f"{r.source}:{r.line}: {r.text}" for r in rules if r.type in _AGING_TYPES],
               "exposed": sorted(exposed)}
    if not exposed:
        aging = [r for r in rules if r.type in _AGING_TYPES and r.age is not None and
                 any(_inside(d, r.path) for d in ("/dev/shm", "/tmp"))]
        if aging:
            return Finding("ok", f"{len(aging)} systemd-tmpfiles rule(s) age /dev/shm or /tmp; kvcached's paths are "
                           "excluded", details=details)
        return Finding("ok", "no systemd-tmpfiles rule ages /dev/shm or /tmp", details=details)
    first = agers[0]
    where = ", ".join(sorted(exposed)[:3])
    return Finding(
        "warn", f"systemd-tmpfiles ages kvcached's live paths ({first.source}:{first.line}: {first.text!r}"
        f"{f' and {len(agers) - 1} more' if len(agers) > 1 else ''}): its clean-up removes segments older than "
        f"the age, live or not, e.g. {where}",
        f"install {CONTRIB_FILE} as /etc/tmpfiles.d/kvcached.conf (its x lines exclude kvcached's paths); a "
        "deployment with its own KVCACHED_IPC_NAME needs its own line: x /dev/shm/<name>", details)


# upstream kvcached's revisioned limits -------------------------------------

# Run in the serve's interpreter, from /. find_spec of a top-level name does not import it; the module's source is
# read, not imported (upstream's import loads torch and its extension).
UPSTREAM_PROBE = r"""
import importlib.metadata, importlib.util, json, os, re, sys
sys.path[:] = [p for p in sys.path if p]  # -c puts kvctl's working directory first: the serve's is not it
pattern = re.compile(r"^def\s+set_instance_memory_limit\s*\(", re.M)
spec = importlib.util.find_spec("kvcached")
where = list(spec.submodule_search_locations or []) if spec is not None else []
found = []
for loc in where:
    path = os.path.join(loc, "control.py")
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            if pattern.search(f.read()):
                found.append(path)
    except OSError:
        pass
try:
    version = importlib.metadata.version("kvcached")
except Exception:
    version = None
print(json.dumps({"found": found, "version": version, "package": where}))
"""


def check_upstream_limits(python: str, environ: Mapping[str, str], timeout: float = 60.0) -> Finding:
    """Say so where the serve's interpreter has upstream kvcached's in-process revisioned limits installed."""
    try:
        r = subprocess.run([python, "-c", UPSTREAM_PROBE], capture_output=True, text=True, timeout=timeout,
                           env={**environ, "PYTHONDONTWRITEBYTECODE": "1"}, stdin=subprocess.DEVNULL, cwd="/")
        doc = json.loads(r.stdout)
    except (OSError, subprocess.TimeoutExpired, ValueError) as e:
        return Finding("skip", f"could not look for upstream kvcached in {python}: {e}")
    found, version = doc.get("found") or [], doc.get("version")
    if not found:
        return Finding("ok", f"no upstream kvcached with in-process revisioned limits in {python}",
                       details={"package": doc.get("package")})
    return Finding(
        "warn", f"upstream kvcached {version or '?'} in {python} has in-process revisioned limits "
        f"(kvcached.control.set_instance_memory_limit, {UPSTREAM_PR}; {found[0]}): a controller calling it and "
        "kvctl limit both set a pool's limit and do not reconcile, so whichever wrote last holds, and the "
        "controller's revision never sees kvctl's change",
        "set each serve's limit one way: through the in-process controller, or with kvctl limit, not both",
        {"paths": found, "version": version})


def serve_uids(processes: Iterable[Any]) -> dict[int, list[int]]:
    """uid -> PIDs, of processes given as (pid, uid) pairs or objects with .pid and .uid."""
    out: dict[int, list[int]] = {}
    for p in processes:
        pid, uid = (p.pid, p.uid) if hasattr(p, "uid") else p
        out.setdefault(uid, []).append(pid)
    return out
