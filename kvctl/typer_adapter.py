"""Every place kvctl reaches below typer's public API, in one module.

Two things, each guarded by tests/cli/test_typer_adapter.py, which fails on
the first typer release that breaks one of them:

1. click's exception classes (`UsageError`, `ClickException`), which kvctl
   turns into its one-line errors and exit code 2. typer 0.28 and later carry
   their own copy of click as `typer._click`; earlier releases depend on click.
2. A light coercion of command-line values (`light_coercion`). typer 0.29
   coerces every non-flag value through a pydantic TypeAdapter built on first
   use, and importing pydantic costs more start-up time than the whole rest of
   `kvctl gc --dry-run` (bench/bench_cli_start.py prints the figure). kvctl's
   parameters are all plain (str, int, float, bool, enums, lists and
   Optionals of those, or a custom `parser`), so each gets a small coercer
   that gives exactly typer's values and messages (the test compares them). On
   a typer without that coercion layer (before 0.29) nothing is installed; if
   its internals change shape, nothing is installed either and typer's own
   (slower, equally correct) path runs.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterable
from enum import Enum
from typing import Any

try:
    from typer._click.exceptions import ClickException, UsageError
except ImportError:  # typer before 0.28: click is its dependency
    from click.exceptions import ClickException, UsageError  # type: ignore[no-redef,assignment,import-not-found,unused-ignore]

try:
    from typer._coercion import RuntimeParam
    from typer.core import _TyperParameter
except ImportError:  # typer before 0.29: click's own types coerce, no pydantic
    RuntimeParam = None  # type: ignore[assignment,misc,unused-ignore]
    _TyperParameter = None  # type: ignore[assignment,misc,unused-ignore]

__all__ = ["ClickException", "UsageError", "light_coercion", "coerce", "supported"]

_SCALARS = (str, int, float, bool)


def _unwrap(annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, getattr(types, "UnionType", None)):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _unwrap(args[0])
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    return annotation


def supported(annotation: Any, info: Any) -> bool:
    """Whether `coerce` handles this annotation exactly as typer would."""
    a = _unwrap(annotation)
    if typing.get_origin(a) is list:
        return supported(typing.get_args(a)[0], info)
    if getattr(info, "parser", None) is not None:
        return True
    return a in _SCALARS or (isinstance(a, type) and issubclass(a, Enum))


def coerce(annotation: Any, info: Any, value: Any) -> Any:
    """`value` from the command line as typer would make it of `annotation` (raise typer.BadParameter)."""
    from typer import BadParameter

    a = _unwrap(annotation)
    if typing.get_origin(a) is list:
        items = value if isinstance(value, (list, tuple)) else [value]
        return [coerce(typing.get_args(a)[0], info, v) for v in items]
    if info.parser is not None:
        return info.parser(value) if isinstance(value, str) else value
    if isinstance(a, type) and issubclass(a, Enum):
        return _member(a, info, value)
    if a is bool:
        return _boolean(value)
    if a in (int, float):
        try:
            number = a(value)
        except (TypeError, ValueError):
            raise BadParameter(f"{value!r} is not a valid {'integer' if a is int else 'number'}.") from None
        lo, hi = info.min, info.max
        if (lo is not None and number < lo) or (hi is not None and number > hi):
            raise BadParameter(f"{number} is not in the range {lo}<=x<={hi}.")
        return number
    if isinstance(value, bytes):
        return value.decode(errors="surrogateescape")
    return str(value)


def _member(enum: type[Enum], info: Any, value: Any) -> Enum:
    from typer import BadParameter

    if isinstance(value, enum):
        return value
    for member in enum:
        if value == member.value or (not info.case_sensitive and str(value).lower() == str(member.value).lower()):
            return member
    raise BadParameter(f"{value!r} is not one of {', '.join(repr(m.value) for m in enum)}.")


def _boolean(value: Any) -> bool:
    from typer import BadParameter

    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "t", "yes", "y", "on"):
        return True
    if text in ("0", "false", "f", "no", "n", "off"):
        return False
    raise BadParameter(f"{value!r} is not a valid boolean.")


if RuntimeParam is not None:

    class _Light(RuntimeParam):  # type: ignore[misc,valid-type,unused-ignore]
        """typer's runtime coercion contract, fulfilled by `coerce` instead of a pydantic TypeAdapter."""

        def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
            from typer import BadParameter

            try:
                return coerce(self.annotation, self.parameter_info, value)
            except BadParameter as e:
                if e.param is None:  # name the option in the message, as typer's own path does
                    raise BadParameter(e.message, ctx=ctx, param=param) from None
                raise


def light_coercion(params: Iterable[Any]) -> int:
    """Give every supported parameter in `params` the light coercer; how many got it (0 on older typer).

    A command's own parameters, and its help option, which click builds per context (`get_help_option`).
    """
    if RuntimeParam is None or _TyperParameter is None:
        return 0
    done = 0
    for p in params:
        desc = getattr(p, "type_descriptor", None)
        if not isinstance(p, _TyperParameter) or desc is None or getattr(p, "_runtime_param", 1) is not None:
            continue
        if supported(desc.annotation, desc.parameter_info):
            try:
                p._runtime_param = _Light(parameter_info=desc.parameter_info, annotation=desc.annotation)
            except TypeError:
                return done  # RuntimeParam changed shape: leave typer's own path in place
            done += 1
    return done
