"""The deployment names present on a node, from two directory listings: what shell completion offers.

A TAB press re-runs kvctl, so this reads no /proc, tests no lease and binds
nothing; it imports only the naming rules. It offers the names `scan.scan`
finds (a test holds the two to the same answer): socket directories whose
hash suffix matches their name, and the /dev/shm files scan takes for
segments (named by such a directory, of a default name, or a single-link
24-byte file marked by our runtime or carrying a positive limit).
"""

from __future__ import annotations

import os
import stat

from ... import settings
from ..base import name_rules
from ..base.layout import SEGMENT_SIZE


def _open_dir(path: str) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None


def _segment_shaped(entry: str, shm_fd: int) -> bool:
    try:
        st = os.stat(entry, dir_fd=shm_fd, follow_symlinks=False)
    except OSError:
        return False
    if not (stat.S_ISREG(st.st_mode) and st.st_size == SEGMENT_SIZE and st.st_nlink == 1):
        return False
    # Rare on a node (a 24-byte file nothing names): only now pay for the segment module.
    from ..state.segment import has_mark, peek_limit

    if has_mark(entry, shm_fd):
        return True
    limit = peek_limit(entry, shm_fd, st)
    return limit is not None and limit > 0


def node_dirs(root: str) -> tuple[str, str]:
    """(tmp, dev/shm) under `root`, as Layout(root) has them (a test compares the two)."""
    return os.path.normpath(os.path.join(root, "tmp")), os.path.normpath(os.path.join(root, "dev/shm"))


def may_hold_state(root: str = "/") -> bool:
    """False only when nothing under `root` can be kvcached state, whatever names processes carry.

    The scan takes a socket directory only by its `kvcached-tp-` name, and a file
    in /dev/shm only by a valid IPC name; with neither there (or a directory that
    cannot be listed, which the scan must report), there is nothing to judge.
    """
    tmp, shm = node_dirs(root)
    for path, ours in ((tmp, lambda e: e.startswith("kvcached-tp-")), (shm, name_rules.is_valid_name)):
        fd = _open_dir(path)
        if fd is None:
            if os.path.lexists(path):
                return True  # there but not listable: the scan says why
            continue
        try:
            if any(ours(entry) for entry in os.listdir(fd)):
                return True
        finally:
            os.close(fd)
    return False


def deployment_names(root: str = "/") -> set[str]:
    """The names of the kvcached deployments whose state is under `root` (its tmp/ and dev/shm/)."""
    names: set[str] = set()
    tmp, shm = node_dirs(root)
    tmp_fd = _open_dir(tmp)
    if tmp_fd is not None:
        try:
            for entry in os.listdir(tmp_fd):
                parsed = name_rules.parse_socket_dir_name(entry)
                if parsed is not None and parsed[1]:
                    names.add(parsed[0])
        finally:
            os.close(tmp_fd)
    dirs = set(names)
    shm_fd = _open_dir(shm)
    if shm_fd is not None:
        try:
            for entry in os.listdir(shm_fd):
                if entry in dirs or name_rules.DEFAULT_NAME_RE.match(entry) is not None:
                    names.add(entry)
                elif name_rules.is_valid_name(entry) and _segment_shaped(entry, shm_fd):
                    names.add(entry)
        finally:
            os.close(shm_fd)
    return names


# The first characters of every engine family's names in /dev/shm (kvcached.node.clean.leftovers.families; a test
# holds the two together): a name without one is no engine's, and costs plain gc no pattern match.
ENGINE_SHM_PREFIXES = ("psm_", "vllm_mm_", "vllm_offload_", "vllm_ec_", "sgl_shm_", "multi_tokenizer_args_",
                       "sglang_loads_", "nccl-", "cuda.shm.", "torch_", "sem.mp-", "sem.loky-")
_UUID_LEN = 36
# SGLang's ZMQ sockets: tempfile's names, "tmp" and 8 characters (families.py).
_TEMPFILE_PREFIX, _TEMPFILE_LEN = "tmp", 11


def rpc_dirs(root: str = "/", environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """vLLM's RPC directory from VLLM_RPC_BASE_PATH (as vLLM reads it: an absolute path), re-based under `root`."""
    value = settings.VLLM_RPC_BASE_PATH.get(environ)
    if not value or not os.path.isabs(value):
        return ()
    return (os.path.normpath(os.path.join(root, value.lstrip("/"))),)


def _listed(directory: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as it:
            return list(it)
    except OSError:
        return []


def _rpc_shaped(name: str) -> bool:
    """Whether `name` has the length and fixed characters of an RPC family's names (the pattern decides)."""
    if len(name) == _UUID_LEN:
        return name[8] == "-"
    return len(name) == _TEMPFILE_LEN and name.startswith(_TEMPFILE_PREFIX)


def engine_leftover_count(root: str = "/", rpc_dirs: tuple[str, ...] = (), exclude: frozenset[str] = frozenset()
                          ) -> int:
    """How many entries under `root` carry an engine family's name (`exclude`: /dev/shm names kvcached took).

    By name and directory-entry type alone, judged not at all: what plain gc
    may mention on stderr without the engine pass (no /proc, no maps, no
    stat). The name patterns are imported only when a name could be one.
    """
    tmp, shm = node_dirs(root)
    shm_names = [e.name for e in _listed(shm) if e.name.startswith(ENGINE_SHM_PREFIXES) and e.name not in exclude]
    # vLLM's ZMQ sockets are named by a uuid4, SGLang's by tempfile; the entry's d_type tells a directory or a
    # file without a stat (tempfile's names are mostly files: mkstemp's, and those SGLang never bound).
    rpc_names = [e.name for d in (tmp, *rpc_dirs) for e in _listed(d)
                 if _rpc_shaped(e.name)
                 and not e.is_dir(follow_symlinks=False) and not e.is_file(follow_symlinks=False)]
    if not shm_names and not rpc_names:
        return 0
    from .leftovers.families import Where, match_name

    return (sum(match_name(Where.SHM, n) is not None for n in shm_names)
            + sum(match_name(Where.RPC, n) is not None for n in rpc_names))
