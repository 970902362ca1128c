"""One exit-code enum, two total tables: every run outcome and every error category has its code."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import kvcached.node
from kvcached.node.base.enums import Category, Outcome
from kvcached.node.base.errors import KvcachedError
from kvctl.exitcodes import CATEGORY_EXIT, OUTCOME_EXIT, Exit, describe, exit_of


def test_every_outcome_has_an_exit_code() -> None:
    assert set(OUTCOME_EXIT) == set(Outcome)
    assert {o: exit_of(o) for o in Outcome} == {Outcome.CLEAN: Exit.OK, Outcome.STALE_REMAIN: Exit.STALE_REMAIN,
                                                Outcome.PARTIAL_FAILURE: Exit.PARTIAL_FAILURE}


def test_every_error_category_has_an_exit_code() -> None:
    assert set(CATEGORY_EXIT) == set(Category)
    assert all(isinstance(code, Exit) for code in CATEGORY_EXIT.values())


def _node_errors() -> list[type[KvcachedError]]:
    out = []
    for m in pkgutil.walk_packages(kvcached.node.__path__, "kvcached.node."):
        module = importlib.import_module(m.name)
        out += [c for _, c in inspect.getmembers(module, inspect.isclass)
                if issubclass(c, KvcachedError) and c.__module__ == m.name]
    return out


def test_every_node_error_carries_a_category_and_reaches_its_code() -> None:
    errors = _node_errors()
    assert len(errors) >= 15  # the walk found them
    for cls in errors:
        assert isinstance(cls.category, Category), cls
        exc = cls.__new__(cls)  # a bare instance: its class decides the code, not its message
        Exception.__init__(exc, "boom")
        code, message = describe(exc)
        assert code is CATEGORY_EXIT[cls.category] and message == "boom", cls


@pytest.mark.parametrize("name, code", [
    ("BadValue", Exit.USAGE), ("InvalidName", Exit.USAGE), ("PathTooLong", Exit.USAGE),
    ("SegmentMissing", Exit.NOT_FOUND), ("ProcessNotFound", Exit.NOT_FOUND), ("NoMatch", Exit.NOT_FOUND),
    ("NotASegment", Exit.REFUSED), ("Refused", Exit.REFUSED), ("LockBusy", Exit.LOCK_BUSY),
    ("SegmentBusy", Exit.ERROR), ("MetricsError", Exit.ERROR), ("LockUnavailable", Exit.ERROR),
])
def test_the_codes_readme_documents_for_each_error(name: str, code: Exit) -> None:
    [cls] = [c for c in _node_errors() if c.__name__ == name]
    assert CATEGORY_EXIT[cls.category] is code
