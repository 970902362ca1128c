"""The IPC name rules of docs/NODE.md §1, shared with upstream kvcached."""

from __future__ import annotations

import importlib.util
import os
import re
import uuid
from collections.abc import Mapping

from ... import settings

MAX_NAME = 64
TAGS = ("vLLM", "SGLang", "proc")
ENV_NAME = settings.IPC_NAME.name

# Default names: kvcached_<Tag>_<PGID>, optionally with our `_dp<rank>` data-parallel
# suffix, then the `_g<id>` group suffix or the `_<n>` uniqueness suffix
# upstream's code paths mention.
DEFAULT_NAME_RE = re.compile(rf"^kvcached_({'|'.join(TAGS)})_([0-9]+)(?:_dp[0-9]+)?(?:_g[0-9]+|_[0-9]+)?\Z")
# Every DP rank of one serve is its own engine with its own KV pool: it gets its
# own name, `<serve name>_dp<rank>` (docs/NODE.md §1). Upstream has no DP rule: it gives
# all ranks one name, and their workers collide on the same sockets.
DP_SUFFIX_RE = re.compile(r"^(.+)_dp([0-9]+)\Z")


def sanitize(raw: str) -> str:
    """Apply upstream's rule: non-alnum (Unicode-aware) other than `_`/`-` becomes `-`, cut to 64."""
    return "".join(c if (c.isalnum() or c in "_-") else "-" for c in raw)[:MAX_NAME]


def is_valid_name(name: str) -> bool:
    """True when `name` is already in sanitised form (what a path component may carry)."""
    return bool(name) and sanitize(name) == name


def engine_tag() -> str:
    """`vLLM` if importable, else `SGLang`, else `proc`: what is installed, not what runs."""
    # find_spec looks for the package without importing it (vLLM takes seconds to import).
    for module, tag in (("vllm", "vLLM"), ("sglang", "SGLang")):
        try:
            if importlib.util.find_spec(module) is not None:
                return tag
        except (ImportError, ValueError):
            continue
    return "proc"


def _process_group() -> int:
    for get in (lambda: os.getpgid(0), lambda: os.getsid(0)):
        try:
            return get()
        except OSError:
            continue
    return os.getpid()


def default_ipc_name(tag: str | None = None, pgid: int | None = None) -> str:
    """The name a process gets without `KVCACHED_IPC_NAME`: kvcached_<Tag>_<PGID>."""
    return f"kvcached_{tag or engine_tag()}_{_process_group() if pgid is None else pgid}"


def ipc_name_from_env(environ: Mapping[str, str] | None = None, *, tag: str | None = None) -> str:
    """The deployment's IPC name: sanitised `KVCACHED_IPC_NAME`, else the default name."""
    explicit = settings.IPC_NAME.get(environ)
    if explicit:
        return sanitize(explicit)
    return default_ipc_name(tag)


def dp_rank_name(name: str, rank: int) -> str:
    """The IPC name of data-parallel rank `rank` of the serve named `name`: `<name>_dp<rank>`, within 64 characters.

    The serve's name is cut, never the suffix: two ranks must never share a name.
    """
    if rank < 0:
        raise ValueError(f"DP rank must be ≥ 0, got {rank}")
    suffix = f"_dp{rank}"
    return name[:MAX_NAME - len(suffix)] + suffix


def split_dp_rank(name: str) -> tuple[str, int | None]:
    """(serve name, DP rank) of an IPC name; (name, None) for a name without the `_dp<rank>` suffix."""
    m = DP_SUFFIX_RE.match(name)
    return (m.group(1), int(m.group(2))) if m else (name, None)


def default_name_pgid(name: str) -> int | None:
    """The PGID a default-form name embeds, or None for explicit names."""
    m = DEFAULT_NAME_RE.match(name)
    return int(m.group(2)) if m else None


_DNS_NAMESPACE = uuid.NAMESPACE_DNS.bytes


def socket_hash(name: str) -> str:
    """Upstream's 8-hex-digit suffix of the socket directory: the first 8 hex digits of uuid5(NAMESPACE_DNS, name)."""
    # hashlib is imported here, not at the top: it loads OpenSSL, which a kvctl run that hashes no
    # name (TAB completion, a gc over a node without socket directories) should not pay for.
    import hashlib

    # uuid5 is SHA-1 over namespace + name with version and variant bits set in bytes 6
    # and 8; the first four bytes are the digest's own. Without the UUID object: a
    # scan checks one hash per socket directory (bench/bench_gc.py).
    return hashlib.sha1(_DNS_NAMESPACE + name.encode("utf-8"), usedforsecurity=False).hexdigest()[:8]


def socket_dir_name(name: str) -> str:
    """`kvcached-tp-<name>-<hash>` for an already-sanitised name."""
    return f"kvcached-tp-{name}-{socket_hash(name)}"


# `\Z`, never `$`: `$` also matches before a trailing newline, and a planted
# `w0.sock\n` must not pass for ours.
SOCKET_DIR_RE = re.compile(r"^kvcached-tp-(.+)-([0-9a-f]{8})\Z", re.DOTALL)
SOCKET_RE = re.compile(r"^w([0-9]+)\.sock\Z")
STAGE_RE = re.compile(r"^pp([1-9][0-9]*)\Z")


def parse_socket_dir_name(dirname: str) -> tuple[str, bool] | None:
    """(name, hash_matches) for a `kvcached-tp-*` directory name, None when not of that form."""
    m = SOCKET_DIR_RE.match(dirname)
    if not m:
        return None
    name, digest = m.group(1), m.group(2)
    return name, (is_valid_name(name) and socket_hash(name) == digest)


def parse_socket_name(filename: str) -> int | None:
    """The TP rank of `w<r>.sock`, None for any other name."""
    m = SOCKET_RE.match(filename)
    return int(m.group(1)) if m else None


def parse_stage_name(dirname: str) -> int | None:
    """The PP stage of `pp<k>` (k ≥ 1), None for any other name."""
    m = STAGE_RE.match(dirname)
    return int(m.group(1)) if m else None
