"""kvctl/typer_adapter.py is the only place kvctl reaches below typer's public API; these tests fail on the
first typer release that moves what it uses, and hold that it changes nothing but speed.

Run on the typer `make test` installs (the highest of the range); the lowest is run by
tests/cli/test_operators.py::test_the_lowest_typer_of_the_range_works.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from enum import Enum
from typing import Any

import pytest
import typer

from kvctl import typer_adapter
from kvctl.cli import group
from kvctl.typer_adapter import ClickException, UsageError

HAS_COERCION_LAYER = importlib.util.find_spec("typer._coercion") is not None


def commands() -> Iterator[tuple[Any, Any]]:
    """(command, a context of it) for kvctl's group and every command, as the group builds them."""
    root = group()
    ctx = root.make_context("kvctl", [], resilient_parsing=True)
    yield root, ctx
    for name in root.list_commands(ctx):
        cmd = root.get_command(ctx, name)
        yield cmd, cmd.make_context(name, [], parent=ctx, resilient_parsing=True)


def test_click_exceptions_are_the_ones_typer_raises() -> None:
    assert issubclass(typer.BadParameter, UsageError) and issubclass(UsageError, ClickException)
    root = group()
    ctx = root.make_context("kvctl", [], resilient_parsing=True)
    with pytest.raises(UsageError):
        root.get_command(ctx, "gc").make_context("gc", ["--bogus"], parent=ctx)
    with pytest.raises(UsageError):
        root.make_context("kvctl", ["--root"])


def test_the_coercion_layer_has_the_shape_the_adapter_fills() -> None:
    """typer 0.29's runtime coercion: RuntimeParam(parameter_info, annotation)._coerce_value, per parameter."""
    if not HAS_COERCION_LAYER:
        assert typer_adapter.RuntimeParam is None  # nothing to adapt: click's own types coerce
        return
    from typer._coercion import RuntimeParam
    from typer.core import _TyperParameter

    assert typer_adapter.RuntimeParam is RuntimeParam
    assert [f.name for f in dataclasses.fields(RuntimeParam)] == ["parameter_info", "annotation"], (
        f"typer {typer.__version__} changed RuntimeParam: update kvctl/typer_adapter.py")
    assert "_coerce_value" in RuntimeParam.__abstractmethods__
    unadapted = []
    for cmd, ctx in commands():
        for p in [*cmd.params, cmd.get_help_option(ctx)]:
            assert isinstance(p, _TyperParameter) and hasattr(p, "type_descriptor"), (cmd.name, p)
            if type(p._runtime_param).__name__ != "_Light":
                unadapted.append(f"{cmd.name} {p.name}")
    assert unadapted == [], f"typer {typer.__version__}: parameters left to pydantic"


_SAMPLES = {int: ["3", "0", "-1", "9", "x", ""], float: ["0.5", "2", "-1", "1e3", "nan", "x"],
            str: ["a", "", "kvcached_vLLM_1"], bool: ["true", "no", "1", "maybe"]}


def _samples(annotation: Any, info: Any) -> list[Any]:
    a = typer_adapter._unwrap(annotation)
    if getattr(a, "__origin__", None) is list:
        return [[s] for s in _samples(a.__args__[0], info)] + [["a", "b"]]
    if info.parser is not None:
        return ["10m", "90", "-1", "512M", "50", "x", ""]
    if isinstance(a, type) and issubclass(a, Enum):
        return [m.value for m in a] + [m.value.upper() for m in a] + ["bogus"]
    return _SAMPLES[a]


def _outcome(runtime: Any, p: Any, ctx: Any, value: Any) -> tuple[str, Any]:
    try:
        return "value", runtime.coerce(value, param=p, ctx=ctx)
    except typer.BadParameter:
        return "rejected", None


@pytest.mark.skipif(not HAS_COERCION_LAYER, reason="this typer has no pydantic coercion layer: nothing is adapted")
def test_the_light_coercer_gives_what_typers_own_gives() -> None:
    from typer._coercion import build_runtime_param

    compared = 0
    for cmd, ctx in commands():
        for p in cmd.params:
            desc = p.type_descriptor
            if desc.annotation is bool and p.is_flag:
                continue  # flags are never coerced: click gives them a bool
            theirs = build_runtime_param(desc)
            for sample in _samples(desc.annotation, desc.parameter_info):
                mine = _outcome(p._runtime_param, p, ctx, sample)
                own = _outcome(theirs, p, ctx, sample)
                assert mine == own, (cmd.name, p.name, sample, mine, own)
                compared += 1
    assert compared > 100


def test_no_command_imports_pydantic() -> None:
    """Build every command and parse a line of each: pydantic (typer 0.29's coercion) never loads."""
    code = (
        "import json, sys\n"
        "from kvctl.cli import group\n"
        "g = group(); ctx = g.make_context('kvctl', ['--root', '/', '-v'], obj=None)\n"
        "lines = {'gc': ['--min-age', '10m', '--kind', 'segment', '--time-limit', '0', '-y', '-v'],\n"
        "         'limit': ['n', '1G'], 'limit-percent': ['n', '50', '--device', '1'], 'watch': ['-n', '2'],\n"
        "         'top': ['-r', '1', '--count', '3', 'a'], 'demo': ['--tp', '1'], 'inspect': ['--pid', '1'],\n"
        "         'doctor': ['node', '--strict'], 'delete': ['n', '--min-age', '0', '--root', '/']}\n"
        "for name in g.list_commands(ctx):\n"
        "    g.get_command(ctx, name).make_context(name, lines.get(name, []), parent=ctx)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'pydantic')))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []
