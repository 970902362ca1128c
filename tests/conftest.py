"""Shared fixtures: a private node root per test, real deployments reaped at teardown."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcached.node.base.layout import Layout

# The engine-leftover fixtures (children, engine_node) and the GPU holders' (gpu_nodes, standins), shared by
# tests/fs and tests/cli: registered as a plugin because a fixture imported into a test module reads to ruff
# as an unused import (F401) that each test's parameter redefines (F811).
pytest_plugins = ["tests.fs.engine_plant", "tests.fs.gpu_fixtures"]

# One user per xdist worker (PYTEST_XDIST_WORKER: gw0, gw1, ...): a worker that removes its user at its end
# must not take it from under another worker's test.
TEST_USER = "kvctest" + os.environ.get("PYTEST_XDIST_WORKER", "")
REPO = Path(__file__).resolve().parents[1]
# The installed command, as an operator runs it: the venv's bin/, next to this interpreter.
KVCTL = str(Path(sys.executable).with_name("kvctl"))


def both(argname: str = "patched", *, indirect: bool = True) -> pytest.MarkDecorator:
    """Run a test twice: with kvcached's patch on (`argname` True, id "patched") and off (False, "unpatched").

    `indirect`: the value goes to the fixture of that name (which applies or reverts the patch), not
    straight to the test.
    """
    return pytest.mark.parametrize(argname, [True, False], ids=["patched", "unpatched"], indirect=indirect)


def _require_vllm() -> None:
    """With KVCACHED_REQUIRE_VLLM=1 (CI sets it), stop the session unless vLLM imports; =<version>: that one.

    The vLLM integration modules skip when vLLM is absent, which is right on a
    developer's machine without it and wrong in CI: there a failed install would
    pass as seven skipped modules. Importing it here, before collection, fails
    the whole run instead, and no skip can hide it. A version (CI's second venv:
    0.33.0) also fails a venv that holds another release than the one it proves.
    """
    want = os.environ.get("KVCACHED_REQUIRE_VLLM", "")
    if want in ("", "0"):
        return
    try:
        import vllm
    except Exception as e:  # noqa: BLE001 - whatever stops the import stops the run
        raise pytest.UsageError(
            f"KVCACHED_REQUIRE_VLLM={want}, but vLLM does not import ({type(e).__name__}: {e}); its integration "
            "tests would be skipped. Install it into this venv: bash scripts/install-vllm.sh") from None
    have = getattr(vllm, "__version__", "?")
    if want != "1" and have != want:
        raise pytest.UsageError(f"KVCACHED_REQUIRE_VLLM={want}, but this venv has vLLM {have}: "
                                f"bash scripts/install-vllm.sh {want}")
    print(f"kvcached tests: vLLM {have} required and present")


def pytest_configure(config: pytest.Config) -> None:
    """A temporary base of this session's own, removed at its end; what vLLM leaves, kept or removed too.

    pytest's default base (/tmp/pytest-of-<user>/pytest-<N>) keeps the last three
    sessions and deletes older ones: a second suite running at the same time (a
    developer's next to CI's) deletes the first one's directories under its feet.
    """
    if config.option.basetemp is None and not hasattr(config, "workerinput"):
        config.option.basetemp = tempfile.mkdtemp(prefix="kvtest-", dir="/tmp")
        config._kvcached_basetemp = config.option.basetemp  # type: ignore[attr-defined]
    # What vLLM and torch write into /tmp goes to a directory of the session's own, set
    # before any test imports them so that every child inherits it: vLLM's ZMQ sockets
    # (<base>/<uuid4>, left behind when a test kills a serve, as a crash would) and torch's
    # inductor cache (/tmp/torchinductor_<user>).
    # An xdist worker inherits the controller's: it makes none of its own.
    unset = [(var, sub) for var, sub in (("VLLM_RPC_BASE_PATH", "rpc"), ("TORCHINDUCTOR_CACHE_DIR", "inductor"))
             if var not in os.environ]
    if unset:
        scratch = tempfile.mkdtemp(prefix="kvtest-scratch-", dir="/tmp")
        config._kvcached_scratch = scratch  # type: ignore[attr-defined]
        for var, sub in unset:
            os.makedirs(os.path.join(scratch, sub))
            os.environ[var] = os.path.join(scratch, sub)
    # Engines started by tests (the harness's, vLLM's in process) do not sweep their node at start-up: a test
    # plants dead state to see what kvctl or the owner makes of it, and a sweep in the background would race
    # it. The sweep's own tests (tests/fs/test_startup_sweep.py) turn it on for the engines they start.
    os.environ.setdefault("KVCACHED_STARTUP_SWEEP", "0")
    if _is_worker(config):
        return  # what follows is the session's, done once: by the process that starts the workers and outlives them
    config._kvcached_psm_before = _vllm_shm()  # type: ignore[attr-defined]
    try:
        _require_vllm()
    except pytest.UsageError:
        pytest_unconfigure(config)  # pytest will not: leave nothing of this session behind
        raise


def _is_worker(config: pytest.Config) -> bool:
    """Whether this process is a pytest-xdist worker (`make test` runs two), not the session's controller."""
    return hasattr(config, "workerinput")


SGLANG_TESTS = "tests/sglang/"
# Files whose tests plant or judge node-wide process state that no --root confines: GPU holders are found by
# device number among every process of the node, and doctor's node group runs gpu-orphans. Run on one
# worker, one after another, a planted orphan GPU holder never meets another file's whole-node doctor.
NODE_WIDE = ("tests/cli/test_gpu_cli.py", "tests/fs/test_gpu_holders.py", "tests/cli/test_commands.py")
# The files whose kvctl -A runs act on every place of the machine: one at a time, or one would judge (and gc)
# the other's pods and containers mid-test.
PLACES_TESTS = ("tests/fs/test_places.py", "tests/fs/test_podman.py", "tests/fs/test_place_fill.py")


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: absent without it, and then never called
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """`--dist loadfile` (make test's), with every SGLang test one unit, and the NODE_WIDE files another.

    A file is a unit, so a module's tests share its module fixtures (its
    serves, started once). tests/sglang as a whole is one: its tests share
    the zygote and the in-process SGLang import (20 CPU seconds each, per
    worker that would start them). A bare `-n 2` (xdist's `load`, which
    would split a file, and run the NODE_WIDE files beside a test whose
    GPU stand-ins they would see) gets the same; another `--dist` is xdist's own.
    """
    if config.getvalue("dist") not in ("loadfile", "load"):
        return None
    from xdist.scheduler import LoadFileScheduling

    # Units go out in collection order (vLLM, SGLang, the rest), not xdist's default of the most tests first:
    # that put the SGLang unit before vLLM files, so a worker could fork a vLLM serve after importing SGLang.
    config.option.loadscopereorder = False

    class SGLangTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(SGLANG_TESTS):
                return SGLANG_TESTS
            if nodeid.startswith(NODE_WIDE):
                return "node-wide"
            if nodeid.startswith(PLACES_TESTS):
                return "places"
            return super()._split_scope(nodeid)

    return SGLangTogether(config, log)  # type: ignore[arg-type]


VLLM_TESTS = "tests/vllm/"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The vLLM tests first, then the SGLang tests, then the rest, in one process as on xdist's workers.

    The vLLM tests fork whole serves from the test process, and a serve forked
    from a process that imported SGLang (the `sgl` fixture) never gets its
    workers up: no vLLM test may run after an SGLang one in the same process.
    xdist hands out units in collection order, so by the time a worker takes
    the SGLang unit (the longest) every vLLM file is handed out, and the rest
    fill both workers around it. Every worker orders alike, as xdist requires.
    """
    def rank(item: pytest.Item) -> int:
        return 0 if item.nodeid.startswith(VLLM_TESTS) else 1 if item.nodeid.startswith(SGLANG_TESTS) else 2

    items.sort(key=rank)  # stable: each part keeps its own order


def pytest_unconfigure(config: pytest.Config) -> None:
    for attr in ("_kvcached_basetemp", "_kvcached_scratch"):
        base = getattr(config, attr, None)
        if base:
            shutil.rmtree(base, ignore_errors=True)
    before = getattr(config, "_kvcached_psm_before", None)
    if before is not None:
        _remove_dead_vllm_shm(_vllm_shm() - before)


SHM = "/dev/shm"


def _vllm_shm() -> set[str]:
    """Names of the POSIX shared memory that vLLM's broadcast queues create (`psm_*`, Python's default names)."""
    try:
        return {n for n in os.listdir(SHM) if n.startswith("psm_")}
    except OSError:
        return set()


def _shm_in_use() -> set[str]:
    """Names under /dev/shm that a live process maps or holds open."""
    used: set[str] = set()
    prefix = SHM + "/"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps", "rb") as f:
                for line in f:
                    at = line.find(prefix.encode())
                    if at >= 0:
                        used.add(os.fsdecode(line[at + len(prefix):].rstrip(b"\n")).removesuffix(" (deleted)"))
            fds = f"/proc/{pid}/fd"
            for fd in os.listdir(fds):
                target = os.readlink(f"{fds}/{fd}")
                if target.startswith(prefix):
                    used.add(target[len(prefix):])
        except OSError:
            continue  # exited meanwhile, or not ours to read
    return used


def _remove_dead_vllm_shm(names: set[str]) -> None:
    """Remove the broadcast buffers of the serves this session killed, as a crash leaves them.

    vLLM's creator unlinks its buffer only when it shuts down in order; the
    tests SIGKILL serves (and the resource tracker of their session with
    them). Only what appeared during this session, is a regular file of ours,
    and no live process maps or holds is removed: a vLLM running beside the
    suite keeps its own.
    """
    if not names:
        return
    in_use = _shm_in_use()
    for name in names - in_use:
        path = os.path.join(SHM, name)
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                os.unlink(path)
        except OSError:
            pass


@pytest.fixture
def layout() -> Iterator[Layout]:
    """A private node root with /tmp and /dev/shm, like a real node's.

    Short and under /tmp, not pytest's tmp_path: socket paths must fit 108 bytes.
    """
    root = tempfile.mkdtemp(prefix="kv", dir="/tmp")
    for sub in ("tmp", "dev/shm"):
        os.makedirs(os.path.join(root, sub))
        os.chmod(os.path.join(root, sub), 0o1777)
    os.chmod(root, 0o755)
    yield Layout(root)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def uniq(request) -> str:
    """A name unique to this test and process, so parallel runs never collide."""
    return f"t{os.getpid()}x{zlib.crc32(request.node.nodeid.encode()) % 10**5}"


@pytest.fixture
def deployments() -> Iterator[list]:
    """Deployments started by a test; all SIGKILLed and reaped at teardown."""
    started: list = []
    yield started
    for d in started:
        d.kill()


def _ensure_user(name: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    for _ in range(20):
        r = subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                           capture_output=True, text=True)
        if r.returncode in (0, 9):  # 9: exists (another process created it)
            return pwd.getpwnam(name)
        time.sleep(0.2)  # /etc/passwd locked by a concurrent useradd
    raise RuntimeError(f"useradd {name}: {r.stderr.strip()}")


@pytest.fixture(scope="session")
def unpriv_user() -> Iterator[pwd.struct_passwd]:
    """An unprivileged user created for the tests (needs root), removed again at the end of the session."""
    if os.geteuid() != 0:
        pytest.skip("creating a test user needs root")
    try:
        pwd.getpwnam(TEST_USER)
        existed = True
    except KeyError:
        existed = False
    user = _ensure_user(TEST_USER)
    yield user
    if not existed:
        subprocess.run(["userdel", TEST_USER], capture_output=True)
