"""Fixtures for the proof suite: short node roots and deployments that always die."""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Callable, Iterator

import pytest

from kvcached.node.base.layout import Layout
from kvcached.runtime.harness import Deployment, start_deployment

from .kit import make_root


@pytest.fixture
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Layout]:
    """A fresh node root with a short path: socket paths must stay under 108 bytes."""
    base = tmp_path_factory.mktemp("n")
    yield make_root(str(base))
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def deployments() -> Iterator[Callable[..., Deployment]]:
    """start_deployment that records every deployment and SIGKILLs its group in teardown."""
    started: list[Deployment] = []

    def start(name: str, tp: int = 1, pp: int = 1, **kw: object) -> Deployment:
        d = start_deployment(name, tp, pp, **kw)  # type: ignore[arg-type]
        started.append(d)
        return d

    yield start
    for d in started:
        for pid in d.pids:  # orphaned workers may have left the group's wait
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        d.kill()
