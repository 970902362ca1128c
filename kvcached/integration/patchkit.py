"""The kit every engine integration patches its engine with (vLLM's and SGLang's).

A `Patch` declares what it hooks (`targets`), how it recognises that the
installed engine has the shape it expects (`probe`), whether it is switched
on (`switch`), which patches it needs (`requires`), and how it installs itself
(`install`, handed a `Changes` that records every wrap, so that the patch can
be undone exactly). A `Registry` holds one engine's patches: it applies them in
dependency order, once per process, and never raises into the engine; each
patch ends in one `PatchStatus` with a reason. An unknown shape makes that
patch, and the patches requiring it, stand aside with one warning; the others
still apply.

Wrappers are wrapt's (docs/VLLM.md, "The patch kit"): transparent (name,
qualified name, docstring, signature, classmethod or staticmethod nature kept,
`isinstance` and `==` answer as for the original), idempotent (`wrap` twice
under one key wraps once) and reversible in any order (`unwrap` splices one
wrapper out of a chain of several and restores an inherited method by removing
the override). Nothing here knows any engine.
"""

from __future__ import annotations

import inspect
import logging
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import wrapt

from ..node import PatchReport, PatchStatus

# (wrapped, instance, args, kwargs) -> result: wrapt's wrapper signature. `wrapped` is already bound to
# `instance` for a method, so `args` never holds self.
Wrapper = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]

# wrapt keeps attributes named `_self_*` on the proxy itself, not on what it wraps: our mark of whose wrapper it is.
_KEY = "_self_kvcached_patch"


class ShapeError(Exception):
    """The installed engine does not have the shape a patch expects."""


class NotNeeded(Exception):
    """The installed engine already does what the patch would do."""


class NotCovered(Exception):
    """This install of the engine lacks the part a patch hooks."""


def key_of(obj: Any) -> str | None:
    """The patch whose wrapper `obj` is (the outermost one), or None when it is not one of ours."""
    if not isinstance(obj, wrapt.BaseObjectProxy):
        return None
    try:
        # Not getattr: a proxy without the attribute would answer with the one of the wrapper it wraps.
        key = object.__getattribute__(obj, _KEY)
    except AttributeError:
        return None
    return key if isinstance(key, str) else None


def params(fn: Any) -> list[str]:
    """Parameter names of the engine's own `fn` (under our wrappers); [] when it has no signature."""
    try:
        return list(inspect.signature(original(fn)).parameters)
    except (TypeError, ValueError):
        return []


def require(cond: bool, why: str) -> None:
    """A probe's check: the engine does not have the expected shape (`why`) unless `cond` holds."""
    if not cond:
        raise ShapeError(why)


def _first_difference(have: Sequence[str], want: Sequence[str]) -> str:
    for i, (h, w) in enumerate(zip(have, want)):
        if h != w:
            return f"parameter {i + 1} is {h}, not {w}"
    if len(have) < len(want):
        return f"it lacks {', '.join(want[len(have):])}"
    return f"it adds {', '.join(have[len(want):])}"


def which_params(fn: Any, label: str, shapes: Mapping[str, Sequence[str]], *, prefix: bool = False) -> str:
    """The key of the one of `shapes` (parameter names) that the engine's `fn` has; ShapeError otherwise.

    `prefix`: a shape is the leading parameters only (later ones may come and
    go). The error names `fn` (as `label`), the parameters it has, and how they
    differ from each known shape, so that a standing-aside message says what
    changed, not merely that something did.
    """
    have = params(fn)
    if not have:
        raise ShapeError(f"{label} is missing or has no signature")
    for key, want in shapes.items():
        if (have[:len(want)] if prefix else have) == list(want):
            return key
    diffs = "; ".join(f"{key}'s ({', '.join(want)}): {_first_difference(have, want)}" for key, want in shapes.items())
    raise ShapeError(f"{label}({', '.join(have)}) has none of the known shapes: {diffs}")


def dataclass_fields(cls: Any) -> set[str]:
    """The field names of dataclass `cls` ({} when it is not one)."""
    return set(getattr(cls, "__dataclass_fields__", {}))


def require_fields(cls: Any, label: str, names: Iterable[str]) -> None:
    """ShapeError naming each of `names` that dataclass `cls` (`label`) lacks as a field."""
    missing = sorted(set(names) - dataclass_fields(cls))
    require(not missing, f"{label} has no field {', '.join(missing)}")


def which_field(cls: Any, label: str, shapes: Mapping[str, str]) -> str:
    """The key of the one of `shapes` (a field name each) that dataclass `cls` has; ShapeError naming them all."""
    fields = dataclass_fields(cls)
    for key, name in shapes.items():
        if name in fields:
            return key
    raise ShapeError(f"{label} has none of the fields " + ", ".join(f"{name} ({key})" for key, name in shapes.items()))


def source(fn: Any) -> str | None:
    """The source of the engine's own `fn` (under our wrappers), or None."""
    try:
        return inspect.getsource(original(fn))
    except (OSError, TypeError):
        return None


def argument(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    """The value `fn(*args, **kwargs)` would see for parameter `name` (None when not passed)."""
    try:
        return inspect.signature(fn).bind_partial(*args, **kwargs).arguments.get(name)
    except TypeError:
        return kwargs.get(name)


def is_ours(obj: Any) -> bool:
    """`obj` is a wrapper some patch installed."""
    return key_of(obj) is not None


def original(obj: Any) -> Any:
    """What lies under our wrappers: the engine's own object (or another library's wrapper of it)."""
    while key_of(obj) is not None:
        obj = obj.__wrapped__
    return obj


def _ours(key: str) -> Callable[[Any], bool]:
    return lambda entry: key_of(entry) == key


def wrap(owner: Any, name: str, wrapper: Wrapper, *, key: str) -> Any:
    """Wrap `owner.name` (a module's or a class's attribute) with `wrapper`; returns the wrapper installed.

    Idempotent per `key`: when a wrapper of `key` is already in the attribute's
    chain, that one is returned and nothing changes. An inherited method is
    wrapped on `owner` itself (a subclass's override), so the base is untouched.
    """
    current = inspect.getattr_static(owner, name)
    found = wrapt.find_wrapper(current, predicate=_ours(key))
    if found is not None:
        return found
    handle = wrapt.wrap_function_wrapper(owner, name, wrapper)
    setattr(handle, _KEY, key)
    return handle


def unwrap(owner: Any, name: str, handle: Any) -> bool:
    """Remove the wrapper `handle` from `owner.name`, wherever it is in the chain; False when it is gone already."""
    return wrapt.unwrap_object(owner, name, handle, missing_ok=True) is not None


def wrapped_here(owner: Any, name: str, handle: Any) -> bool:
    """`handle` is still in the chain of `owner.name` (nobody replaced the attribute wholesale)."""
    return bool(wrapt.is_wrapped_by(inspect.getattr_static(owner, name), handle))


class Changes:
    """What one patch changed in the engine, recorded as it installs, so that `undo` restores exactly that."""

    def __init__(self, patch: str) -> None:
        self.patch = patch
        self._wraps: list[tuple[Any, str, Any]] = []
        self._after: list[Callable[[], None]] = []

    def wrap(self, owner: Any, name: str, wrapper: Wrapper) -> Any:
        """`wrap` under this patch's key, remembered for undo; returns the wrapper installed."""
        handle = wrap(owner, name, wrapper, key=self.patch)
        self._wraps.append((owner, name, handle))
        return handle

    def wrap_everywhere(self, owner: ModuleType, name: str, wrapper: Wrapper) -> Any:
        """`wrap` a module's function, and point every other loaded module's `from owner import name` at the wrapper.

        `from m import f` copies the reference at import, so such a module would
        still call what it copied; the engine's own hook registry (SGLang's
        HookRegistry) rebinds those too. Matched by identity with what the
        attribute held before; modules imported later bind the wrapper anyway.
        Undo points each rebound name back, unless something else replaced it since.
        """
        before = inspect.getattr_static(owner, name)
        handle = self.wrap(owner, name, wrapper)
        if handle is before:
            return handle  # ours already: its aliases were rebound when it was installed
        rebound: list[tuple[ModuleType, str]] = []
        for mod in list(sys.modules.values()):
            if not isinstance(mod, ModuleType) or mod is owner:
                continue
            try:
                names = [k for k, v in vars(mod).items() if v is before]
            except TypeError:
                continue
            for k in names:
                try:
                    setattr(mod, k, handle)
                    rebound.append((mod, k))
                except (AttributeError, TypeError):
                    continue

        def restore() -> None:
            for mod, k in rebound:
                if vars(mod).get(k) is handle:
                    setattr(mod, k, before)

        self.on_undo(restore)
        return handle

    def on_undo(self, fn: Callable[[], None]) -> None:
        """Also run `fn` when the patch is undone (after its wrappers are gone): state the patch kept."""
        self._after.append(fn)

    @property
    def wraps(self) -> tuple[tuple[Any, str, Any], ...]:
        """(owner, attribute, wrapper) of every wrap made, in order."""
        return tuple(self._wraps)

    def undo(self) -> None:
        """Unwrap everything, last first, then run the `on_undo` callbacks."""
        while self._wraps:
            owner, name, handle = self._wraps.pop()
            unwrap(owner, name, handle)
        while self._after:
            self._after.pop()()


def _always_on() -> str | None:
    return None


@dataclass(frozen=True, kw_only=True)
class Patch:
    """One patch of an engine, as data.

    `probe()` returns what `install` needs (the objects it changes) when the
    engine has the expected shape, and raises `ShapeError`, `NotNeeded` or
    `NotCovered` (an ImportError counts as `NotCovered`) otherwise; it must
    change nothing. `install(changes, found)` wraps through `changes` only.
    `switch()` says why the patch is off (an opt-in not asked for), None when on.
    """

    name: str
    does: str  # one line: what it changes, for reports
    targets: tuple[str, ...]  # `module:Qualified.name` of every attribute it wraps
    probe: Callable[[], Any]
    install: Callable[[Changes, Any], None]
    requires: tuple[str, ...] = ()
    switch: Callable[[], str | None] = _always_on


def dependency_order(patches: Sequence[Patch]) -> tuple[Patch, ...]:
    """`patches` with every patch after those it requires (declaration order otherwise); raises ValueError on an
    unknown requirement, a repeated name or a cycle."""
    by_name: dict[str, Patch] = {}
    for p in patches:
        if p.name in by_name:
            raise ValueError(f"two patches are named {p.name!r}")
        by_name[p.name] = p
    out: list[Patch] = []
    state: dict[str, str] = {}

    def visit(p: Patch, chain: tuple[str, ...]) -> None:
        if state.get(p.name) == "done":
            return
        if state.get(p.name) == "visiting":
            raise ValueError(f"patches require each other: {' -> '.join((*chain, p.name))}")
        state[p.name] = "visiting"
        for r in p.requires:
            if r not in by_name:
                raise ValueError(f"patch {p.name!r} requires {r!r}, which is not declared")
            visit(by_name[r], (*chain, p.name))
        state[p.name] = "done"
        out.append(p)

    for p in patches:
        visit(p, ())
    return tuple(out)


class Registry:
    """One engine's patches: applied in dependency order, once per process, reported, reverted. Never raises."""

    def __init__(self, engine: str, patches: Sequence[Patch], log: logging.Logger) -> None:
        self.engine = engine  # as it is named in log lines ("vLLM")
        self.patches = dependency_order(patches)
        self._by_name = {p.name: p for p in self.patches}
        self.log = log
        self._applied: dict[str, Changes] = {}
        self._warned: set[str] = set()
        self._lock = threading.RLock()

    def names(self) -> tuple[str, ...]:
        """Every patch's name, in dependency order."""
        return tuple(p.name for p in self.patches)

    def applied(self) -> tuple[str, ...]:
        """Names of the patches installed in this process, in dependency order."""
        return tuple(p.name for p in self.patches if p.name in self._applied)

    def changes(self, name: str) -> Changes | None:
        """What patch `name` changed, when it is applied."""
        return self._applied.get(name)

    def _closure(self, names: Iterable[str] | None) -> list[Patch]:
        """The named patches (all when None) and, for those switched on, what they require, in dependency order."""
        if names is None:
            return list(self.patches)
        wanted: set[str] = set()
        todo = list(names)
        while todo:
            name = todo.pop()
            if name in wanted:
                continue
            p = self._by_name.get(name)
            if p is None:
                raise KeyError(f"no {self.engine} patch is named {name!r}")
            wanted.add(name)
            if _off(p) is None:
                todo.extend(p.requires)
        return [p for p in self.patches if p.name in wanted]

    def _judge(self, p: Patch, statuses: dict[str, PatchStatus]) -> tuple[PatchStatus, str, Any]:
        """(status, reason, what the probe found) of `p`, without installing anything."""
        if p.name in self._applied:
            return PatchStatus.APPLIED, p.does, None
        off = _off(p)
        if off is not None:
            return PatchStatus.DISABLED, off, None
        for r in p.requires:
            got = statuses.get(r)
            if got not in (PatchStatus.APPLIED, PatchStatus.READY):
                return PatchStatus.NOT_COVERED, f"requires {r}, which is {got or 'not applied'}", None
        try:
            return PatchStatus.READY, p.does, p.probe()
        except NotNeeded as e:
            return PatchStatus.NOT_NEEDED, str(e), None
        except ShapeError as e:
            return PatchStatus.UNKNOWN_SHAPE, str(e), None
        except (NotCovered, ImportError) as e:
            return PatchStatus.NOT_COVERED, str(e) or type(e).__name__, None
        except Exception as e:  # a probe must never break the engine: an unreadable shape is an unknown one
            return PatchStatus.UNKNOWN_SHAPE, f"cannot inspect: {type(e).__name__}: {e}", None

    def apply(self, names: Iterable[str] | None = None) -> dict[str, PatchStatus]:
        """Apply every patch (or those named, with what they require) that can be; name -> status.

        Never raises for what it finds in the engine; a name no patch has is a KeyError (the caller's mistake).
        """
        with self._lock:
            statuses: dict[str, PatchStatus] = {}
            for p in self._closure(names):
                status, reason, found = self._judge(p, statuses)
                if status is PatchStatus.READY:
                    status, reason = self._install(p, found)
                statuses[p.name] = status
                self._log(p, status, reason)
            return statuses

    def _install(self, p: Patch, found: Any) -> tuple[PatchStatus, str]:
        changes = Changes(p.name)
        try:
            p.install(changes, found)
        except Exception as e:  # half a patch is worse than none: take back what it did
            changes.undo()
            return PatchStatus.UNKNOWN_SHAPE, f"install failed: {type(e).__name__}: {e}"
        self._applied[p.name] = changes
        return PatchStatus.APPLIED, p.does

    def _log(self, p: Patch, status: PatchStatus, reason: str) -> None:
        if status is PatchStatus.APPLIED:
            self.log.info("kvcached: %s patch %s applied", self.engine, p.name)
        elif status in (PatchStatus.UNKNOWN_SHAPE, PatchStatus.NOT_COVERED) and p.name not in self._warned:
            self._warned.add(p.name)  # once per process: apply() runs in every plugin load
            self.log.warning("kvcached: %s patch %s stands aside (%s): %s", self.engine, p.name, status, reason)
        elif status in (PatchStatus.NOT_NEEDED, PatchStatus.DISABLED):
            self.log.info("kvcached: %s patch %s skipped (%s): %s", self.engine, p.name, status, reason)

    def revert(self, names: Iterable[str] | None = None) -> None:
        """Undo applied patches (all, or those named and every applied patch requiring them), dependents first."""
        with self._lock:
            doomed = set(self._by_name) if names is None else set(names)
            for p in self.patches:  # dependency order: a requirement is seen before what requires it
                if any(r in doomed for r in p.requires):
                    doomed.add(p.name)
            for p in reversed(self.patches):
                if p.name in doomed and p.name in self._applied:
                    self._applied.pop(p.name).undo()

    def report(self) -> tuple[PatchReport, ...]:
        """Each patch's status as the engine processes of this environment would find it (nothing installed)."""
        with self._lock:
            statuses: dict[str, PatchStatus] = {}
            out = []
            for p in self.patches:
                status, reason, _ = self._judge(p, statuses)
                statuses[p.name] = status
                out.append(PatchReport(name=p.name, status=status, reason=reason, targets=p.targets,
                                       requires=p.requires))
            return tuple(out)


def _off(p: Patch) -> str | None:
    try:
        return p.switch()
    except Exception as e:  # a switch that cannot be read is off: a patch nobody asked for stays out
        return f"its switch cannot be read: {type(e).__name__}: {e}"

