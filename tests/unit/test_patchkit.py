"""The patch kit on plain Python classes and modules: transparent, idempotent, reversible wrappers; the registry.

No engine is needed: the kit knows none. Each target is a real class or module
built here, wrapped and unwrapped for real.
"""

from __future__ import annotations

import inspect
import logging
import types
from typing import Any

import pytest

from kvcached.integration.patchkit import (
    Changes,
    NotCovered,
    NotNeeded,
    Patch,
    PatchStatus,
    Registry,
    ShapeError,
    dependency_order,
    is_ours,
    key_of,
    original,
    require_fields,
    unwrap,
    which_field,
    which_params,
    wrap,
    wrapped_here,
)


class Base:
    def shutdown(self) -> str:
        """The base's shutdown."""
        return "base"


def make_class() -> type:
    class Target(Base):
        """A stand-in for an engine class."""

        def __init__(self, x: int, *, y: int = 1) -> None:
            self.x, self.y = x, y

        def step(self, n: int, /, scale: float = 1.0) -> float:
            """One step."""
            return n * scale

        @classmethod
        def build(cls, n: int) -> Any:
            return cls(n)

        @staticmethod
        def add(a: int, b: int = 2) -> int:
            return a + b

    return Target


def tag(label: str, log: list[str] | None = None):
    """A wrapper that records its call and passes everything through."""

    def wrapper(wrapped: Any, instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if log is not None:
            log.append(label)
        return wrapped(*args, **kwargs)

    return wrapper


# wrap / unwrap ------------------------------------------------------------------------


def test_a_wrapped_method_looks_like_the_original() -> None:
    cls = make_class()
    plain = cls.__dict__["step"]
    before = inspect.signature(cls.step)
    calls: list[str] = []
    wrap(cls, "step", tag("a", calls), key="a")
    assert cls.step.__name__ == "step" and cls.step.__qualname__ == plain.__qualname__
    assert cls.step.__doc__ == "One step." and cls.step.__module__ == plain.__module__
    assert inspect.signature(cls.step) == before
    assert inspect.signature(cls(1).step) == inspect.signature(plain.__get__(cls(1)))
    assert cls(1).step(3, scale=2.0) == 6.0 and calls == ["a"]
    assert is_ours(cls.__dict__["step"]) and key_of(cls.__dict__["step"]) == "a"
    assert original(cls.__dict__["step"]) is plain


@pytest.mark.parametrize("name, kind", [("build", classmethod), ("add", staticmethod)])
def test_classmethod_and_staticmethod_stay_what_they_are(name: str, kind: type) -> None:
    cls = make_class()
    before = inspect.signature(getattr(cls, name))
    wrap(cls, name, tag(name), key="k")
    assert isinstance(cls.__dict__[name], kind)  # as inspect.getattr_static and dataclass-like tools see it
    assert inspect.signature(getattr(cls, name)) == before
    if name == "build":
        assert isinstance(cls.build(5), cls) and cls.build(5).x == 5
        assert isinstance(cls(1).build(5), cls)  # through an instance too
    else:
        assert cls.add(1) == 3 and cls(1).add(1, b=5) == 6


def test_init_keeps_the_class_signature() -> None:
    cls = make_class()
    before = inspect.signature(cls)
    wrap(cls, "__init__", tag("init"), key="k")
    assert inspect.signature(cls) == before
    obj = cls(4, y=7)
    assert (obj.x, obj.y) == (4, 7)


def test_wrapping_twice_under_one_key_wraps_once() -> None:
    cls = make_class()
    calls: list[str] = []
    first = wrap(cls, "step", tag("a", calls), key="a")
    again = wrap(cls, "step", tag("a", calls), key="a")
    assert again is first and cls.__dict__["step"] is first
    cls(1).step(1)
    assert calls == ["a"]


def test_wrappers_come_off_in_any_order() -> None:
    cls = make_class()
    plain = cls.__dict__["step"]
    calls: list[str] = []
    a = wrap(cls, "step", tag("a", calls), key="a")
    b = wrap(cls, "step", tag("b", calls), key="b")
    cls(1).step(1)
    assert calls == ["b", "a"]
    assert unwrap(cls, "step", a)  # the inner one: spliced out, b stays outermost
    calls.clear()
    cls(1).step(1)
    assert calls == ["b"] and cls.__dict__["step"] is b and wrapped_here(cls, "step", b)
    assert not wrapped_here(cls, "step", a)
    assert unwrap(cls, "step", b)
    assert cls.__dict__["step"] is plain
    assert not unwrap(cls, "step", b)  # gone already: nothing to do, nothing raised


def test_an_inherited_method_is_overridden_and_the_override_removed() -> None:
    cls = make_class()
    assert "shutdown" not in cls.__dict__
    handle = wrap(cls, "shutdown", tag("s"), key="s")
    assert "shutdown" in cls.__dict__ and cls(1).shutdown() == "base"
    assert Base.__dict__["shutdown"] is original(cls.__dict__["shutdown"])  # the base is untouched
    unwrap(cls, "shutdown", handle)
    assert "shutdown" not in cls.__dict__ and cls.shutdown is Base.shutdown


def test_module_functions_and_names_bound_to_classes() -> None:
    mod = types.ModuleType("engine_mod")

    def wait(launch: Any, parallel_config: Any) -> str:
        return "ready"

    mod.wait = wait
    mod.Pool = Base
    calls: list[str] = []
    hw = wrap(mod, "wait", tag("w", calls), key="k")
    hp = wrap(mod, "Pool", lambda wrapped, _i, a, k: ("ours", wrapped(*a, **k)), key="k")
    assert mod.wait(1, parallel_config=2) == "ready" and calls == ["w"]
    assert inspect.signature(mod.wait) == inspect.signature(wait)
    made = mod.Pool()
    assert made[0] == "ours" and isinstance(made[1], Base) and isinstance(made[1], mod.Pool)
    assert mod.Pool == Base and original(mod.Pool) is Base  # what a probe compares against
    unwrap(mod, "wait", hw)
    unwrap(mod, "Pool", hp)
    assert mod.wait is wait and mod.Pool is Base


def test_changes_undo_everything_a_patch_did_last_first() -> None:
    cls = make_class()
    plain = {n: cls.__dict__[n] for n in ("step", "build", "__init__")}
    undone: list[str] = []
    changes = Changes("p")
    for n in plain:
        changes.wrap(cls, n, tag(n))
    changes.on_undo(lambda: undone.append("state"))
    assert [w[1] for w in changes.wraps] == list(plain)
    changes.undo()
    assert {n: cls.__dict__[n] for n in plain} == plain and undone == ["state"]
    assert changes.wraps == ()


# the registry ------------------------------------------------------------------------------


def _patch(name: str, cls: type, *, requires: tuple[str, ...] = (), probe: Any = None, switch: Any = None,
           log: list[str] | None = None, fail_install: bool = False) -> Patch:
    def install(changes: Changes, found: Any) -> None:
        changes.wrap(found, "step", tag(name, log))
        if fail_install:
            raise RuntimeError("half-way")

    extra: dict[str, Any] = {} if switch is None else {"switch": switch}
    return Patch(name=name, does=f"{name} does its thing", targets=(f"t:{name}",),
                 probe=probe or (lambda: cls), install=install, requires=requires, **extra)


def test_dependency_order_and_bad_declarations() -> None:
    cls = make_class()
    a, b, c = _patch("a", cls, requires=("b",)), _patch("b", cls), _patch("c", cls, requires=("a",))
    assert [p.name for p in dependency_order((c, a, b))] == ["b", "a", "c"]
    with pytest.raises(ValueError, match="not declared"):
        dependency_order((a,))
    with pytest.raises(ValueError, match="require each other"):
        dependency_order((_patch("x", cls, requires=("y",)), _patch("y", cls, requires=("x",))))
    with pytest.raises(ValueError, match="two patches"):
        dependency_order((b, _patch("b", cls)))


def test_apply_pulls_in_requirements_first_and_reports(caplog) -> None:
    cls = make_class()
    calls: list[str] = []
    reg = Registry("Engine", (_patch("dependent", cls, requires=("base",), log=calls),
                              _patch("base", cls, log=calls), _patch("other", cls)), logging.getLogger("t.reg"))
    assert [p.status for p in reg.report()] == [PatchStatus.READY] * 3
    assert reg.applied() == () and not is_ours(cls.__dict__["step"])  # reporting installs nothing
    with caplog.at_level(logging.INFO, logger="t.reg"):
        assert reg.apply(("dependent",)) == {"base": PatchStatus.APPLIED, "dependent": PatchStatus.APPLIED}
    assert reg.applied() == ("base", "dependent") and "Engine patch base applied" in caplog.text
    cls(1).step(1)
    assert calls == ["dependent", "base"]  # the dependent's wrapper outside the requirement's
    assert reg.apply() == {"base": PatchStatus.APPLIED, "dependent": PatchStatus.APPLIED,
                           "other": PatchStatus.APPLIED}
    assert reg.apply()["base"] is PatchStatus.APPLIED and len(calls) == 2  # nothing wrapped twice
    reg.revert(("base",))  # what requires it goes first
    assert reg.applied() == ("other",)
    reg.revert()
    assert not is_ours(cls.__dict__["step"])


def test_a_switched_off_patch_pulls_in_nothing() -> None:
    cls = make_class()
    reg = Registry("Engine", (_patch("base", cls), _patch("opt", cls, requires=("base",),
                                                         switch=lambda: "off (set OPT=1)")), logging.getLogger("t"))
    assert reg.apply(("opt",)) == {"opt": PatchStatus.DISABLED}
    assert reg.applied() == ()
    assert {p.name: p.reason for p in reg.report()}["opt"] == "off (set OPT=1)"


def test_each_failure_has_its_status_and_one_warning(caplog) -> None:
    cls = make_class()

    def shape() -> Any:
        raise ShapeError("Target.step() takes arguments now")

    def needless() -> Any:
        raise NotNeeded("the engine does it itself")

    def absent() -> Any:
        raise ImportError("No module named 'engine.part'")

    def broken() -> Any:
        raise TypeError("unexpected")

    def uncovered() -> Any:
        raise NotCovered("this build has no such part")

    patches = (_patch("shape", cls, probe=shape), _patch("needs-shape", cls, requires=("shape",)),
               _patch("needless", cls, probe=needless), _patch("absent", cls, probe=absent),
               _patch("broken", cls, probe=broken), _patch("uncovered", cls, probe=uncovered),
               _patch("half", cls, fail_install=True))
    reg = Registry("Engine", patches, logging.getLogger("t.fail"))
    U, N, C = PatchStatus.UNKNOWN_SHAPE, PatchStatus.NOT_NEEDED, PatchStatus.NOT_COVERED
    with caplog.at_level(logging.WARNING, logger="t.fail"):
        first = reg.apply()
        second = reg.apply()
    assert first == second == {"shape": U, "needs-shape": C, "needless": N, "absent": C, "broken": U,
                               "uncovered": C, "half": U}
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 6  # one per patch that stands aside, not one per apply(); none for "not needed"
    assert "Engine patch shape stands aside (unknown_shape): Target.step() takes arguments now" in warned[0]
    reasons = {p.name: p.reason for p in reg.report()}
    assert reasons["needs-shape"] == "requires shape, which is unknown_shape"
    assert reasons["broken"] == "cannot inspect: TypeError: unexpected"
    assert not is_ours(cls.__dict__["step"])  # the half-installed patch took its wrapper back
    assert reg.applied() == ()


def test_an_unknown_patch_name_is_a_key_error() -> None:
    reg = Registry("Engine", (_patch("a", make_class()),), logging.getLogger("t"))
    with pytest.raises(KeyError, match="no Engine patch is named 'b'"):
        reg.apply(("b",))


def test_a_plugin_loaded_with_kvcached_off_imports_no_patch_kit() -> None:
    """vLLM and SGLang load their plugins in every process they start, kvcached on or off: off, the plugins'
    shared entry frame (kvcached.integration.run_once) returns before anything else is imported."""
    import os
    import subprocess
    import sys

    code = ("import sys\n"
            "import kvcached.integration.vllm.plugin as v, kvcached.integration.sglang.plugin as s\n"
            "v.register(); s.register()\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('wrapt', 'torch', 'vllm', 'sglang')\n"
            "             or m in ('kvcached.integration.patchkit', 'kvcached.node.ops.detectdoc')))\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("KVCACHED_ENABLE", "ENABLE_KVCACHED", "KVCACHED_ELASTIC")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"


# -- shapes per version: what differs is named ------------------------------------------------


def test_which_params_picks_the_shape_the_code_has_and_names_what_differs() -> None:
    """The key of the matching shape; otherwise the function, its parameters and each shape's first difference."""
    shapes = {"v1": ["self", "blocks"], "v2": ["self", "blocks", "evict_first"]}

    def old(self, blocks): ...

    def new(self, blocks, evict_first=False): ...

    def renamed(self, ordered, evict_first=False): ...

    def longer(self, blocks, evict_first=False, more=None): ...

    assert which_params(old, "Pool.free", shapes) == "v1"
    assert which_params(new, "Pool.free", shapes) == "v2"
    assert which_params(longer, "Pool.free", shapes, prefix=True) == "v1"  # a prefix: the first shape that fits
    with pytest.raises(ShapeError) as e:
        which_params(renamed, "Pool.free", shapes)
    assert str(e.value) == ("Pool.free(self, ordered, evict_first) has none of the known shapes: "
                            "v1's (self, blocks): parameter 2 is ordered, not blocks; "
                            "v2's (self, blocks, evict_first): parameter 2 is ordered, not blocks")
    with pytest.raises(ShapeError, match=r"v2's \(self, blocks, evict_first\): it adds more"):
        which_params(longer, "Pool.free", shapes)
    with pytest.raises(ShapeError, match=r"v1's \(self, blocks\): it lacks blocks"):
        which_params(lambda self: None, "Pool.free", shapes)
    with pytest.raises(ShapeError, match="Pool.free is missing or has no signature"):
        which_params(None, "Pool.free", shapes)


def test_field_checks_name_only_the_fields_that_are_missing() -> None:
    """A dataclass's fields: the missing ones named, the ones still there not; one of several alternatives."""
    from dataclasses import dataclass

    @dataclass
    class Block:
        block_id: int
        ref_cnt: int = 0
        block_hash: bytes | None = None

    require_fields(Block, "Block", ["block_id", "ref_cnt"])
    with pytest.raises(ShapeError) as e:
        require_fields(Block, "Block", ["block_id", "is_null", "ref_cnt", "prev_free_block"])
    assert str(e.value) == "Block has no field is_null, prev_free_block"
    assert which_field(Block, "Block", {"v1": "_block_hash", "v2": "block_hash"}) == "v2"
    with pytest.raises(ShapeError) as e:
        which_field(Block, "Block", {"v1": "_hash", "v2": "hash"})
    assert str(e.value) == "Block has none of the fields _hash (v1), hash (v2)"
