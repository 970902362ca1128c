"""Light coercion of command-line values, so that kvctl starts without importing pydantic.

typer ≥ 0.2x coerces every non-flag parameter through a pydantic TypeAdapter,
which costs more start-up time (~100 ms) than the rest of `kvctl gc --dry-run`
together, and completion re-runs kvctl on every TAB. Our parameters are all
plain (str, int, float, bool, enums, lists and Optionals of those, or a custom
`parser`), so we install a small coercer on each before typer builds its
adapter. If typer's internals change shape, nothing is installed and typer's
own (slower, equally correct) path runs.
"""

from __future__ import annotations

import types
import typing
from enum import Enum
from typing import Any

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
    """Whether `_coerce` handles this annotation exactly as typer would."""
    a = _unwrap(annotation)
    if typing.get_origin(a) is list:
        return supported(typing.get_args(a)[0], info)
    if getattr(info, "parser", None) is not None:
        return True
    return a in _SCALARS or (isinstance(a, type) and issubclass(a, Enum))


def _coerce(annotation: Any, info: Any, value: Any) -> Any:
    from typer import BadParameter

    a = _unwrap(annotation)
    if typing.get_origin(a) is list:
        items = value if isinstance(value, (list, tuple)) else [value]
        return [_coerce(typing.get_args(a)[0], info, v) for v in items]
    if info.parser is not None:
        return info.parser(value) if isinstance(value, str) else value
    if isinstance(a, type) and issubclass(a, Enum):
        if isinstance(value, a):
            return value
        for member in a:
            if value == member.value or (not info.case_sensitive and str(value).lower() == str(member.value).lower()):
                return member
        raise BadParameter(f"{value!r} is not one of {', '.join(repr(m.value) for m in a)}.")
    if a is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "t", "yes", "y", "on"):
            return True
        if text in ("0", "false", "f", "no", "n", "off"):
            return False
        raise BadParameter(f"{value!r} is not a valid boolean.")
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


def install(command: Any) -> None:
    """Give every supported typer parameter of `command` (and its subcommands) the light coercer."""
    try:
        from typer._coercion import RuntimeParam
        from typer.core import _TyperParameter
    except ImportError:
        return

    class Light(RuntimeParam):
        def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
            from typer import BadParameter

            try:
                return _coerce(self.annotation, self.parameter_info, value)
            except BadParameter as e:
                if e.param is None:  # name the option in the message, as typer's own path does
                    raise BadParameter(e.message, ctx=ctx, param=param) from None
                raise

    def light(p: Any) -> None:
        desc = getattr(p, "type_descriptor", None)
        if not isinstance(p, _TyperParameter) or desc is None or getattr(p, "_runtime_param", 1) is not None:
            return
        if supported(desc.annotation, desc.parameter_info):
            try:
                p._runtime_param = Light(parameter_info=desc.parameter_info, annotation=desc.annotation)
            except TypeError:
                pass  # RuntimeParam changed shape: leave typer's path in place

    def with_light_help(cmd: Any) -> None:
        # --help is built per context, after we have walked the parameters.
        original = cmd.get_help_option

        def get_help_option(ctx: Any) -> Any:
            opt = original(ctx)
            if opt is not None:
                light(opt)
            return opt

        cmd.get_help_option = get_help_option

    stack = [command]
    while stack:
        cmd = stack.pop()
        stack.extend(getattr(cmd, "commands", {}).values())
        for p in cmd.params:
            light(p)
        if "get_help_option" not in vars(cmd):
            with_light_help(cmd)
