"""Every path of a kvcached node, from one root, in both directions (docs/NODE.md §1-3)."""

# No `from __future__ import annotations`: a NamedTuple's string annotations are each compiled at
# class creation (typing.ForwardRef), a cost every kvctl start pays (bench/bench_cli_start.py).
import os
from enum import Enum
from pathlib import PurePosixPath
from typing import NamedTuple

from . import name_rules
from .errors import InvalidName, PathTooLong

SUN_PATH_MAX = 108  # sizeof(sockaddr_un.sun_path), NUL included
SEGMENT_SIZE = 24  # a limit segment: three signed 64-bit integers (docs/NODE.md §2; state/segment.py reads them)


class PathKind(str, Enum):
    SEGMENT = "segment"
    SOCKET_DIR = "socket_dir"
    STAGE_DIR = "stage_dir"
    SOCKET = "socket"

    def __str__(self) -> str:
        return self.value


class PathRef(NamedTuple):
    """What a path means: which deployment, which kind, rank and stage."""

    kind: PathKind
    deployment: str
    hash_ok: bool = True
    rank: int | None = None
    stage: int | None = None


class Layout(NamedTuple):
    """Where a node keeps kvcached state; `root` re-bases /tmp and /dev/shm (tests, --root, --pid).

    `seen_root` is the root as the node's processes see it: the paths that
    /proc/<pid>/net/unix lists are relative to it. With `--root DIR` processes
    bind under DIR too, so the two are the same; with `--pid PID` we look in
    through /proc/PID/root while the processes there see "/".

    Immutable; a NamedTuple (as PathRef) rather than a frozen dataclass:
    every kvctl command builds one, and a dataclass costs a cold start its
    generated methods (bench/bench_cli_start.py).
    """

    root: str = "/"
    seen_root: str | None = None
    # One place of the node judged on its own (kvcached.node.places): its /dev/shm or /tmp given as a
    # directory reached from here, "" for the one the place does not have (a place is one filesystem).
    shm: str | None = None
    tmp: str | None = None

    @classmethod
    def for_pid(cls, pid: int, proc_root: str = "/proc") -> "Layout":
        """The node as process `pid` sees it (its mount namespace), reached from here."""
        return cls(root=f"{proc_root}/{pid}/root", seen_root="/")

    @property
    def tmp_dir(self) -> str:
        return _join(self.root, "tmp") if self.tmp is None else self.tmp

    @property
    def shm_dir(self) -> str:
        return _join(self.root, "dev/shm") if self.shm is None else self.shm

    def segment_path(self, name: str) -> str:
        """/dev/shm/<name>."""
        _check(name)
        return _join(self.shm_dir, name)

    def socket_dir(self, name: str) -> str:
        """/tmp/kvcached-tp-<name>-<hash>."""
        _check(name)
        return _join(self.tmp_dir, name_rules.socket_dir_name(name))

    def stage_dir(self, name: str, stage: int = 0) -> str:
        """The directory holding stage `stage`'s sockets (the socket dir itself for stage 0)."""
        base = self.socket_dir(name)
        return base if stage == 0 else _join(base, f"pp{stage}")

    def socket_path(self, name: str, rank: int, stage: int = 0) -> str:
        """[pp<k>/]w<rank>.sock inside the deployment's socket dir."""
        if rank < 0 or stage < 0:
            raise InvalidName(f"rank and stage must be ≥ 0 (got rank={rank}, stage={stage})")
        return _join(self.stage_dir(name, stage), f"w{rank}.sock")

    def socket_paths(self, name: str, tp_size: int, pp_size: int = 1) -> list[tuple[int, int, str]]:
        """(stage, rank, path) for every worker of a TP × PP shape."""
        return [(s, r, self.socket_path(name, r, s)) for s in range(pp_size) for r in range(tp_size)]

    def check_socket_path(self, path: str) -> None:
        """Raise PathTooLong when `path` (as processes see it) cannot be bound."""
        seen = self.seen_path(path)
        if len(os.fsencode(seen)) >= SUN_PATH_MAX:
            raise PathTooLong(
                f"{seen}: socket path is {len(os.fsencode(seen))} bytes, over the {SUN_PATH_MAX - 1}-byte limit"
            )

    def seen_path(self, path: str) -> str:
        """The path as the node's processes name it (what /proc/net/unix lists)."""
        if self.seen_root is None:
            return path
        rel = os.path.relpath(path, self.root)
        return _join(self.seen_root, rel)

    def classify(self, path: str) -> PathRef | None:
        """Which deployment, kind, rank and stage `path` belongs to; None when not ours by name."""
        p = PurePosixPath(os.path.normpath(path))
        tmp, shm = PurePosixPath(self.tmp_dir), PurePosixPath(self.shm_dir)
        if p.parent == shm:
            return _classify_segment(p.name)
        try:
            rel = p.relative_to(tmp)
        except ValueError:
            return None
        parts = rel.parts
        if not parts:
            return None
        parsed = name_rules.parse_socket_dir_name(parts[0])
        if parsed is None:
            return None
        name, hash_ok = parsed
        if len(parts) == 1:
            return PathRef(kind=PathKind.SOCKET_DIR, deployment=name, hash_ok=hash_ok)
        stage = 0
        rest = parts[1:]
        if (k := name_rules.parse_stage_name(rest[0])) is not None:
            stage, rest = k, rest[1:]
            if not rest:
                return PathRef(kind=PathKind.STAGE_DIR, deployment=name, hash_ok=hash_ok, stage=stage)
        if len(rest) == 1 and (r := name_rules.parse_socket_name(rest[0])) is not None:
            return PathRef(kind=PathKind.SOCKET, deployment=name, hash_ok=hash_ok, rank=r, stage=stage)
        return None


def _classify_segment(filename: str) -> PathRef | None:
    # Only default-form names are recognisably ours from the name alone; explicit
    # names are ours when something else ties them to kvcached (a socket dir, a
    # process's KVCACHED_IPC_NAME, an operator naming them). The scanner does that.
    if name_rules.DEFAULT_NAME_RE.match(filename):
        return PathRef(kind=PathKind.SEGMENT, deployment=filename)
    return None


def _check(name: str) -> None:
    if not name_rules.is_valid_name(name):
        raise InvalidName(f"{name!r} is not a valid IPC name "
                          f"(letters, digits, '_' and '-', at most {name_rules.MAX_NAME})")


def _join(base: str, rel: str) -> str:
    return os.path.normpath(os.path.join(base, rel))
