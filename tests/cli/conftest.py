"""CLI test helpers: the in-process runner, the installed `kvctl`, and the documented JSON schemas."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from kvctl.cli import app

from ..schemas import validate

REPO = Path(__file__).resolve().parents[2]
SCHEMAS = REPO / "kvctl" / "schemas"
KVCTL = str(Path(sys.executable).with_name("kvctl"))


@dataclass
class Run:
    code: int
    stdout: str
    stderr: str

    def json(self, schema: str | None = None) -> Any:
        doc = json.loads(self.stdout)
        if schema:
            validate(doc, schema)
        return doc


def invoke(*args: str, input: str | None = None, env: dict[str, str] | None = None) -> Run:
    """kvctl in-process (typer's CliRunner): exit codes and output without a fork."""
    r = CliRunner().invoke(app(), list(args), input=input, env={"NO_COLOR": "1", **(env or {})})
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return Run(r.exit_code, r.stdout, r.stderr)


def kvctl(*args: str, input: str | None = None, env: dict[str, str] | None = None, timeout: float = 60) -> Run:
    """The installed `kvctl` in a subprocess, exactly as an operator or cron runs it."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("KVCTL_ROOT", "NO_COLOR")}
    full_env.update(env or {})
    p = subprocess.run([KVCTL, *args], capture_output=True, text=True, input=input, env=full_env,
                       timeout=timeout, stdin=None if input is not None else subprocess.DEVNULL)
    return Run(p.returncode, p.stdout, p.stderr)


def assert_one_line_error(r: Run, code: int) -> None:
    """A clear error: the documented code, one `kvctl:` line on stderr, no traceback, nothing on stdout."""
    assert r.code == code, (r.code, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvctl: "), r.stderr
    assert "Traceback" not in r.stderr
    assert r.stdout == ""


@pytest.fixture
def root(layout) -> str:
    """The private node root of the core's `layout` fixture, as a --root argument."""
    return layout.root
