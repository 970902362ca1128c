"""Every environment variable kvcached and kvctl read, declared once: its type, its default, what it does.

A setting is read when it is used (`SETTING.get()`), never at import, so a
test or a launcher that changes the environment is seen by the next read.
Values are parsed one way for every variable:

- unset or blank: the default;
- a value that does not parse: one warning naming the variable, its value and
  the default used instead (once per value, however often it is read);
- except for the settings marked `strict`, where using the default would do
  harm: there a bad value raises `SettingError`, which says why. Two are:
  `KVCACHED_ROOT` (falling back to `/` would point an engine meant for a test
  or a chroot at the node's real /dev/shm and /tmp, where its names could meet
  a live deployment's) and `KVCACHED_REQUIRE_EXT` (CI sets it so that a build
  without the extension fails; falling back to "optional" would let exactly
  that build pass).

Only the standard library, and cheap to import (no typing, dataclasses or
logging at import: shell completion passes through here): `setup.py` loads this
file by its path to read the build switches, before anything is installed.
docs/ENVIRONMENT.md documents the same set; a test holds the two together.
"""

from __future__ import annotations

import _thread
import math
import os

# Cheap to import by design (kvctl's shell completion reads names through kvcached.node.base.name_rules, which reads a
# setting): no typing, dataclasses or logging at import. mypy reads the branch below (any name TYPE_CHECKING).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from typing import Any, Generic, TypeVar

    T = TypeVar("T")

    class _Generic(Generic[T]):
        pass
else:
    T = object

    class _Generic:
        def __class_getitem__(cls, _item: object) -> type:  # Setting[bool] at run time, without typing
            return cls

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


class SettingError(ValueError):
    """A strict setting whose value does not parse: the message names the variable, the value and why."""

    def __init__(self, name: str, raw: str, why: str, harm: str) -> None:
        super().__init__(f"{name}={raw!r}: {why} (not falling back to the default: {harm})")
        self.name = name
        self.raw = raw


class Amount:
    """A size in bytes or a share of something: what `KVCACHED_LIMIT=40G` or `=80%` says."""

    __slots__ = ("bytes", "share")

    def __init__(self, bytes: int | None = None, share: float | None = None) -> None:
        self.bytes = bytes
        self.share = share  # in (0, 1]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Amount) and (self.bytes, self.share) == (other.bytes, other.share)

    def __hash__(self) -> int:
        return hash((self.bytes, self.share))

    def __repr__(self) -> str:
        return f"Amount(bytes={self.bytes!r}, share={self.share!r})"


class Setting(_Generic[T]):
    """One environment variable: name, kind (for the reader), default, meaning, and how its text becomes a value."""

    def __init__(self, name: str, kind: str, default: T, doc: str, parse: Callable[[str], T], *,
                 strict: str | None = None, blank_is_unset: bool = True) -> None:
        self.name = name
        self.kind = kind
        self.default = default
        self.doc = doc
        self.parse = parse
        self.strict = strict  # why a default would do harm: a bad value raises SettingError instead
        self.blank_is_unset = blank_is_unset  # False: an empty value means something (VLLM_PLUGINS="")

    def __repr__(self) -> str:
        return f"Setting({self.name!r}, default={self.default!r})"

    def raw(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The variable's text as set, or None when unset (blank too, unless blank means something)."""
        value = (os.environ if environ is None else environ).get(self.name)
        if value is None or (self.blank_is_unset and not value.strip()):
            return None
        return value

    def get(self, environ: Mapping[str, str] | None = None) -> T:
        """The value now (from `environ`, default os.environ); the default when unset or unusable."""
        raw = self.raw(environ)
        if raw is None:
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            if self.strict is not None:
                raise SettingError(self.name, raw, str(e), self.strict) from None
            _warn_once(self, raw, str(e))
            return self.default


_warned: set[tuple[str, str]] = set()
_warned_lock = _thread.allocate_lock()


def _warn_once(setting: Setting[Any], raw: str, why: str) -> None:
    with _warned_lock:
        if (setting.name, raw) in _warned:
            return
        _warned.add((setting.name, raw))
    import logging  # only when there is something to say (see the imports above)

    logging.getLogger("kvcached.settings").warning("kvcached: %s=%r is not usable (%s); using the default, %s",
                                                   setting.name, raw, why, _shown(setting.default))


def _shown(value: object) -> str:
    return "unset" if value is None else repr(value)


# Parsers: text in, a value out, ValueError with a reader's reason otherwise. ------------------------------


def flag(raw: str) -> bool:
    """1/true/yes/on or 0/false/no/off, any case."""
    word = raw.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError("not one of 1, true, yes, on / 0, false, no, off")


def seconds(minimum: float) -> Callable[[str], float]:
    """A finite number of seconds, at least `minimum`."""

    def parse(raw: str) -> float:
        try:
            value = float(raw.strip())
        except ValueError:
            raise ValueError("not a number of seconds") from None
        if not math.isfinite(value) or value < minimum:
            raise ValueError(f"not a number of seconds >= {minimum:g}")
        return value

    return parse


def count(raw: str) -> int:
    """A whole number >= 0."""
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError("not a whole number") from None
    if value < 0:
        raise ValueError("negative")
    return value


def page_bytes(raw: str) -> int:
    """A positive number of bytes that is a multiple of 4096 (the smallest page the CPU backend maps)."""
    value = count(raw)
    if value == 0 or value % 4096:
        raise ValueError("not a positive multiple of 4096 bytes")
    return value


def absolute_path(raw: str) -> str:
    """An absolute path (relative ones would depend on where each process happens to run)."""
    path = raw.strip()
    if not os.path.isabs(path):
        raise ValueError("not an absolute path")
    return path


def percent(raw: str) -> float:
    """A share of a whole in percent, above 0 and at most 100 (`85`, `85%`)."""
    try:
        value = float(raw.strip().removesuffix("%"))
    except ValueError:
        raise ValueError("not a number of percent") from None
    if not 0 < value <= 100:
        raise ValueError("not above 0 and at most 100 percent")
    return value


def text(raw: str) -> str:
    """Any text, as set."""
    return raw


def amount(raw: str) -> Amount:
    """A size (`40G`, `512M`, bytes) or a share (`80%`), as `kvctl limit` reads them."""
    from .node.base.units import parse_percent, parse_size  # stdlib only; loaded only when a limit is read

    value = raw.strip()
    if value.endswith("%"):
        share = parse_percent(value) / 100
        if not 0 < share <= 1:
            raise ValueError("a share must be above 0% and at most 100%")
        return Amount(share=share)
    return Amount(bytes=parse_size(value))


# The variables. ---------------------------------------------------------------------------------------------

# Turning kvcached on in an engine.
ENABLE_KVCACHED = Setting("ENABLE_KVCACHED", "flag", False,
                          "upstream kvcached's switch: turns the vLLM and SGLang plugins on", flag)
ENABLE = Setting("KVCACHED_ENABLE", "flag", False, "turns the vLLM and SGLang plugins on", flag)
ELASTIC = Setting("KVCACHED_ELASTIC", "flag", False,
                  "elastic KV memory (vLLM's elastic-kv patch, SGLang's sglang-elastic-kv); also turns the plugins on",
                  flag)
VLLM_PLUGINS = Setting[str | None]("VLLM_PLUGINS", "list", None,
                                   "vLLM's own plugin allow-list (comma-separated); must name kvcached when set",
                                   text, blank_is_unset=False)
SGLANG_PLUGINS = Setting[str | None]("SGLANG_PLUGINS", "list", None,
                                     "SGLang's own plugin allow-list (comma-separated); must name kvcached when set "
                                     "and not empty", text, blank_is_unset=False)

# Where and under which name.
IPC_NAME = Setting("KVCACHED_IPC_NAME", "name", "",
                   "the deployment's IPC name (sanitised); unset: kvcached_<Tag>_<PGID>", text)
ROOT = Setting("KVCACHED_ROOT", "path", "/",
               "re-bases /tmp and /dev/shm for the runtime in engine processes (tests, chroots)", absolute_path,
               strict="falling back to / would point this engine at the node's real /dev/shm and /tmp, where its "
                      "names could meet a live deployment's")
DP_SERVE = Setting("KVCACHED_DP_SERVE", "flag", False,
                   "internal: set by the engine owner for the engines of a data-parallel serve (names per DP rank)",
                   flag)

# The engine's segment and its figures.
LIMIT = Setting[Amount | None]("KVCACHED_LIMIT", "size or %", None,
                               "the limit an engine claims its segment with; unset: the engine's memory share of "
                               "one device (vLLM's gpu_memory_utilization, SGLang's mem_fraction_static)", amount)
PUBLISH_INTERVAL_S = Setting("KVCACHED_PUBLISH_INTERVAL_S", "seconds", 1.0,
                             "how often an engine publishes its KV cache usage to the segment", seconds(0.01))
OWNER_EXIT_WAIT_S = Setting("KVCACHED_OWNER_EXIT_WAIT_S", "seconds", 2.0,
                            "how long the engine owner waits for confirmed engine exits before it cleans up",
                            seconds(0))
OWNER_RETRY_S = Setting("KVCACHED_OWNER_RETRY_S", "seconds", 60.0,
                        "how long the engine owner keeps retrying cleanup of nodes still served after shutdown",
                        seconds(0))

# The start-up sweep: an engine that starts with kvcached removes what gc proves dead, in the background.
STARTUP_SWEEP = Setting("KVCACHED_STARTUP_SWEEP", "flag", True,
                        "a starting engine sweeps the provably stale kvcached state of its own uid on the node, in "
                        "the background (off: 0)", flag)
STARTUP_SWEEP_ENGINES = Setting("KVCACHED_STARTUP_SWEEP_ENGINES", "flag", False,
                                "the start-up sweep also removes the engines' own dead leftovers of its uid (vLLM, "
                                "SGLang, NCCL, CUDA IPC), as kvctl gc --engines does", flag)

# Elastic KV memory.
PAGE_SIZE = Setting("KVCACHED_PAGE_SIZE", "bytes", 2 << 20,
                    "bytes per page of the elastic KV buffer (smaller than 2 MiB only on the CPU backend)", page_bytes)
ELASTIC_RESERVE_PAGES = Setting("KVCACHED_ELASTIC_RESERVE_PAGES", "count", 1,
                                "free pages (vLLM) or groups (SGLang) elastic KV keeps mapped for the next requests",
                                count)
ELASTIC_RELEASE_DELAY_S = Setting("KVCACHED_ELASTIC_RELEASE_DELAY_S", "seconds", 1.0,
                                  "how long a free page (SGLang: group) stays mapped while requests run", seconds(0))

# The page extension (read by its C++, csrc/, and by the build).
NVIDIA_GPUS_DIR = Setting("KVCACHED_NVIDIA_GPUS_DIR", "path", "/proc/driver/nvidia/gpus",
                          "where the extension counts GPUs without initialising CUDA (read by csrc/; tests)",
                          absolute_path)
NO_CUDA = Setting("KVCACHED_NO_CUDA", "flag", False, "build: never compile the CUDA backend (setup.py)", flag)
REQUIRE_EXT = Setting("KVCACHED_REQUIRE_EXT", "flag", False,
                      "build: fail the install when the extension does not build (setup.py; CI sets it)", flag,
                      strict="a build meant to fail without the extension would pass as one where it is optional")

# kvctl.
# vLLM's own, read as vLLM reads it (an absolute path; anything else points nowhere, and is ignored).
VLLM_RPC_BASE_PATH = Setting[str | None]("VLLM_RPC_BASE_PATH", "path", None,
                                         "vLLM's own: where its ZMQ IPC sockets are; kvctl's engine pass looks there "
                                         "besides /tmp (re-based under --root)", text)
KVCTL_ROOT = Setting[str | None]("KVCTL_ROOT", "path", None,
                                 "default for kvctl --root (read by kvctl's command line)", text)
KVCTL_LOCK = Setting[str | None]("KVCTL_LOCK", "path", None, "path of kvctl gc's node-wide lock file",
                                 absolute_path)
KVCTL_EVERY_MIN_S = Setting("KVCTL_EVERY_MIN_S", "seconds", 10.0,
                            "the shortest DURATION kvctl gc --every accepts (tests set a tiny one)", seconds(0.001))
KVCTL_KUBELET_DIR = Setting("KVCTL_KUBELET_DIR", "path", "/var/lib/kubelet",
                            "default for kvctl -A's --kubelet-dir: where the kubelet keeps pods/<uid>/volumes",
                            absolute_path)
KVCTL_SANDBOX_ROOT = Setting("KVCTL_SANDBOX_ROOT", "path", "/",
                             "re-bases the container runtimes' sandbox directories that kvctl -A looks in "
                             "(SANDBOX_SHM; a DaemonSet that mounts the host's under /host, tests)", absolute_path)
# doctor's `capacity` check (docs/PLACES.md §6): a place this full warns, then fails; the alerts
# (contrib/prometheus/kvctl-gc-rules.yml) fire at the same defaults.
KVCTL_CAPACITY_WARN = Setting("KVCTL_CAPACITY_WARN", "percent", 85.0,
                              "doctor's capacity check warns when a place's filesystem is this full (percent)", percent)
KVCTL_CAPACITY_FAIL = Setting("KVCTL_CAPACITY_FAIL", "percent", 95.0,
                              "doctor's capacity check fails when a place's filesystem is this full (percent)", percent)

# The container runtimes' per-sandbox /dev/shm mounts, each (runtime, directory of sandboxes, the shm mount below
# one sandbox's entry): a tmpfs mounted at <directory>/<id>/<below> is that sandbox's /dev/shm, shared by its
# containers and kept across their restarts (docs/PLACES.md §1). Read from each runtime's source: containerd's
# getSandboxDevShm (its volatile sandbox root under the state directory, /run/containerd), CRI-O's ShmPath in
# the container's userdata (under its run root, and its storage root in older releases), Docker's
# ShmResourcePath (mounts/shm under the container's directory; shm directly below it before 1.13).
SANDBOX_SHM: tuple[tuple[str, str, str], ...] = (
    ("containerd", "/run/containerd/io.containerd.grpc.v1.cri/sandboxes", "shm"),
    ("cri-o", "/run/containers/storage/overlay-containers", "userdata/shm"),
    ("cri-o", "/var/lib/containers/storage/overlay-containers", "userdata/shm"),
    ("docker", "/var/lib/docker/containers", "mounts/shm"),
    ("docker", "/var/lib/docker/containers", "shm"),
)

ALL: tuple[Setting[Any], ...] = (
    ENABLE_KVCACHED, ENABLE, ELASTIC, VLLM_PLUGINS, SGLANG_PLUGINS, IPC_NAME, ROOT, DP_SERVE, LIMIT,
    PUBLISH_INTERVAL_S, OWNER_EXIT_WAIT_S, OWNER_RETRY_S, STARTUP_SWEEP, STARTUP_SWEEP_ENGINES, PAGE_SIZE,
    ELASTIC_RESERVE_PAGES, ELASTIC_RELEASE_DELAY_S, NVIDIA_GPUS_DIR, NO_CUDA, REQUIRE_EXT, VLLM_RPC_BASE_PATH,
    KVCTL_ROOT, KVCTL_LOCK, KVCTL_EVERY_MIN_S, KVCTL_KUBELET_DIR, KVCTL_SANDBOX_ROOT,
    KVCTL_CAPACITY_WARN, KVCTL_CAPACITY_FAIL,
)
