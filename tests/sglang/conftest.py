"""Fixtures for the tests of SGLang's own classes: the install is checked, SGLang's side effects kept out of pytest."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator

import pytest

SGLANG_SKIP = "SGLang 0.5.23 is not installed here (run scripts/install-sglang.sh in this venv)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without SGLang these tests skip, with the reason; where it must be there (CI), they fail instead."""
    if importlib.util.find_spec("sglang") is not None:
        return
    if os.environ.get("KVCACHED_REQUIRE_SGLANG") == "1":
        raise pytest.UsageError(f"KVCACHED_REQUIRE_SGLANG=1 but {SGLANG_SKIP}")
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.skip(reason=SGLANG_SKIP))


@pytest.fixture(scope="session")
def sgl_scratch() -> Iterator[str]:
    """SGLang's cache directory for this session's children (SGLANG_CACHE_DIR), removed at the end."""
    path = tempfile.mkdtemp(prefix="kvtest-sglang-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def sgl(sgl_scratch) -> Iterator[None]:
    """SGLang's pool, allocator and radix-cache modules imported into this process, its import side effects undone.

    `import sglang` setdefaults cache variables in os.environ (TRITON_CACHE_DIR,
    TORCHINDUCTOR_CACHE_DIR, CUDA_CACHE_PATH, ...): they are put back, so that
    the later tests' children see the environment they would have seen.
    """
    before = dict(os.environ)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGQUIT, signal.SIGINT)}
    os.environ["SGLANG_CACHE_DIR"] = sgl_scratch
    import sglang.srt.mem_cache.allocator  # noqa: F401
    import sglang.srt.mem_cache.memory_pool  # noqa: F401
    import sglang.srt.mem_cache.radix_cache  # noqa: F401

    os.environ.clear()
    os.environ.update(before)
    assert {s: signal.getsignal(s) for s in handlers} == handlers, "importing SGLang changed a signal handler"
    yield


@pytest.fixture
def elastic_env(layout, uniq, monkeypatch) -> Iterator[str]:
    """What the patch reads in a scheduler process: 64 KiB pages, no release delay, no reserve; a private node root.

    The deployment's segment, looked up by name when a test claims none, is
    then under the test's own root, never the node's /dev/shm.
    """
    from .elastic_support import PAGE

    monkeypatch.setenv("KVCACHED_PAGE_SIZE", str(PAGE))
    monkeypatch.setenv("KVCACHED_ELASTIC_RELEASE_DELAY_S", "0")
    monkeypatch.setenv("KVCACHED_ELASTIC_RESERVE_PAGES", "0")
    monkeypatch.setenv("KVCACHED_ROOT", layout.root)
    monkeypatch.setenv("KVCACHED_IPC_NAME", uniq)
    yield uniq


@pytest.fixture(scope="session")
def zygote(sgl_scratch) -> Iterator:
    """The process the tests' SGLang mains are forked from (tests/sglang/zygote.py), started once per session."""
    from tests.sglang.serves import Zygote

    z = Zygote(sgl_scratch)
    yield z
    z.close()


@pytest.fixture(scope="session", autouse=True)
def zygote_early(request) -> None:
    """The zygote started with the first SGLang test when any selected test forks from it.

    Its import (about 20 CPU seconds) then runs beside the single-core tests
    before test_launch, not in front of the first serve. Not under xdist:
    there every worker sees every test, but only the one that runs the SGLang
    tests (one unit, tests/conftest.py) needs a zygote, and they run first.
    """
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if any("zygote" in getattr(item, "fixturenames", ()) for item in request.session.items):
        request.getfixturevalue("zygote")
